"""Prompt logprobs: each prompt token's log-probability given the tokens before it, its rank and the top N
(vLLM's ``prompt_logprobs``; what the completions API's ``echo`` with ``logprobs`` returns).

They are computed in the prefill, chunk by chunk: a chunk over positions [start, end) of a prompt also
yields the final hidden states of those positions (``Request.unscored`` says which), and position p's
logits score prompt token p + 1. Those logits are made a slice of rows at a time (``rows_per_slice``: a
long chunk never holds a [chunk, vocab] float32 tensor), turned into a float32 log-softmax, reduced to
(the prompt token's logprob, its rank, the top N) and dropped before the next slice. As with sampled
tokens' logprobs, they are the raw model distribution's. The first prompt token has none (vLLM's None).
"""

from __future__ import annotations

import torch

from mili.host_copy import tensor_on

SLICE_ELEMENTS = 1 << 25  # float32 logits of one slice at most (128 MiB)
MAX_SLICE_ROWS = 512

# One scored position: (the prompt token's logprob, its rank (1 = most likely), [(token id, logprob), ...]
# the top N, best first) -- the shape of a sampled token's logprobs on the wire (messages.SeqDelta).
Scored = tuple[float, int, list[tuple[int, float]]]


def rows_per_slice(vocab_size: int) -> int:
    return max(1, min(MAX_SLICE_ROWS, SLICE_ELEMENTS // vocab_size))


class PromptScorer:
    """Scores a step's prompt rows slice by slice (``__call__`` per slice, in row order), then hands each
    sequence its entries (``split``)."""

    def __init__(self, targets: list[int], num_top: list[int], vocab_size: int, device: torch.device):
        """``targets[r]``: the prompt token row r scores; ``num_top[r]``: how many alternatives it wants."""
        self.targets = tensor_on(targets, device).unsqueeze(1)
        self.num_top = num_top
        self.max_top = min(max(num_top), vocab_size)
        self.vocab_size = vocab_size
        self.scored: list[Scored] = []

    def __call__(self, first_row: int, logits: torch.Tensor) -> None:
        """``logits`` [rows, >= vocab] of the rows ``first_row ..``, in the model's dtype."""
        logits = logits[:, :self.vocab_size].float()
        rows = range(first_row, first_row + logits.shape[0])
        target = self.targets[first_row:rows.stop]
        logprobs = logits.log_softmax(dim=-1).nan_to_num_(nan=float("-inf"))  # finite or -inf, as the sampler's
        token_lp = logprobs.gather(1, target).squeeze(1).tolist()
        rank = ((logits > logits.gather(1, target)).sum(dim=-1) + 1).tolist()
        top_vals, top_ids = [[]] * len(rows), [[]] * len(rows)
        if self.max_top:
            vals, ids = logprobs.topk(self.max_top, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for j, row in enumerate(rows):
            n = self.num_top[row]
            self.scored.append((token_lp[j], rank[j], list(zip(top_ids[j][:n], top_vals[j][:n]))))

    def split(self, counts: list[int]) -> list[list[Scored]]:
        """The scored rows cut into consecutive groups of ``counts`` (one per sequence)."""
        out, at = [], 0
        for n in counts:
            out.append(self.scored[at:at + n])
            at += n
        assert at == len(self.scored), (at, len(self.scored))
        return out
