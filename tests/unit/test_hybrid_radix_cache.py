"""The hybrid prefix cache on its own (no model): hits only where a snapshot is, snapshots moving with splits,
dropped with evicted pages and LRU when the snapshot pool is empty; the pool's and tree's invariants."""

from __future__ import annotations

from types import SimpleNamespace

from mili.cache.hybrid_radix_cache import HybridRadixCache
from mili.cache.page_pool import PagePool
from mili.cache.snapshot_pool import SnapshotPool

P = 4  # page size in these tests
SLOTS = 2  # snapshot rows start after the sequences' slots


def _cache(num_pages=32, num_snapshots=3):
    copies = []
    pool = PagePool(num_pages, P)
    cache = HybridRadixCache(pool, SnapshotPool(num_snapshots, first_row=SLOTS), copies.extend)
    return pool, cache, copies


def _check(cache, holders=(), page_tables=()):
    cache.check_integrity()
    alive = {id(n) for n in cache.nodes_with_snapshots()} | {id(h) for h in holders}
    cache.snapshots.check_integrity(alive=lambda h: id(h) in alive)
    cache.pool.check_integrity(cache.holders() + list(page_tables))


def test_hits_stop_at_the_deepest_snapshot_and_survive_splits():
    pool, cache, copies = _cache()
    a = list(range(20))  # 5 pages
    pages = pool.allocate(5)
    cache.insert(a, pages)  # pages only: no snapshot, no hit
    assert cache.match_state(a)[:2] == ([], None)
    cache.keep_state(a[:12], pages, slot=1)  # splits the node at 12: the lower part keeps nothing, the upper
    assert copies == [(1, SLOTS)]              # ... gets the snapshot copied from slot 1
    got, node, matched = cache.match_state(a)
    assert got == pages[:3] and node.snapshot == SLOTS and matched == 20  # the pages match further
    assert cache.match_state(a[:11])[:2] == ([], None)  # a partial node: its snapshot is not at a reachable end
    cache.keep_state(a[:8], pages, slot=0)  # splits above the snapshot: the snapshot stays at position 12
    assert cache.match_state(a)[1].snapshot == SLOTS and cache.match_state(a[:10])[0] == pages[:2]
    cache.keep_state(a[:12], pages, slot=0)  # already there: no copy
    assert len(copies) == 2
    pool.decref(pages)
    _check(cache)


def test_held_snapshots_are_adopted_or_freed_and_lru_snapshots_make_room():
    pool, cache, copies = _cache(num_snapshots=2)
    seq = SimpleNamespace(snapshot=None)
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))
    pa, pb, pc = pool.allocate(2), pool.allocate(2), pool.allocate(2)
    assert cache.hold_state(seq, slot=0) and seq.snapshot is not None
    _check(cache, [seq], [pa, pb, pc])
    cache.adopt_state(a, pa, seq)  # the held row becomes the node's: no copy
    assert seq.snapshot is None and cache.match_state(a)[1] is not None and len(copies) == 1
    cache.keep_state(b, pb, slot=1)
    cache.match_state(a)  # a is now more recent than b
    cache.keep_state(c, pc, slot=0)  # the pool is full: b's snapshot (least recently used) goes
    assert cache.match_state(b)[:2] == ([], None) and cache.match_state(a)[0] == pa and cache.match_state(c)[0] == pc
    other = SimpleNamespace(snapshot=None)
    assert cache.hold_state(other, slot=1)  # a running sequence takes one from the tree too
    cache.adopt_state(a, pa, other)  # a already has one: the held row is freed
    assert other.snapshot is None
    for p in (pa, pb, pc):
        pool.decref(p)
    _check(cache)


def test_evicting_pages_drops_the_snapshots_at_their_ends():
    pool, cache, _ = _cache(num_pages=6)
    a = list(range(16))
    pages = pool.allocate(4)
    cache.keep_state(a[:8], pages, slot=0)
    cache.keep_state(a, pages, slot=1)
    pool.decref(pages)
    assert cache.snapshots.num_used == 2
    assert cache.evict(1) == 2  # the leaf (8..16) goes with the snapshot at 16; the one at 8 stays
    assert cache.snapshots.num_used == 1 and cache.match_state(a)[0] == pages[:2]
    _check(cache)
    cache.evict(10)
    assert cache.snapshots.num_used == 0 and pool.num_free == 6
    _check(cache)


def test_resumes_are_counted_and_those_from_a_turn_end_apart():
    """``counts``: snapshots taken, resumes, and resumes from a snapshot a turn end placed (a row's mark follows
    the row: a turn end's row given back and taken again by a held snapshot counts as that one's)."""
    pool, cache, _ = _cache(num_snapshots=1)
    a, b = list(range(8)), list(range(100, 108))
    pa, pb = pool.allocate(2), pool.allocate(2)
    cache.keep_state(a, pa, slot=0, turn_end=True)
    cache.resume(cache.match_state(a)[1], slot=1)
    assert cache.counts() == (1, 1, 1)
    seq = SimpleNamespace(snapshot=None)
    assert cache.hold_state(seq, slot=0)  # the pool's one row: a's snapshot (a turn end's) is evicted for it
    cache.adopt_state(b, pb, seq)
    cache.resume(cache.match_state(b)[1], slot=1)
    assert cache.counts() == (2, 2, 1)  # the same row, now a held snapshot's: not a turn end's
    for p in (pa, pb):
        pool.decref(p)
    _check(cache)
