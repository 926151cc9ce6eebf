"""Helpers for MILI's own processes (the engine core, tensor-parallel ranks), below both."""

from __future__ import annotations

import gc
import signal


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so no core outlives the server."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the loop's parent check still ends it


def freeze_heap() -> None:
    """Once a server process has loaded what it keeps (modules, the model, the tokenizer): move every live
    object out of the garbage collector's view (``gc.freeze``, as vLLM does). The oldest generation's
    collections, which the per-step objects trigger now and then, then walk only what was made since,
    instead of the ~250,000 objects torch and transformers leave: a third of a request's CPU in the API
    process here. Only for a process that lives as long as its server (not the tests' in-process engines)."""
    gc.collect()
    gc.freeze()
