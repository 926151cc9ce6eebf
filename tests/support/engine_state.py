"""What an engine holds once its requests have ended, read through its public surface (``LLMEngine.stats()``,
``check_integrity()``, ``reset_prefix_cache()``): nothing running or waiting, no KV page, state slot or snapshot
held by anything but the prefix cache, and the pools' invariants true."""

from __future__ import annotations


def assert_drained(engine, evict: bool = False) -> None:
    """``engine``: an ``LLMEngine`` (or an ``LLM``). ``evict``: also empty the prefix cache, and check that frees
    every page."""
    engine = getattr(engine, "engine", engine)
    engine.check_integrity()
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats.num_running == stats.num_waiting == 0
    assert stats.num_pages_held == 0, f"KV pages leaked: {stats}"
    assert stats.num_state_slots_free == stats.num_state_slots, f"state slots leaked: {stats}"
    if evict:
        engine.reset_prefix_cache()
        stats = engine.stats()
        assert stats.num_pages_free == stats.num_pages and stats.num_snapshots_used == 0, stats
        engine.check_integrity()
