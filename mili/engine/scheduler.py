"""Continuous batching: which sequences run this step, and how many tokens each computes.

Each step has a token budget (``max_num_batched_tokens``) shared by decodes (one token each) and
prefill chunks. Running sequences go first, in arrival order; when the pool is out of pages, cached
idle pages are evicted first, then the newest running sequence is preempted (its tokens kept, its
computed pages put in the prefix cache, the rest recomputed later). Waiting sequences are admitted only
in steps that preempted nothing, FCFS or longest-cached-prefix first (``lpm``); admission starts a
sequence from the longest prefix the cache holds.

Hybrid models (``states``): every admitted sequence also holds a recurrent-state slot (cache/state_pool.py);
a sequence is admitted only when a slot is free, gives it back when it finishes or is preempted, and a
forked sequence's slot takes its parent's state once the step that forked it has run (``state_copies``).
With the prefix cache on, a hybrid sequence resumes only from a snapshot of the recurrent state: where
they are taken, and how chunks are cut for them, is ``state_snapshots.py``'s.

Speculative decoding (``drafter``): a running sequence about to sample, with at most 1 + k tokens left to
compute, is given up to k draft tokens to verify in the same step (``ScheduledSeq.draft``, computed after
its own tokens), while the running batch is at most ``disable_by_batch_size``. After the step, the
runner's ``num_rejected`` positions (the drafts the sampler did not accept; for a hybrid, whose recurrent state
cannot step back, the whole chunk when any draft was rejected: its state is restored and the chunk
recomputed) are uncomputed again, and pages that hold only those positions go back.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mili.cache.hybrid_radix_cache import HybridRadixCache
from mili.cache.page_pool import PagePool
from mili.cache.radix_cache import NoPrefixCache, PrefixCache
from mili.cache.state_pool import StatePool
from mili.engine.request import Request, Sequence, SeqStatus
from mili.engine.state_snapshots import StateSnapshots

if TYPE_CHECKING:
    from mili.speculative.drafter import Drafter

LPM_MAX_QUEUE = 128  # above this many waiting, matching them all each step costs more than it saves


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # the sequence's own tokens computed this step, then its drafts
    draft: list[int] = field(default_factory=list)  # speculative decoding: the drafted tokens it verifies

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last token, so a new token is sampled (never for a
        request that asks for none: max_tokens 0 scores its prompt only)."""
        return (self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens
                and self.seq.params.max_tokens != 0)

    @property
    def pools(self) -> bool:
        """Whether this step computes the last prompt token of a pooling request (embeddings, scores): its final
        hidden state is the request's answer."""
        return (self.seq.params.pooling is not None
                and self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decodes (one new token) first, then prefill chunks
    # (sequence, index into ``scheduled`` whose last-token logits it samples from): forked children
    # sample from their parent's row.
    sample_rows: list[tuple[Sequence, int]]
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # hybrids: (parent slot, child slot) of the sequences forked this step, copied after the forward pass
    state_copies: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    def __init__(self, pool: PagePool, cache: PrefixCache, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", starvation_steps: int = 64, states: StatePool | None = None,
                 drafter: "Drafter | None" = None, max_loras: int = 0):
        self.pool, self.cache, self.states = pool, cache, states
        self.max_loras = max_loras  # LoRA: the most different adapters the running sequences may use (0: off)
        self.drafter = drafter
        # hybrids with the prefix cache: where recurrent-state snapshots are taken and resumed from
        self.snapshots = StateSnapshots(cache, pool.page_size) \
            if states is not None and isinstance(cache, HybridRadixCache) else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.starvation_steps = starvation_steps  # lpm: a sequence waiting this long goes first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.step_count = 0
        self._arrivals = itertools.count()
        self._enqueued_at: dict[Sequence, tuple[int, int]] = {}  # seq -> (step, arrival number) it queued

    def add(self, request: Request) -> None:
        self._enqueue(request.seqs[0])

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        self._enqueued_at.setdefault(seq, (self.step_count, next(self._arrivals)))
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted = False
        drafter = self.drafter if self.drafter is not None and self.drafter.active(len(self.running)) else None
        num_drafting = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.pending_at is not None and seq.num_tokens >= seq.request.max_total_tokens:
                i += 1  # its token in flight is its last (its length): nothing more to compute
                continue
            draft = self._draft(seq, budget) if drafter is not None and num_drafting < drafter.max_seqs else []
            n = self._chunk(seq, budget, len(draft))
            del draft[max(0, n - (seq.num_tokens - seq.num_computed_tokens)):]  # (a chunk cut short drops them)
            if self._reserve(seq, n, copies):
                scheduled.append(ScheduledSeq(seq, n, draft))
                num_drafting += bool(draft)
                budget -= n
                i += 1
                continue
            victim = self.running.pop()  # the newest; never one already scheduled (those are < i)
            self._preempt(victim)
            preempted = True
        if not preempted:
            budget = self._admit(budget, scheduled, copies)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        sample_rows, state_copies = [], []
        for row, s in enumerate(scheduled):
            if s.samples:
                sample_rows.append((s.seq, row))
                sample_rows += [(child, row) for child in self._fork(s, state_copies)]
        return SchedulerOutput(scheduled, sample_rows, copies, state_copies)

    def _admit(self, budget: int, scheduled: list[ScheduledSeq], copies: list) -> int:
        if self.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            self._order_by_cached_prefix()
        seats = sum(map(_width, self.running)) if self.waiting else 0  # (unborn siblings hold their seats)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + _width(seq) > self.max_num_seqs:
                break
            if self._waits_for_prefix(seq) or not self._adapter_fits(seq):
                break
            slotless = self._slotless(seq)
            if self.states is not None and len(slotless) > self.states.num_free:
                break
            resume_at = self._start_from_cache(seq)
            n = self._chunk(seq, budget)
            if not self._reserve(seq, n, copies):
                self._release(seq)
                break
            for each in slotless:
                self.states.allocate(each)
            if resume_at is not None:  # (the matched node's pages are held: nothing evicted it meanwhile)
                self.snapshots.resume(resume_at, seq)
            self.waiting.popleft()
            self._enqueued_at.pop(seq, None)
            if seq.index == 0 and seq.request.num_cached_tokens is None:  # what the client is told
                seq.request.num_cached_tokens = seq.num_computed_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seats += _width(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return budget

    def _adapter_fits(self, seq: Sequence) -> bool:
        """LoRA: the running sequences use at most ``max_loras`` different adapters (one slot of weights each)."""
        lora = seq.request.lora_id
        if not self.max_loras or lora is None:
            return True
        running = {s.request.lora_id for s in self.running} - {None}
        return lora in running or len(running) < self.max_loras

    def _waits_for_prefix(self, seq: Sequence) -> bool:
        """Whether ``seq`` should wait a step because a running sequence is computing the prompt prefix it shares
        (at least a page more than the cache holds): once that prompt is computed it is cached, and ``seq`` takes
        it from there instead of computing it a second time in the same step (SGLang's in-batch prefix caching: a
        rerank's documents behind one query, a batch of prompts behind one system prompt). Only while something
        runs, so it never waits on nothing; FCFS: the sequences behind it wait too. Not for hybrids, which resume
        only where a state snapshot was taken."""
        if seq.page_table or isinstance(self.cache, NoPrefixCache) or self.states is not None:
            return False
        size = self.pool.page_size
        key = self._matchable(seq)
        cached = None
        for other in self.running:
            if other.num_computed_tokens >= other.prompt_len or other.request is seq.request:
                continue
            shared = _shared_pages(key, other.cache_key(other.prompt_len), size)
            if shared == 0:
                continue
            if cached is None:
                cached = len(self.cache.match(key))
            if shared > cached:
                return True
        return False

    def _slotless(self, seq: Sequence) -> list[Sequence]:
        """Hybrids: the sequences admitting ``seq`` must give a state slot (it, and a first sequence's unborn
        siblings that hold none yet)."""
        if self.states is None:
            return []
        family = [seq, *seq.request.unborn()] if seq.index == 0 else [seq]
        return [s for s in family if s.state_slot is None]

    def _order_by_cached_prefix(self) -> None:
        """LPM: longest cached prefix first; sequences waiting starvation_steps or more go before all
        others, in arrival order."""
        def key(seq):
            step, arrival = self._enqueued_at[seq]
            if self.step_count - step >= self.starvation_steps:
                return (0, arrival)
            return (1, -len(self.cache.match(self._matchable(seq))), arrival)

        self.waiting = deque(sorted(self.waiting, key=key))

    @staticmethod
    def _matchable(seq: Sequence) -> list[int]:
        """The tokens whose cached prefix a sequence may take: all but its last (that one is computed, to
        sample from); while its request scores the prompt (prompt logprobs), only the positions scored
        already, so every position still to score is computed (vLLM's rule: no cache hit where logits
        are needed; after a preemption, what was scored and sent is not computed again)."""
        end = seq.num_tokens - 1
        if seq.request.scoring_prompt:
            end = min(end, seq.request.num_scored)
        return seq.cache_key(end)

    def _start_from_cache(self, seq: Sequence):
        """A sequence with no pages takes the longest cached prefix it may (see ``_matchable``); hybrids: the
        longest that ends at a state snapshot, and the node holding it is returned (to resume from)."""
        if seq.page_table:
            return None
        node = None
        if self.snapshots is not None:
            pages, node = self.snapshots.match(seq, self._matchable(seq))
        else:
            pages = self.cache.match(self._matchable(seq))
        self.pool.incref(pages)
        seq.page_table = pages
        seq.num_computed_tokens = len(pages) * self.pool.page_size
        return node

    def _chunk(self, seq: Sequence, budget: int, num_draft: int = 0) -> int:
        """Tokens ``seq`` computes this step: all it has (and its drafts), within the budget (hybrids: a chunk
        ends where a snapshot is to be taken)."""
        n = min(seq.num_tokens - seq.num_computed_tokens + num_draft, budget)
        return n if self.snapshots is None else self.snapshots.cut(seq, n)

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for ``seq`` to verify this step: only for a sequence about to sample with at most 1 + k
        tokens left to compute, not scoring its prompt, with no unborn siblings to fork, and never past its
        token limit (each step emits at most len(draft) + 1 tokens) or the step's budget."""
        left = seq.num_tokens - seq.num_computed_tokens
        k = min(self.drafter.num_tokens, budget - left, seq.request.max_total_tokens - seq.num_tokens - 1)
        if (k < 1 or left > 1 + self.drafter.num_tokens or seq.params.max_tokens == 0 or seq.request.scoring_prompt
                or (seq.index == 0 and seq.request.unborn())):
            return []
        draft = self.drafter.propose(seq, k)
        return seq.thinking.trim(draft) if seq.thinking is not None else draft

    def _reserve(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> bool:
        """Give ``seq`` pages for ``n`` more tokens, copying a shared page it would write into."""
        pool, size = self.pool, self.pool.page_size
        need = pool.pages_for(seq.num_computed_tokens + n) - len(seq.page_table)
        partial = seq.num_computed_tokens // size
        cow = seq.num_computed_tokens % size != 0 and pool.ref_counts[seq.page_table[partial]] > 1
        if need + cow > pool.num_free:
            if need + cow > pool.num_free + self.cache.num_evictable():
                return False
            self.cache.evict(need + cow - pool.num_free)
            if need + cow > pool.num_free:  # never allocate on a promise: preempt instead
                return False
        if cow:
            old, (new,) = seq.page_table[partial], pool.allocate(1)
            copies.append((old, new))
            seq.page_table[partial] = new
            pool.decref([old])
        seq.page_table += pool.allocate(need)
        return True

    def _fork(self, s: ScheduledSeq, state_copies: list[tuple[int, int]]) -> list[Sequence]:
        """At the end of the first sequence's prompt prefill, its unborn siblings share its pages (and, in a
        hybrid, get a copy of its recurrent state in their own slots)."""
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
            if self.states is not None:
                state_copies.append((parent.state_slot, child.state_slot))
        return children

    def after_step(self, scheduled: list[ScheduledSeq], num_rejected: dict | None = None) -> None:
        """Account the computed tokens (less ``num_rejected``'s positions: sequence -> those of the step that stay
        uncomputed, rejected drafts); a prompt whose prefill just completed goes into the cache, so requests
        sharing it hit even while this one is still decoding."""
        num_rejected = num_rejected or {}
        for s in scheduled:
            seq = s.seq
            before = seq.num_computed_tokens
            rejected = num_rejected.get(seq, 0)
            seq.num_computed_tokens += s.num_new_tokens - rejected
            keep = self.pool.pages_for(seq.num_computed_tokens)
            if rejected and len(seq.page_table) > keep:  # pages holding rejected drafts only
                self.pool.decref(seq.page_table[keep:])
                del seq.page_table[keep:]
            if self.snapshots is not None:
                self.snapshots.after_step(seq)
            if before < seq.prompt_len <= seq.num_computed_tokens:
                self.cache.insert(seq.cache_key(seq.num_computed_tokens), seq.page_table)

    def preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to the waiting queue's front, as when pages run out: its computed pages and
        its recurrent state go to the prefix cache, and it resumes from there (or recomputes) when admitted again."""
        if seq in self.running:
            self.running.remove(seq)
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=True)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        """Put the sequence's computed full pages in the cache, then drop its own references."""
        if seq.page_table:
            self.cache.insert(seq.cache_key(seq.num_computed_tokens), seq.page_table)
        if self.snapshots is not None:  # (before its pages go: the tree takes them with its state)
            self.snapshots.release(seq)
        if seq.page_table:
            self.pool.decref(seq.page_table)
        seq.page_table = []
        seq.num_computed_tokens = 0
        if self.states is not None:  # its slot is not kept: it resumes from a snapshot or recomputes
            self.states.free(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (done, or aborted in any state) and give its pages back."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
            self._enqueued_at.pop(seq, None)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def check_integrity(self) -> None:
        assert all(not s.page_table for s in self.waiting), "a waiting sequence holds pages"
        holders = [s.page_table for s in self.running] + self.cache.holders()
        self.pool.check_integrity(holders)
        self.cache.check_integrity()
        if self.states is not None:
            assert all(s.state_slot is not None for s in self.running), "a running sequence holds no state slot"
            self.states.check_integrity(alive=lambda s: s.status in (SeqStatus.RUNNING, SeqStatus.UNBORN))
        if self.snapshots is not None:
            self.snapshots.check_integrity(self.running, self.waiting)


def _shared_pages(a: list[int], b: list[int], size: int) -> int:
    """How many whole pages of tokens ``a`` and ``b`` start with alike."""
    n = 0
    while (n + 1) * size <= min(len(a), len(b)) and a[n * size:(n + 1) * size] == b[n * size:(n + 1) * size]:
        n += 1
    return n


def _width(seq: Sequence) -> int:
    """The sequence rows ``seq`` takes in a step: a first sequence's unborn siblings are forked from it when its
    prompt is computed, so they count from its admission."""
    return 1 + len(seq.request.unborn()) if seq.index == 0 else 1
