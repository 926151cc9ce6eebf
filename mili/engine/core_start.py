"""Starting the engine core process: forked early from ``mili serve``, or spawned.

A spawned core imports torch, transformers and the model code again, 5 s of CPU before it reads a weight. A fork
shares the imports of the process it is forked from, but is safe only before that process starts a thread (the
tokenizer's pool, ZMQ's I/O thread) or touches a device. So ``mili serve`` calls :func:`prefork` first: it imports
the core's modules and forks the process the core will run in, which waits for its arguments. :func:`start_core`
sends them once the checkpoint is read and the sockets are bound, or spawns a fresh process where nothing was
forked (another caller, a platform without a safe fork).

Linux only: macOS's system libraries are not safe across a fork (Python spawns there by default).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import sys

log = logging.getLogger("mili")
_forked = None  # (the forked process, our end of its pipe), until start_core takes it


def prefork() -> bool:
    """Fork now the process that the next :func:`start_core` runs the core in (it waits until then, and exits if
    this process goes first). Call before this process starts any thread; returns whether it forked."""
    global _forked
    if _forked is not None:
        return True
    if sys.platform != "linux":
        return False
    import mili.engine.core_process  # noqa: F401  (torch, transformers, the model code: what the fork shares)

    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_wait_then_run, args=(theirs, ours), name="mili-engine-core", daemon=False)
    process.start()
    theirs.close()
    _forked = (process, ours)
    atexit.register(_discard)  # (before multiprocessing's own exit handler joins it)
    return True


def start_core(*args):
    """A started process running ``core_process_main(*args)`` (mili.engine.core_process): the one :func:`prefork`
    made, else a spawned one. Its ``is_alive``, ``pid``, ``exitcode``, ``join`` and ``kill`` are multiprocessing's."""
    global _forked
    if _forked is not None:
        (process, conn), _forked = _forked, None
        try:
            conn.send(args)
            conn.close()
            return process
        except OSError:  # (it died waiting: spawn one instead)
            log.warning("the forked engine core process exited before it started (code %s): spawning one",
                        process.exitcode)
    from mili.engine.core_process import core_process_main

    process = multiprocessing.get_context("spawn").Process(target=core_process_main, name="mili-engine-core",
                                                           args=args, daemon=False)
    process.start()
    return process


def _wait_then_run(conn, parent_end) -> None:
    parent_end.close()  # (this copy of the parent's end would keep the pipe open after the parent goes)
    try:
        args = conn.recv()
    except (EOFError, OSError):
        return  # the parent exited, or started no core
    conn.close()
    from mili.engine.core_process import core_process_main

    core_process_main(*args)


def _discard() -> None:
    """The forked process, if no core was started in it, exits."""
    global _forked
    if _forked is not None:
        (process, conn), _forked = _forked, None
        conn.close()
        process.join(5)
