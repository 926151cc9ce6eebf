"""The persistent page-table rows (``runtime/input_batch.PageTables``): after every change the scheduler makes to a
sequence's pages (new pages, a copy-on-write of its last computed page, a cut after rejected drafts, a table
replaced on a fresh start, rows reclaimed from sequences that stopped), the rows a step gathers equal the tables
themselves."""

from __future__ import annotations

import random
import torch

from mili.engine.request import SeqStatus
from mili.runtime.input_batch import PageTables

PAGE = 4


class _Seq:
    """What PageTables reads of a Sequence (hashed by identity, as Sequence is)."""

    def __init__(self, pages):
        self.page_table, self.num_computed_tokens, self.status = list(pages), 0, SeqStatus.RUNNING


def _seq(pages):
    return _Seq(pages)


def _check(got: torch.Tensor, seqs) -> None:
    """Each row starts with its sequence's table; past it (never read: attention stops at the context) a page id
    that was real once, or 0."""
    assert got.shape == (len(seqs), max(len(s.page_table) for s in seqs))
    for row, seq in zip(got.tolist(), seqs):
        assert row[:len(seq.page_table)] == seq.page_table
        assert all(p == 0 or p < 10**6 for p in row)


def test_rows_follow_every_change_the_scheduler_makes():
    rng = random.Random(0)
    tables = PageTables(num_rows=6, max_pages=16, device=torch.device("cpu"))
    seqs = [_seq([rng.randrange(1000)]) for _ in range(3)]
    fresh = iter(range(1000, 10**6))
    for step in range(300):
        batch = rng.sample(seqs, rng.randrange(1, len(seqs) + 1))  # (the step's sequences; the scheduler changes
        for seq in batch:                                          # a table only as it schedules its sequence)
            op = rng.random()
            if op < 0.4 and len(seq.page_table) < 16:  # a new page (in place)
                seq.page_table += [next(fresh)]
            elif op < 0.55:  # copy-on-write of the page its computed tokens end in (they only grow)
                seq.num_computed_tokens = rng.randrange(seq.num_computed_tokens, len(seq.page_table) * PAGE)
                seq.page_table[seq.num_computed_tokens // PAGE] = next(fresh)
            elif op < 0.65:  # preempted, then started afresh from the cache: a new list
                seq.page_table = [next(fresh) for _ in range(rng.randrange(1, 5))]
                seq.num_computed_tokens = 0
        _check(tables.rows(batch, PAGE), batch)
        for seq in batch:  # after the step: rejected drafts' pages go
            if rng.random() < 0.1 and len(seq.page_table) > 1:
                keep = rng.randrange(1, len(seq.page_table))
                seq.num_computed_tokens = min(seq.num_computed_tokens, keep * PAGE - 1)
                del seq.page_table[keep:]
        if rng.random() < 0.1:  # one finishes, another arrives (rows are reclaimed when none is free)
            seqs[0].status = SeqStatus.FINISHED
            seqs = seqs[1:] + [_seq([next(fresh)])]
    assert len(tables.mirror) <= 6
