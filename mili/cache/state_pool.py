"""StatePool: the bookkeeping of a hybrid model's recurrent-state slots (which slots are free, who holds
each). The state tensors themselves (per linear-attention layer: a conv state and an SSM state per slot)
live in the ModelRunner; this class only hands out slot ids, as PagePool does pages.

A sequence holds one slot from its admission until it finishes, is aborted or is preempted (its state is
then recomputed from its tokens); a request's unborn sequences (n > 1) take theirs when the first one is
admitted, and are given the first one's state when they fork from it. A slot is never shared: unlike a
page, a recurrent state is overwritten by every step of its sequence.

Invariants (ExclusivePool's, checked by ``check_integrity``): every slot is free or held by exactly one
sequence, which names it (``owner.state_slot``) and is alive: running, or unborn (never waiting: a waiting
sequence holds no slot, never finished).
"""

from __future__ import annotations

from mili.cache.exclusive_pool import ExclusivePool


class OutOfSlots(RuntimeError):
    pass


class StatePool(ExclusivePool):
    attr, word = "state_slot", "slot"

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        super().__init__(range(num_slots))
        self.num_slots = num_slots

    def allocate(self, owner) -> int:
        """A free slot for ``owner`` (a Sequence), recorded on it as ``owner.state_slot``."""
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are held")
        return self._take(owner)
