"""ExclusivePool: row ids each held by at most one owner, who names its row in an attribute of its own; the
bookkeeping the recurrent-state slots (StatePool) and their snapshots (SnapshotPool) share. The tensors the
rows index live in the ModelRunner; a pool only hands out ids.

Invariants (checked by ``check_integrity``):
  * every row is either free (in the free list exactly once, no owner) or held by exactly one owner;
  * a held row's owner names it (``getattr(owner, attr) == row``) and may hold one (``alive(owner)``).
"""

from __future__ import annotations

from collections import deque


class ExclusivePool:
    attr = ""  # the owner's attribute that names its row
    word = "row"  # what a row is called in messages

    def __init__(self, rows: range):
        self.rows = rows
        self._free: deque[int] = deque(rows)
        self._owners: dict[int, object] = {}  # row -> its owner

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.rows) - len(self._free)

    def _take(self, owner) -> int:
        assert getattr(owner, self.attr, None) is None, f"an owner asked for a second {self.word}"
        row = self._free.popleft()
        self._owners[row] = owner
        setattr(owner, self.attr, row)
        return row

    def transfer(self, old, new) -> None:
        """``old``'s row becomes ``new``'s."""
        row = getattr(old, self.attr)
        assert self._owners.get(row) is old and getattr(new, self.attr, None) is None
        self._owners[row] = new
        setattr(new, self.attr, row)
        setattr(old, self.attr, None)

    def free(self, owner) -> None:
        """Give ``owner``'s row back (nothing if it holds none)."""
        row = getattr(owner, self.attr, None)
        if row is None:
            return
        assert self._owners.get(row) is owner, f"{self.word} {row} freed by an owner that does not hold it"
        del self._owners[row]
        self._free.append(row)
        setattr(owner, self.attr, None)

    def owner_of(self, row: int):
        return self._owners.get(row)

    def check_integrity(self, alive=lambda owner: True) -> None:
        """Raise AssertionError unless the invariants above hold; ``alive(owner)`` says whether it may hold a row."""
        word, free = self.word, set(self._free)
        assert len(free) == len(self._free), f"a {word} is in the free list twice"
        assert not free & set(self._owners), f"a free {word} has an owner"
        assert len(free) + len(self._owners) == len(self.rows), f"a {word} is neither free nor held"
        for row, owner in self._owners.items():
            named = getattr(owner, self.attr)
            assert named == row, f"{word} {row}'s owner names {word} {named}"
            assert alive(owner), f"{word} {row} is held by an owner that may not hold one ({owner!r:.80})"
