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
    pool._free.append(pool._free[0])  # a slot free twice
    with pytest.raises(AssertionError, match="twice"):
        pool.check_integrity()
