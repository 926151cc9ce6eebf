"""A thinking budget per sequence (``SamplingParams.thinking_token_budget``): at most that many tokens after
``<think>``, then the budget's message and ``</think>`` are forced, one a step, and the model answers from there.

A sequence starts inside its thinking when its prompt ends in an open ``<think>`` (a template that opens it,
Qwen3.5's), else it waits for the model to write ``<think>`` (Qwen3's). The count is exact with speculative decoding:
a step's drafts never take it past the budget's end (``trim``), so the forced tokens are never drafted over. The
engine core runs such requests' steps in turn (their next token depends on the last one read)."""

from __future__ import annotations

from mili.sampling_params import ThinkingTokens

BEFORE, THINKING, FORCING, DONE = "before", "thinking", "forcing", "done"


class ThinkingBudget:
    def __init__(self, budget: int, tokens: ThinkingTokens, prompt: list[int]):
        self.budget, self.tokens = budget, tokens
        self.count = 0  # the thinking tokens so far (after <think>, before </think>)
        self.forcing: list[int] = []  # what is left to force
        opened = _last(prompt, tokens.start) > _last(prompt, tokens.end)
        self.state = BEFORE
        if opened:
            self._start()

    def _start(self) -> None:
        self.state = THINKING
        if self.count >= self.budget:
            self._force()

    def _force(self) -> None:
        self.state, self.forcing = FORCING, list(self.tokens.forced)

    @property
    def forced_next(self) -> int | None:
        """The token this sequence draws next, whatever the model says (None: its own draw)."""
        return self.forcing[0] if self.forcing else None

    def accept(self, token: int) -> None:
        """A token taken into the sequence."""
        if self.state == FORCING:
            self.forcing.pop(0)
            if not self.forcing:
                self.state = DONE
        elif self.state == BEFORE:
            if token == self.tokens.start:
                self._start()
        elif self.state == THINKING:
            if token == self.tokens.end:
                self.state = DONE
                return
            self.count += 1
            if self.count >= self.budget:
                self._force()

    def trim(self, draft: list[int]) -> list[int]:
        """``draft`` cut so that the step it is verified in can't pass the budget's end, nor draft over a forced
        token. A step takes its accepted drafts and one token of its own: while thinking, at most the budget's rest
        less one drafts; before it, at most the budget (a ``<think>`` among them leaves at most that many after it).
        By length alone, so MTP's drafts, whose tokens come later, are cut the same."""
        if self.state == FORCING:
            return []
        if self.state == THINKING:
            return draft[:max(0, self.budget - self.count - 1)]
        if self.state == BEFORE:
            return draft[:self.budget]
        return draft


def _last(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
