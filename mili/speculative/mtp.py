"""MTP drafts: the checkpoint's multi-token-prediction head (Qwen3.5 / 3.6, Qwen3-Next) proposes the drafts.

The head (model/qwen3_5.py ``MultiTokenPredictor``) reads a pair (h, t): the main model's final-normed hidden
state at position p - 1 and the token at p; its entry in the head's own KV (one more attention layer in the
runner's ``kv_caches``: the same pages and slots as the model's) sits at position p's slot, so a page's
entries depend only on the tokens up to it, and pages, copy-on-write and the prefix cache need nothing new.

A step, on the runner (``ModelRunner.execute``), for the ``MtpDrafter`` here:

1. ``draft``: the scheduler gave each drafting sequence k placeholder drafts (``Drafter.propose``; pages for
   them are reserved). A sequence of N tokens drafts from the pair (h at N - 2, its last token) at position
   N - 1: the head's argmax is d_0, its output and d_0 the next pair at N, and so on, k passes batched over
   the drafting sequences (each pass writes its pair's K/V at the slot the verification computes next).
2. ``write``: after the model's forward, every position p the step computed gets its pair
   (h at p - 1, token at p) written, batched with the step's own positions, slots and pages (a chunk's first
   pair takes h from the sequence's kept rows, zeros where none are kept: after a prefix-cache hit).
   Positions a rejection leaves uncomputed are written again when they are recomputed.
3. ``keep``: each sequence keeps (``Sequence.mtp_hidden``) the hidden rows it needs next: from position
   num_computed - 1 (the next chunk's first pair) to N - 2 (its next drafts) — one row, or, for a hybrid
   that recomputes a chunk after a rejection, the accepted part of that chunk too.

Drafts are greedy and their verification (mili/speculative/__init__.py) exact, so what the head computes changes
speed, never output. Not drafted for: sequences with structured outputs (their grammar's mask is built
while the drafts are not yet computed).
"""

from __future__ import annotations

import torch

# the scheduler's placeholder for a draft token the runner fills in before the step's forward
PENDING = -1


def kept_rows(seq, lo: int, hi: int) -> torch.Tensor | None:
    """The kept hidden rows of ``seq`` for positions lo .. hi, or None when it does not keep them all."""
    kept = seq.mtp_hidden
    if kept is None or lo < kept[0] or hi >= kept[0] + kept[1].shape[0] or lo > hi:
        return None
    return kept[1][lo - kept[0]:hi + 1 - kept[0]]


def can_draft(seq) -> bool:
    """Whether ``seq`` keeps the hidden row its drafts start from (position num_tokens - 2)."""
    return seq.grammar is None and kept_rows(seq, seq.num_tokens - 2, seq.num_tokens - 2) is not None


class MtpDrafter:
    """Runs the head for the runner: ``kv_cache`` is its (K, V) pages; ``make_batch(page_tables, positions)``
    builds a ForwardBatch of one new token per sequence at those positions."""

    def __init__(self, model, kv_cache: tuple[torch.Tensor, torch.Tensor], make_batch):
        self.model, self.kv_cache, self.make_batch = model, kv_cache, make_batch

    def draft(self, scheduled) -> None:
        drafting = [s for s in scheduled if s.draft]
        if not drafting:
            return
        device = self.kv_cache[0].device
        hidden = torch.cat([kept_rows(s.seq, s.seq.num_tokens - 2, s.seq.num_tokens - 2) for s in drafting])
        tokens = torch.tensor([s.seq.token_ids[-1] for s in drafting], device=device)
        for j in range(max(len(s.draft) for s in drafting)):
            active = [i for i, s in enumerate(drafting) if len(s.draft) > j]
            if len(active) < len(drafting):
                index = torch.tensor(active, device=device)
                hidden, tokens = hidden[index], tokens[index]
                drafting = [drafting[i] for i in active]
            batch = self.make_batch([s.seq.page_table for s in drafting],
                                    [s.seq.num_tokens - 1 + j for s in drafting], tokens)
            hidden = self.model.mtp_forward(tokens, hidden, batch, self.kv_cache)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            for s, token in zip(drafting, tokens.tolist()):
                s.draft[j] = token

    def write(self, batch, scheduled) -> None:
        """The pairs of every position the step computed (``batch``'s rows, in ``scheduled`` order)."""
        h = self.model.hidden_states
        prev = torch.empty_like(h)
        prev[1:] = h[:-1]
        row = 0
        for s in scheduled:
            start = s.seq.num_computed_tokens
            first = kept_rows(s.seq, start - 1, start - 1)
            prev[row] = first[0] if first is not None else 0
            row += s.num_new_tokens
        self.model.mtp_forward(batch.input_ids, prev, batch, self.kv_cache, write_only=True)

    def keep(self, scheduled, sample_rows, num_accepted: dict, num_rejected: dict) -> None:
        """After the step's verification (``num_accepted``: sequence -> drafts it accepted; ``num_rejected``:
        sequence -> positions of the step that stay uncomputed), before the scheduler accounts it: each sequence keeps its hidden rows from num_computed - 1 to
        its last position computed on the right tokens (see the module doc); forked children their parent's."""
        h, row = self.model.hidden_states, 0
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            last = start + n - len(s.draft) + num_accepted.get(seq, 0) - 1  # computed on the right tokens
            lo = start + n - num_rejected.get(seq, 0) - 1
            new = h[row + max(lo - start, 0):row + last - start + 1]
            old = kept_rows(seq, lo, start - 1) if lo < start else None
            if old is not None:
                new = torch.cat([old, new])
            elif lo < start:
                lo = start
            seq.mtp_hidden = (lo, new.clone()) if new.shape[0] else None
            row += n
        for seq, i in sample_rows:
            if seq is not scheduled[i].seq:
                seq.mtp_hidden = scheduled[i].seq.mtp_hidden
        self.model.hidden_states = None
