"""StatePool: the bookkeeping of a hybrid model's recurrent-state slots (which slots are free, who holds
each). The state tensors themselves (per linear-attention layer: a conv state and an SSM state per slot)
live in the ModelRunner; this class only hands out slot ids, as PagePool does pages.

A sequence holds one slot from its admission until it finishes, is aborted or is preempted (its state is
then recomputed from its tokens); a request's unborn sequences (n > 1) take theirs when the first one is
admitted, and are given the first one's state when they fork from it. A slot is never shared: unlike a
page, a recurrent state is overwritten by every step of its sequence.

Invariants (checked by ``check_integrity``):
  * every slot is either free (in the free list exactly once, no owner) or held by exactly one owner;
  * a held slot's owner names it (``owner.state_slot == slot``) and is alive: running, or unborn (never
    waiting: a waiting sequence holds no slot, never finished).
"""

from __future__ import annotations

from collections import deque


class OutOfSlots(RuntimeError):
    pass


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owners: dict[int, object] = {}  # slot -> the sequence holding it

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, owner) -> int:
        """A free slot for ``owner`` (a Sequence), recorded on it as ``owner.state_slot``."""
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are held")
        assert getattr(owner, "state_slot", None) is None, "a sequence asked for a second slot"
        slot = self._free.popleft()
        self._owners[slot] = owner
        owner.state_slot = slot
        return slot

    def free(self, owner) -> None:
        """Give ``owner``'s slot back (nothing if it holds none)."""
        slot = owner.state_slot
        if slot is None:
            return
        assert self._owners.get(slot) is owner, f"slot {slot} freed by a sequence that does not hold it"
        del self._owners[slot]
        self._free.append(slot)
        owner.state_slot = None

    def check_integrity(self, alive=lambda owner: True) -> None:
        """Raise AssertionError unless the invariants above hold; ``alive(owner)`` says whether a sequence
        may hold a slot (the scheduler's view: running or unborn)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is in the free list twice"
        assert not free & set(self._owners), "a free slot has an owner"
        assert len(free) + len(self._owners) == self.num_slots, "a slot is neither free nor held"
        for slot, owner in self._owners.items():
            assert owner.state_slot == slot, f"slot {slot}'s owner names slot {owner.state_slot}"
            assert alive(owner), f"slot {slot} is held by a sequence that may not hold one ({owner.status})"
