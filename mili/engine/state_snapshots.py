"""When the scheduler snapshots a hybrid sequence's recurrent state for the prefix cache, and how a sequence
resumes from one (cache/hybrid_radix_cache.py holds them).

A hybrid sequence resumes only where the cache holds a snapshot, copied into its slot at admission.
Snapshots are taken after the step that computed their position (a prefill chunk is cut to end there):
  * into the tree at once: at the prompt's last page boundary before its last token (a request repeating or
    extending the prompt resumes there); at the page boundary of each chat turn's end the API side found
    (``Request.turn_ends``: the first, the system prompt's, and the last few), so the first request sharing a
    system prompt or a conversation with this one resumes there; and where its prompt parts from a cached one
    (the deepest page boundary the cached pages match, when no snapshot is there: for prompts with no turn
    ends, the second request sharing a prefix leaves one for the later ones);
  * while decoding, at every page boundary, into the sequence's own snapshot (overwritten at the next);
  * when the sequence ends or is preempted: its state at its end if that is page-aligned, else that held
    snapshot, goes into the tree (the next turn of a conversation resumes there).
"""

from __future__ import annotations

from mili.cache.hybrid_radix_cache import HybridRadixCache
from mili.engine.request import Sequence


class StateSnapshots:
    def __init__(self, cache: HybridRadixCache, page_size: int):
        self.cache, self.page_size = cache, page_size

    def match(self, seq: Sequence, token_ids: list[int]):
        """(pages, the node to resume from or None) for a sequence starting from the cache; notes where its
        prompt parts from the cached pages."""
        pages, node, seq.branch_pos = self.cache.match_state(token_ids)
        return pages, node

    def resume(self, node, seq: Sequence) -> None:
        self.cache.resume(node, seq.state_slot)

    def prompt_boundary(self, seq: Sequence) -> int:
        """The last page boundary before the prompt's last token (0 for a prompt within one page)."""
        return (seq.prompt_len - 1) // self.page_size * self.page_size

    def turn_points(self, seq: Sequence) -> list[int]:
        """The page boundaries of the prompt's turn ends (each turn end rounded down to a page; none at 0)."""
        size = self.page_size
        return [p // size * size for p in seq.request.turn_ends if p >= size]

    def cut(self, seq: Sequence, n: int) -> int:
        """``n`` new tokens, or fewer: a chunk ends at a position to snapshot."""
        start = seq.num_computed_tokens
        boundary = self.prompt_boundary(seq)  # (the turn ends' points are at or before it)
        for stop in (seq.branch_pos, boundary, *self.turn_points(seq)) if start < boundary else (seq.branch_pos,):
            if start < stop < start + n:
                n = stop - start
        return n

    def after_step(self, seq: Sequence) -> None:
        """Keep ``seq``'s state where the step left it, if that is a snapshot position."""
        pos = seq.num_computed_tokens
        if pos == 0 or pos % self.page_size:
            return
        boundary = self.prompt_boundary(seq)
        if pos in (seq.branch_pos, boundary):  # into the tree now: sharers hit meanwhile
            self.cache.keep_state(seq.cache_key(pos), seq.page_table, seq.state_slot)
        elif pos < boundary and pos in self.turn_points(seq):
            self.cache.keep_state(seq.cache_key(pos), seq.page_table, seq.state_slot, turn_end=True)
        elif pos > boundary and self.cache.hold_state(seq, seq.state_slot):
            seq.snapshot_pos = pos  # its own, overwritten at its next boundary

    def release(self, seq: Sequence) -> None:
        """A sequence leaving (finished, aborted, preempted; its pages still held) gives the tree its state at
        its end when that is page-aligned, else the snapshot of its latest page boundary."""
        pos = seq.num_computed_tokens
        if seq.page_table and seq.snapshot is not None and seq.snapshot_pos == pos:
            self.cache.adopt_state(seq.cache_key(pos), seq.page_table, seq)
        elif seq.page_table and seq.state_slot is not None and pos and pos % self.page_size == 0:
            self.cache.keep_state(seq.cache_key(pos), seq.page_table, seq.state_slot)
        elif seq.page_table and seq.snapshot is not None:
            self.cache.adopt_state(seq.cache_key(seq.snapshot_pos), seq.page_table, seq)
        self.cache.snapshots.free(seq)

    def check_integrity(self, running: list[Sequence], waiting) -> None:
        """Every snapshot is a tree node's or a running sequence's, or free."""
        assert all(s.snapshot is None for s in waiting), "a waiting sequence holds a snapshot"
        alive = {id(n) for n in self.cache.nodes_with_snapshots()} | {id(s) for s in running}
        self.cache.snapshots.check_integrity(alive=lambda holder: id(holder) in alive)
