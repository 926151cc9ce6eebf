"""RadixAttention's prefix cache: a radix tree over token ids whose nodes own KV pages.

Nodes are page-aligned: a node holds ``k * page_size`` tokens and the ``k`` pages with their K/V, and
is split only at page boundaries. Children are keyed by their first page of tokens.

Invariants (checked by ``check_integrity``):
  * every non-root node holds a positive multiple of page_size tokens and one page per page_size;
  * a child's key is the tuple of its first page_size tokens, and its parent pointer is right;
  * the tree holds exactly one reference on each of its pages (the pool's ref count counts it);
  * a page is in at most one node.
Eviction goes leaves first: a leaf's idle pages (ref count 1, the tree's own reference only) form a
suffix of it (requests reference prefixes), and they are trimmed; a node becomes a leaf once its
children are gone. A cached page idle under a child still in use (two requests that computed the
same prefix side by side) is not reclaimable until that child is; ``num_evictable`` counts exactly
what this order can free.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol

from mili.cache.page_pool import PagePool


class PrefixCache(Protocol):
    def match(self, token_ids: list[int]) -> list[int]:
        """Pages of the longest cached page-aligned prefix of ``token_ids`` (not referenced for you)."""
    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        """Cache the full pages of ``token_ids`` (``pages[i]`` holds tokens of page i)."""
    def num_evictable(self) -> int: ...
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` reclaimable pages (LRU leaves first); returns how many were freed."""
    def holders(self) -> list[list[int]]: ...
    def check_integrity(self) -> None: ...


class NoPrefixCache:
    """--no-prefix-cache: nothing is kept."""

    def match(self, token_ids: list[int]) -> list[int]:
        return []

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        pass

    def num_evictable(self) -> int:
        return 0

    def evict(self, num_pages: int) -> int:
        return 0

    def holders(self) -> list[list[int]]:
        return []

    def check_integrity(self) -> None:
        pass


class _Node:
    __slots__ = ("parent", "tokens", "pages", "children", "last_access", "snapshot")

    def __init__(self, parent: "_Node | None", tokens: list[int], pages: list[int], last_access: int):
        self.parent = parent
        self.tokens = tokens
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = last_access
        self.snapshot: int | None = None  # hybrids: the recurrent state after this node's last token


class RadixCache:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self._clock = itertools.count(1)  # a logical clock: LRU order without wall time
        self.root = _Node(None, [], [], 0)
        self._pages: set[int] = set()

    # -- lookups ---------------------------------------------------------------------------------
    def _walk(self, token_ids: list[int]):
        """Follow ``token_ids`` down the tree: yields (node, number of its pages matched)."""
        node, pos, size = self.root, 0, self.page_size
        while pos + size <= len(token_ids):
            child = node.children.get(tuple(token_ids[pos:pos + size]))
            if child is None:
                return
            n = 0
            while (n < len(child.pages) and pos + size <= len(token_ids)
                   and child.tokens[n * size:(n + 1) * size] == token_ids[pos:pos + size]):
                n, pos = n + 1, pos + size
            yield child, n
            if n < len(child.pages):
                return
            node = child

    def match(self, token_ids: list[int]) -> list[int]:
        pages: list[int] = []
        now = next(self._clock)
        for node, n in self._walk(token_ids):
            node.last_access = now
            pages += node.pages[:n]
        return pages

    # -- insertion -------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int]) -> _Node:
        """(Returns the node ending at the last full page inserted; the root when there is none.)"""
        size = self.page_size
        num_pages = min(len(token_ids) // size, len(pages))
        token_ids, pages = token_ids[:num_pages * size], pages[:num_pages]
        now = next(self._clock)
        node, done = self.root, 0
        for child, n in list(self._walk(token_ids)):  # walk first: splitting changes the nodes
            child.last_access = now
            if n < len(child.pages):
                child = self._split(child, n)
            node, done = child, done + n
        if done < num_pages:  # the rest is new: the tree takes its own reference on those pages
            new_pages = pages[done:]
            self.pool.incref(new_pages)
            self._pages.update(new_pages)
            leaf = _Node(node, token_ids[done * size:], new_pages, now)
            node.children[tuple(leaf.tokens[:size])] = leaf
            node = leaf
        return node

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node`` after its first ``n`` pages; returns the new upper part."""
        size = self.page_size
        upper = _Node(node.parent, node.tokens[:n * size], node.pages[:n], node.last_access)
        node.parent.children[tuple(upper.tokens[:size])] = upper
        node.tokens, node.pages, node.parent = node.tokens[n * size:], node.pages[n:], upper
        upper.children[tuple(node.tokens[:size])] = node
        return upper

    # -- eviction --------------------------------------------------------------------------------
    def num_evictable(self) -> int:
        """Pages ``evict`` can free: a node's idle tail counts once every child below it is reclaimable."""
        whole: dict[int, bool] = {}  # id(node) -> its whole subtree is reclaimable
        total = 0
        order, stack = [], [self.root]
        while stack:  # iterative post-order: chat histories make deep chains
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents
            if not all(whole[id(c)] for c in node.children.values()):
                whole[id(node)] = False
                continue
            tail = self._idle_tail_of(node)
            whole[id(node)] = tail == len(node.pages)
            total += tail
        return total

    def _idle_tail_of(self, node: _Node) -> int:
        """How many of a node's last pages only the cache references (requests reference prefixes, so
        a node's idle pages are a suffix of it)."""
        ref, n = self.pool.ref_counts, 0
        while n < len(node.pages) and ref[node.pages[-1 - n]] == 1:
            n += 1
        return n

    def _idle_tail(self, node: _Node) -> int:
        """The idle tail of a leaf (what eviction can trim now); 0 for inner nodes and the root."""
        return 0 if node.children or node is self.root else self._idle_tail_of(node)

    def evict(self, num_pages: int) -> int:
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if self._idle_tail(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, node = heapq.heappop(leaves)
            tail = self._idle_tail(node)
            gone = node.pages[len(node.pages) - tail:]
            self._pages.difference_update(gone)
            self.pool.decref(gone)
            freed += tail
            self._end_moved(node)
            if tail < len(node.pages):  # a request still uses the head: trim the node
                keep = len(node.pages) - tail
                node.pages, node.tokens = node.pages[:keep], node.tokens[:keep * self.page_size]
                continue
            parent = node.parent
            del parent.children[tuple(node.tokens[:self.page_size])]
            if self._idle_tail(parent):
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def _end_moved(self, node: _Node) -> None:
        """Eviction trims or removes ``node``: what was kept at its end goes (hybrids: its snapshot)."""

    # -- inspection ------------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def holders(self) -> list[list[int]]:
        return [node.pages for node in self._nodes()]

    def cached_sequences(self) -> list[list[int]]:
        """The token ids of every root-to-leaf path (for tests and debugging)."""
        out = []

        def visit(node, prefix):
            prefix = prefix + node.tokens
            if not node.children and node is not self.root:
                out.append(prefix)
            for child in node.children.values():
                visit(child, prefix)

        visit(self.root, [])
        return out

    def check_integrity(self) -> None:
        size, seen = self.page_size, set()
        for node in self._nodes():
            assert node.pages and len(node.tokens) == len(node.pages) * size, "node not page-aligned"
            assert node.parent.children.get(tuple(node.tokens[:size])) is node, "bad key or parent"
            assert not seen & set(node.pages), "a page in two nodes"
            seen.update(node.pages)
            assert all(self.pool.ref_counts[p] >= 1 for p in node.pages), "tree page not referenced"
        assert seen == self._pages, "page index out of date"
