"""Helpers for MILI's own processes (the engine core, tensor-parallel ranks), below both."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so no core outlives the server."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the loop's parent check still ends it
