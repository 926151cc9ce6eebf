"""StatePool: slots are handed out once, given back once, and its integrity check catches every breach."""

from __future__ import annotations

import pytest

from mili.cache.state_pool import OutOfSlots, StatePool


class Seq:
    def __init__(self, status="running"):
        self.state_slot = None
        self.status = status


def test_allocate_free_and_reuse():
    pool = StatePool(2)
    a, b = Seq(), Seq()
    assert {pool.allocate(a), pool.allocate(b)} == {0, 1} and pool.num_free == 0
    with pytest.raises(OutOfSlots):
        pool.allocate(Seq())
    pool.check_integrity()
    slot = a.state_slot
    pool.free(a)
    assert a.state_slot is None and pool.num_free == 1
    pool.free(a)  # nothing held: nothing to give back
    c = Seq()
    assert pool.allocate(c) == slot
    pool.check_integrity()


def test_a_sequence_never_holds_two_slots():
    pool = StatePool(3)
    a = Seq()
    pool.allocate(a)
    with pytest.raises(AssertionError, match="second slot"):
        pool.allocate(a)


def test_integrity_catches_breaches():
    pool = StatePool(3)
    a, b = Seq(), Seq()
    pool.allocate(a)
    pool.allocate(b)
    b.state_slot = a.state_slot  # an owner that names another's slot
    with pytest.raises(AssertionError, match="owner names slot"):
        pool.check_integrity()
    b.state_slot = 1
    b.status = "waiting"  # a waiting sequence may not hold a slot
    with pytest.raises(AssertionError, match="may not hold one"):
        pool.check_integrity(alive=lambda s: s.status == "running")
    # reach-in: a slot free twice (no public call can corrupt the free list)
    pool._free.append(pool._free[0])
    with pytest.raises(AssertionError, match="twice"):
        pool.check_integrity()


def _request(request_id: str, prompt_len: int, n: int = 1, max_tokens: int = 4):
    from mili import SamplingParams
    from mili.engine.request import Request, Sequence, SeqStatus

    prompt = list(range(1, prompt_len + 1))
    request = Request(request_id, None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, n=n), 10_000)
    request.seqs = [Sequence(request, i, list(prompt), prompt_len, None,
                             status=SeqStatus.WAITING if i == 0 else SeqStatus.UNBORN) for i in range(n)]
    return request


def test_scheduler_slots_through_forks_and_preemption():
    """A hybrid's scheduler: the first sequence of an n = 3 request takes slots for its unborn siblings too; when
    it is preempted before they fork it gives back only its own; the forks copy its state into theirs; every
    slot comes back at the end, and the invariants hold after every step."""
    from mili.cache.page_pool import PagePool
    from mili.cache.radix_cache import NoPrefixCache
    from mili.engine.scheduler import Scheduler

    pages, states = PagePool(8, 16), StatePool(4)
    scheduler = Scheduler(pages, NoPrefixCache(), max_num_seqs=8, max_num_batched_tokens=64, states=states)
    short, forked = _request("short", 40, max_tokens=30), _request("forked", 100, n=3)
    scheduler.add(short)
    scheduler.add(forked)
    copies, preempted_unborn_slots = [], None
    for _ in range(300):
        if not scheduler.has_work():
            break
        out = scheduler.schedule()
        copies += out.state_copies
        parent = forked.seqs[0]
        if scheduler.num_preemptions and preempted_unborn_slots is None:
            assert parent.state_slot is None  # the preempted parent gave its slot back, its unborn siblings not
            preempted_unborn_slots = [s.state_slot for s in forked.seqs[1:]]
            assert None not in preempted_unborn_slots
        scheduler.after_step(out.scheduled)
        for seq, _ in out.sample_rows:
            seq.token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
        scheduler.check_integrity()
    assert not scheduler.has_work() and scheduler.num_preemptions > 0
    assert preempted_unborn_slots is not None
    assert [dst for _, dst in copies] == preempted_unborn_slots  # each child got the parent's state, once
    assert states.num_free == states.num_slots and pages.num_free == pages.num_pages
