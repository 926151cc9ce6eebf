"""The engine core's speculative-decoding counters (sent to the API side with its gauges)."""

from __future__ import annotations


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int):
        self.enabled = num_speculative_tokens > 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def add(self, num_drafted: list[int], num_accepted: list[int]) -> None:
        """One step's sampling sequences: how many drafts each verified, and accepted (a prefix of them)."""
        for drafted, accepted in zip(num_drafted, num_accepted):
            if drafted:
                self.num_drafts += 1
                self.num_draft_tokens += drafted
                self.num_accepted_tokens += accepted
                for pos in range(accepted):
                    self.accepted_per_pos[pos] += 1

    def as_dict(self) -> dict:
        """``LLMEngine.spec_decode_stats()``: vLLM's names."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos)}

    def totals(self) -> tuple[int, int, int, list[int]] | None:
        """(drafts, draft tokens, accepted tokens, accepted by position); None when speculation is off."""
        if not self.enabled:
            return None
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
