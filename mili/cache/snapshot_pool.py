"""SnapshotPool: the bookkeeping of a hybrid model's recurrent-state snapshots (copies of a sequence's conv and
SSM states at a page-aligned position), which the prefix cache keeps beside its KV pages. The tensors are rows
of the runner's state tensors after the running sequences' slots (runtime/recurrent_state.py); this class only
hands out row ids, as PagePool does pages and StatePool slots.

A snapshot is owned by exactly one holder: a radix-tree node (the state after the node's last token: a
request whose tokens match the path down to that node resumes there), or a running sequence (the state at its
latest page boundary while it decodes, given to the tree when the sequence ends or is preempted). A snapshot
is never shared and never referenced by a step: resuming copies it into the sequence's own slot at once.

Invariants (checked by ``check_integrity``):
  * every row is either free (in the free list exactly once, no owner) or owned by exactly one holder;
  * an owned row's holder names it (``holder.snapshot`` is the row) and is alive (``alive(holder)``: a node
    still in the tree, a sequence still running).
"""

from __future__ import annotations

from collections import deque


class SnapshotPool:
    def __init__(self, num_snapshots: int, first_row: int = 0):
        if num_snapshots < 0:
            raise ValueError("the snapshot pool cannot have a negative size")
        self.num_snapshots = num_snapshots
        self.first_row = first_row  # row ids are first_row .. first_row + num_snapshots - 1
        self._free: deque[int] = deque(range(first_row, first_row + num_snapshots))
        self._owners: dict[int, object] = {}  # row -> its holder (a radix node or a Sequence)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_snapshots - len(self._free)

    def allocate(self, holder) -> int | None:
        """A free row for ``holder``, recorded on it as ``holder.snapshot``; None when all are owned."""
        if not self._free:
            return None
        assert getattr(holder, "snapshot", None) is None, "a holder asked for a second snapshot"
        row = self._free.popleft()
        self._owners[row] = holder
        holder.snapshot = row
        return row

    def transfer(self, old, new) -> None:
        """``old``'s snapshot becomes ``new``'s (a sequence's state handed to a tree node)."""
        row = old.snapshot
        assert self._owners.get(row) is old and getattr(new, "snapshot", None) is None
        self._owners[row] = new
        new.snapshot, old.snapshot = row, None

    def free(self, holder) -> None:
        """Give ``holder``'s snapshot back (nothing if it holds none)."""
        row = getattr(holder, "snapshot", None)
        if row is None:
            return
        assert self._owners.get(row) is holder, f"snapshot {row} freed by a holder that does not own it"
        del self._owners[row]
        self._free.append(row)
        holder.snapshot = None

    def owner_of(self, row: int):
        return self._owners.get(row)

    def check_integrity(self, alive=lambda holder: True) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a snapshot is in the free list twice"
        assert not free & set(self._owners), "a free snapshot has an owner"
        assert len(free) + len(self._owners) == self.num_snapshots, "a snapshot is neither free nor owned"
        for row, holder in self._owners.items():
            assert holder.snapshot == row, f"snapshot {row}'s holder names {holder.snapshot}"
            assert alive(holder), f"snapshot {row} is owned by a holder that is gone ({holder!r:.80})"
