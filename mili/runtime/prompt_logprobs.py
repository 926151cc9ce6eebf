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
from mili.runtime.pooler import pool

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


def prompt_scorer(scoring: list, vocab_size: int, device: torch.device) -> PromptScorer | None:
    """The scorer of a step's prompt rows (``InputBatchBuilder.prepare``'s ``scoring``: [(sequence, its positions)]:
    position p scores prompt token p + 1), or None where the step scores none."""
    if not scoring:
        return None
    return PromptScorer([seq.token_ids[p + 1] for seq, rows in scoring for p in rows],
                        [seq.params.prompt_logprobs for seq, rows in scoring for _ in rows], vocab_size, device)


def scored_by_sequence(scoring: list, scorer: PromptScorer | None) -> list[tuple]:
    """[(sequence, its ``Scored`` entries in position order)] of a step's ``scoring``, once ``scorer`` has its rows."""
    if scorer is None:
        return []
    return list(zip([seq for seq, _ in scoring], scorer.split([len(rows) for _, rows in scoring])))


def step_logits(model, hidden: torch.Tensor, batch, vocab_size: int,
                scorer: PromptScorer | None = None) -> tuple[torch.Tensor, list]:
    """The logits of the sampling rows of ``hidden``, and the answers of its pooling rows (``pooler.py``); its last
    ``num_prompt_rows`` rows (prompt positions) have theirs made a slice at a time and handed to ``scorer``. Every
    tensor-parallel rank makes the same calls (each gathers the vocabulary shards)."""
    num_prompt_rows, num_pool_rows = batch.num_prompt_rows, batch.num_pool_rows
    num_sampling = hidden.shape[0] - num_prompt_rows - num_pool_rows
    logits = model.compute_logits(hidden[:num_sampling])
    pooled = pool(model, hidden[num_sampling:num_sampling + num_pool_rows], batch.pooling) if num_pool_rows else []
    first = num_sampling + num_pool_rows
    step = rows_per_slice(vocab_size)
    for start in range(0, num_prompt_rows, step):
        part = model.compute_logits(hidden[first + start:first + start + step])
        if scorer is not None:
            scorer(start, part)
    return logits, pooled
