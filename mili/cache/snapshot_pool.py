"""SnapshotPool: the bookkeeping of a hybrid model's recurrent-state snapshots (copies of a sequence's conv and
SSM states at a page-aligned position), which the prefix cache keeps beside its KV pages. The tensors are rows
of the runner's state tensors after the running sequences' slots (runtime/recurrent_state.py); this class only
hands out row ids, as PagePool does pages and StatePool slots.

A snapshot is owned by exactly one holder: a radix-tree node (the state after the node's last token: a
request whose tokens match the path down to that node resumes there), or a running sequence (the state at its
latest page boundary while it decodes, given to the tree when the sequence ends or is preempted). A snapshot
is never shared and never referenced by a step: resuming copies it into the sequence's own slot at once.

Invariants (ExclusivePool's, checked by ``check_integrity``): every row is free or owned by exactly one
holder, which names it (``holder.snapshot``) and is alive (``alive(holder)``: a node still in the tree, a
sequence still running).
"""

from __future__ import annotations

from mili.cache.exclusive_pool import ExclusivePool


class SnapshotPool(ExclusivePool):
    attr, word = "snapshot", "snapshot"

    def __init__(self, num_snapshots: int, first_row: int = 0):
        if num_snapshots < 0:
            raise ValueError("the snapshot pool cannot have a negative size")
        super().__init__(range(first_row, first_row + num_snapshots))  # rows after the running slots
        self.num_snapshots, self.first_row = num_snapshots, first_row

    def allocate(self, holder) -> int | None:
        """A free row for ``holder``, recorded on it as ``holder.snapshot``; None when all are owned."""
        return self._take(holder) if self._free else None
