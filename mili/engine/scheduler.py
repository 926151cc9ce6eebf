"""Continuous batching: which sequences run this step, and how many tokens each computes.

Each step has a token budget (``max_num_batched_tokens``) shared by decodes (one token each) and
prefill chunks. Running sequences go first, in arrival order; when the pool is out of pages the newest
running sequence is preempted (its pages freed, its tokens kept, recomputed later). Waiting sequences
are admitted in FCFS order only in steps that preempted nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mili.cache.page_pool import PagePool
from mili.engine.request import Request, Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decodes (one new token) first, then prefill chunks
    # (sequence, index into ``scheduled`` whose last-token logits it samples from): forked children
    # sample from their parent's row.
    sample_rows: list[tuple[Sequence, int]]
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request.seqs[0])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._reserve(seq, n, copies):
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            victim = self.running.pop()  # the newest; never one already scheduled (those are < i)
            self._preempt(victim)
            preempted = True
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            width = 1 + len(seq.request.unborn()) if seq.index == 0 else 1
            if len(self.running) + width > self.max_num_seqs:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n, copies):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        sample_rows = []
        for row, s in enumerate(scheduled):
            if s.samples:
                sample_rows.append((s.seq, row))
                sample_rows += [(child, row) for child in self._fork(s)]
        return SchedulerOutput(scheduled, sample_rows, copies)

    def _reserve(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> bool:
        """Give ``seq`` pages for ``n`` more tokens, copying a shared page it would write into."""
        pool, size = self.pool, self.pool.page_size
        need = pool.pages_for(seq.num_computed_tokens + n) - len(seq.page_table)
        partial = seq.num_computed_tokens // size
        cow = seq.num_computed_tokens % size != 0 and pool.ref_counts[seq.page_table[partial]] > 1
        if need + cow > pool.num_free:
            return False
        if cow:
            old, (new,) = seq.page_table[partial], pool.allocate(1)
            copies.append((old, new))
            seq.page_table[partial] = new
            pool.decref([old])
        seq.page_table += pool.allocate(need)
        return True

    def _fork(self, s: ScheduledSeq) -> list[Sequence]:
        """At the end of the first sequence's prompt prefill, its unborn siblings share its pages."""
        parent = s.seq
        if parent.index != 0:
            return []
        children = parent.request.unborn()
        for child in children:
            child.page_table = list(parent.page_table)
            self.pool.incref(child.page_table)
            child.num_computed_tokens = parent.num_computed_tokens + s.num_new_tokens
            child.status = SeqStatus.RUNNING
            self.running.append(child)
        return children

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.pool.decref(seq.page_table)
        seq.page_table = []

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (done, or aborted in any state) and give its pages back."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def check_integrity(self) -> None:
        holders = [s.page_table for s in self.running] + [s.page_table for s in self.waiting]
        assert all(not s.page_table for s in self.waiting), "a waiting sequence holds pages"
        self.pool.check_integrity(holders)
