"""The prefix cache of the hybrid models: the radix tree of KV pages (radix_cache.py) plus snapshots of the
recurrent state (conv + SSM state of every linear-attention layer) at node ends, from a SnapshotPool.

A request can resume at position p only with the KV pages of its first p tokens *and* the recurrent state
after them, so a hit is the deepest node, fully matched, that holds a snapshot; the pages below it are
not used. Snapshots enter the tree (the scheduler decides when, see engine/scheduler.py):
  * ``keep_state``: copied from a running sequence's slot at a page-aligned position (its prompt's last
    page boundary before the last prompt token; where its prompt parts from a cached one; the page boundaries of
    its chat turns' ends, ``turn_end``; the position where it ends, when that is page-aligned);
  * ``adopt_state``: a snapshot a sequence held (``hold_state``: its latest page boundary while decoding)
    handed to the tree when it ends or is preempted.
Eviction: when KV pages are evicted a trimmed or removed node's snapshot goes with them; when the snapshot
pool is empty, the least recently used node's snapshot goes (its pages stay, evictable as before).

Counts (``counts``, for /metrics): snapshots taken, requests resumed from one, and those of them resumed from a
turn end's.

Invariants (``check_integrity``, beside the tree's own): a node's snapshot is owned by that node in the pool;
the pool's invariants hold (snapshot_pool.py; the scheduler checks them with the running sequences).
"""

from __future__ import annotations

from collections.abc import Callable

from mili.cache.page_pool import PagePool
from mili.cache.radix_cache import RadixCache, _Node
from mili.cache.snapshot_pool import SnapshotPool


class HybridRadixCache(RadixCache):
    def __init__(self, pool: PagePool, snapshots: SnapshotPool, copy_states: Callable[[list[tuple[int, int]]], None]):
        """``copy_states([(src row, dst row)])`` copies recurrent states between rows of the runner's state tensors
        (slots and snapshots); it runs at once, between steps."""
        super().__init__(pool)
        self.snapshots, self.copy_states = snapshots, copy_states
        self.num_snapshots_taken = self.num_snapshot_hits = self.num_turn_end_hits = 0
        self._turn_end_rows: set[int] = set()  # the snapshot rows a turn end placed in the tree (for the counts)

    # -- lookups ---------------------------------------------------------------------------------
    def match(self, token_ids: list[int]) -> list[int]:
        return self.match_state(token_ids)[0]

    def match_state(self, token_ids: list[int]) -> tuple[list[int], _Node | None, int]:
        """Pages of the longest cached prefix that ends at a snapshot, and that node (None: no hit); and how many
        tokens the cached pages match (at least as many: where this prompt parts from a cached one, the place
        for a new snapshot)."""
        pages, usable, hit = [], 0, None
        now = next(self._clock)
        for node, n in self._walk(token_ids):
            node.last_access = now
            pages += node.pages[:n]
            if n == len(node.pages) and node.snapshot is not None:
                usable, hit = len(pages), node
        return pages[:usable], hit, len(pages) * self.page_size

    def resume(self, node: _Node, slot: int) -> None:
        """Copy ``node``'s snapshot into a sequence's state slot (the sequence resumes at the node's end)."""
        self.copy_states([(node.snapshot, slot)])
        self.num_snapshot_hits += 1
        self.num_turn_end_hits += node.snapshot in self._turn_end_rows

    # -- snapshots in ----------------------------------------------------------------------------
    def keep_state(self, token_ids: list[int], pages: list[int], slot: int, turn_end: bool = False) -> None:
        """Cache the pages of ``token_ids`` (a whole number of pages) and the state in ``slot`` after them
        (``turn_end``: they end at a chat turn's end, counted apart when a request resumes there)."""
        node = self._insert_whole(token_ids, pages)
        if node is not None and node.snapshot is None and self._allocate(node) is not None:
            self.copy_states([(slot, node.snapshot)])
            self.num_snapshots_taken += 1
            (self._turn_end_rows.add if turn_end else self._turn_end_rows.discard)(node.snapshot)

    def adopt_state(self, token_ids: list[int], pages: list[int], holder) -> None:
        """Cache the pages of ``token_ids`` and give ``holder``'s snapshot (the state after them) to the tree."""
        node = self._insert_whole(token_ids, pages)
        if node is not None and node.snapshot is None:
            self._turn_end_rows.discard(holder.snapshot)
            self.snapshots.transfer(holder, node)
        else:
            self.snapshots.free(holder)

    def hold_state(self, holder, slot: int) -> bool:
        """Copy the state in ``slot`` into ``holder``'s own snapshot (allocated if it has none); False when the
        pool has no snapshot to give."""
        if holder.snapshot is None and self._allocate(holder) is None:
            return False
        self.copy_states([(slot, holder.snapshot)])
        self.num_snapshots_taken += 1
        return True

    def _insert_whole(self, token_ids: list[int], pages: list[int]) -> _Node | None:
        if not token_ids or len(token_ids) % self.page_size or len(pages) * self.page_size < len(token_ids):
            return None
        node = self.insert(token_ids, pages)
        return None if node is self.root else node

    def _allocate(self, holder) -> int | None:
        row = self.snapshots.allocate(holder)
        if row is None and self._evict_snapshot(but=holder):
            row = self.snapshots.allocate(holder)
        return row

    # -- eviction --------------------------------------------------------------------------------
    def _evict_snapshot(self, but=None) -> bool:
        """Drop the least recently used node's snapshot (never ``but``'s); False if the tree holds none."""
        victim = min((n for n in self._nodes() if n.snapshot is not None and n is not but),
                     key=lambda n: n.last_access, default=None)
        if victim is None:
            return False
        self.snapshots.free(victim)
        return True

    def _end_moved(self, node: _Node) -> None:
        self.snapshots.free(node)

    # -- inspection ------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int, int]:
        """(snapshots taken, requests resumed from a snapshot, of them from a turn end's) since the cache began."""
        return self.num_snapshots_taken, self.num_snapshot_hits, self.num_turn_end_hits

    def nodes_with_snapshots(self) -> list[_Node]:
        return [n for n in self._nodes() if n.snapshot is not None]

    def check_integrity(self) -> None:
        super().check_integrity()
        for node in self.nodes_with_snapshots():
            assert self.snapshots.owner_of(node.snapshot) is node, f"node's snapshot {node.snapshot} is not its own"
