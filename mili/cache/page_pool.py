"""PagePool: the bookkeeping of the paged KV cache (which pages are free, who holds each page).

The KV tensors themselves live in the ModelRunner; this class only hands out page ids.

Invariants (checked by ``check_integrity``):
  * every page is either free (ref count 0, in the free list exactly once) or held (ref count > 0);
  * a held page's ref count equals the number of holders (page tables, cache nodes) naming it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.ref_counts[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            assert self.ref_counts[p] > 0, f"incref of free page {p}"
            self.ref_counts[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        for p in pages:
            assert self.ref_counts[p] > 0, f"decref of free page {p}"
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self._free.append(p)

    def check_integrity(self, holders: Iterable[Iterable[int]]) -> None:
        """Raise AssertionError unless the invariants above hold for this list of holders."""
        held = Counter(p for pages in holders for p in pages)
        free = Counter(self._free)
        assert all(c == 1 for c in free.values()), "a page is in the free list twice"
        for p in range(self.num_pages):
            if p in free:
                assert self.ref_counts[p] == 0 and p not in held, f"free page {p} is held or counted"
            else:
                assert self.ref_counts[p] == held[p] > 0, (
                    f"page {p}: ref count {self.ref_counts[p]} but {held[p]} holders")
