"""The radix prefix cache on its own: matching, splitting, LRU eviction, and a property-based model test."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mili.cache.page_pool import PagePool
from mili.cache.radix_cache import RadixCache

P = 4  # page size in these tests


def _request(pool, cache, tokens):
    """What the scheduler does: take the cached prefix (leaving one token to compute), allocate the rest."""
    pages = cache.match(tokens[:-1])
    pool.incref(pages)
    need = pool.pages_for(len(tokens)) - len(pages)
    if need > pool.num_free:
        cache.evict(need - pool.num_free)
    return pages + pool.allocate(need)


def _finish(pool, cache, tokens, pages):
    cache.insert(tokens, pages)
    pool.decref(pages)


def test_match_insert_split_and_share():
    pool = PagePool(32, P)
    cache = RadixCache(pool)
    a = list(range(12))  # 3 pages
    pa = _request(pool, cache, a)
    assert cache.match(a) == []
    _finish(pool, cache, a, pa)
    assert cache.match(a) == pa and cache.match(a[:7]) == pa[:1] and cache.match(a + [99]) == pa
    b = a[:8] + [50, 51, 52, 53, 54]  # shares two pages, diverges on the third
    pb = _request(pool, cache, b)
    assert pb[:2] == pa[:2] and pb[2] != pa[2]
    assert all(pool.ref_counts[p] == 2 for p in pa[:2])  # the cache's reference + the request's
    _finish(pool, cache, b, pb)
    assert sorted(map(tuple, cache.cached_sequences())) == sorted([tuple(a), tuple(b[:12])])
    cache.check_integrity()
    c = a[:6] + [70, 71]  # diverges inside the second page: only the first is shared
    assert cache.match(c) == pa[:1]
    pool.check_integrity(cache.holders())
    assert cache.num_evictable() == 4 and pool.num_used == 4


def test_eviction_is_lru_and_spares_referenced_pages():
    pool = PagePool(16, P)
    cache = RadixCache(pool)
    seqs = {name: [base + i for i in range(8)] for name, base in (("old", 0), ("mid", 100), ("new", 200))}
    pages = {}
    for name, toks in seqs.items():  # inserted in this order: old is least recently used
        pages[name] = _request(pool, cache, toks)
        _finish(pool, cache, toks, pages[name])
    cache.match(seqs["old"])  # touching old makes mid the least recently used
    held = _request(pool, cache, seqs["new"] + [1])  # a running request references new's pages
    assert cache.evict(2) == 2
    remaining = {tuple(s[:8]) for s in cache.cached_sequences()}
    assert remaining == {tuple(seqs["old"]), tuple(seqs["new"])}
    assert cache.evict(100) == 2  # old goes; new is referenced and stays
    assert cache.cached_sequences() == [seqs["new"]]
    pool.check_integrity(cache.holders() + [held])
    pool.decref(held)
    assert cache.evict(100) == 2 and pool.num_free == 16
    cache.check_integrity()


def test_evicting_a_leaf_exposes_its_parent():
    pool = PagePool(8, P)
    cache = RadixCache(pool)
    a, b = list(range(8)), list(range(4)) + [9, 9, 9, 9]
    for toks in (a, b):
        _finish(pool, cache, toks, _request(pool, cache, toks))
    assert cache.num_evictable() == 3  # shared first page + two leaves
    assert cache.evict(3) == 3 and pool.num_free == 8 and cache.cached_sequences() == []


def test_prefix_computed_side_by_side_is_not_reclaimable_under_a_busy_leaf():
    """Two requests prefill the same prefix before either is cached: the first's pages become the
    cached prefix, the second's own tail hangs under them. Until the second ends, those prefix pages
    cannot be evicted (leaves first), so they must not be counted as reclaimable."""
    pool = PagePool(16, P)
    cache = RadixCache(pool)
    shared = list(range(8))
    a_tokens, b_tokens = shared + [1, 1, 1, 1], shared + [2, 2, 2, 2]
    a = _request(pool, cache, a_tokens)  # both miss: nothing cached yet
    b = _request(pool, cache, b_tokens)
    cache.insert(a_tokens, a)  # a's prompt prefilled and cached
    cache.insert(b_tokens, b)  # b's tail becomes a leaf under a's prefix pages; b keeps its duplicates
    _finish(pool, cache, a_tokens, a)  # a ends: its prefix pages are idle, but above b's busy leaf
    promised = cache.num_evictable()
    assert promised == 1  # only a's own last page (an idle leaf)
    assert cache.evict(100) == promised
    pool.check_integrity(cache.holders() + [b])


class CacheModel(RuleBasedStateMachine):
    """Random requests, finishes and evictions against a reference: the set of cached page-aligned
    prefixes and the page holding each one's last page."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(24, P)
        self.cache = RadixCache(self.pool)
        self.ref: dict[tuple[int, ...], int] = {}  # cached prefix (k*P tokens) -> page of its last page
        self.active: list[tuple[list[int], list[int], int]] = []  # tokens, pages, matched page count

    def _ref_match(self, tokens: list[int]) -> int:
        k = 0
        while (k + 1) * P <= len(tokens) and tuple(tokens[:(k + 1) * P]) in self.ref:
            k += 1
        return k

    def _sync_evictions(self, before: set) -> None:
        after = {tuple(s[:k * P]) for s in self.cache.cached_sequences() for k in range(1, len(s) // P + 1)}
        removed = before - after
        for prefix in removed:  # evicted: closed under extension, never under a running request
            assert not any(q[:len(prefix)] == prefix and q not in removed for q in after)
            assert not any(len(t) >= len(prefix) and tuple(t[:len(prefix)]) == prefix and m * P >= len(prefix)
                           for t, _, m in self.active)
            del self.ref[prefix]
        assert after == set(self.ref)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def start(self, tokens):
        k = self._ref_match(tokens[:-1])
        before = set(self.ref)
        pages = self.cache.match(tokens[:-1])
        assert len(pages) == k and pages == [self.ref[tuple(tokens[:(i + 1) * P])] for i in range(k)]
        self.pool.incref(pages)
        need = self.pool.pages_for(len(tokens)) - len(pages)
        if need > self.pool.num_free + self.cache.num_evictable():
            self.pool.decref(pages)
            return
        if need > self.pool.num_free:
            freed = self.cache.evict(need - self.pool.num_free)
            assert freed >= need - (self.pool.num_free - freed)
            self._sync_evictions(before)
        self.active.append((tokens, pages + self.pool.allocate(need), k))

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 100))
    def prefilled(self, i):
        """A running request's prompt goes into the cache (it keeps running, holding its own pages):
        a request computing the same prefix side by side leaves idle cached pages above its leaf."""
        tokens, pages, _ = self.active[i % len(self.active)]
        for j in range(len(tokens) // P):
            self.ref.setdefault(tuple(tokens[:(j + 1) * P]), pages[j])
        self.cache.insert(tokens, pages)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        tokens, pages, _ = self.active.pop(i % len(self.active))
        for j in range(len(tokens) // P):
            self.ref.setdefault(tuple(tokens[:(j + 1) * P]), pages[j])
        _finish(self.pool, self.cache, tokens, pages)

    @rule(n=st.integers(1, 10))
    def evict(self, n):
        before = set(self.ref)
        evictable = self.cache.num_evictable()
        freed = self.cache.evict(n)
        assert freed >= min(n, evictable) and freed <= evictable
        self._sync_evictions(before)

    @invariant()
    def integrity(self):
        self.cache.check_integrity()
        self.pool.check_integrity(self.cache.holders() + [p for _, p, _ in self.active])
        used_by_requests = {p for _, pages, _ in self.active for p in pages}
        cached = {p for pages in self.cache.holders() for p in pages}
        assert self.cache.num_evictable() <= len(cached - used_by_requests)

    @invariant()
    def evictable_is_exact(self):
        """Evicting everything frees exactly what num_evictable promised (checked on a copy)."""
        import copy

        twin = copy.deepcopy((self.pool, self.cache))
        promised = twin[1].num_evictable()
        assert twin[1].evict(10**9) == promised


TestCacheModel = CacheModel.TestCase
TestCacheModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
