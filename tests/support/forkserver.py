"""A clean process that has imported what ``mili serve`` imports, and forks each test server off it.

Why: ``python -m mili.cli serve`` spends ~5 s of CPU importing torch, transformers, FastAPI and MILI before it
reads a checkpoint, and the suite starts ~60 servers on two cores. A fork off this process runs
``mili.cli.main(argv)`` just as ``python -m mili.cli serve`` would: its own environment (the test's, exactly),
stdin from /dev/null, stdout and stderr into its log, and the interpreter's own exit (atexit handlers included)
with main's return code. What differs is only that the imports were done once, before the fork, by a process that
has run nothing else: :func:`serve_forks` checks it has one thread before each fork (a fork is safe only then, as
``mili serve``'s own fork of its engine core is, mili.engine.core_start).

Used by support.server.Server for servers started with the test process's environment; a server given an
environment of its own (``env=``), and the tests of the command line itself, start ``python -m mili.cli``.

The protocol, one JSON line each way on the fork server's stdin and stdout:
``{"start": argv, "env": {...}, "log": path, "cwd": folder}`` -> ``{"pid": n}`` (or ``{"error": why}``);
``{"wait": pid, "timeout": s or null}`` -> ``{"code": returncode or null}`` (null: still running after
``timeout``; 0 polls). Return codes are Popen's (``-n`` for signal n). At end of input the children still running
get SIGTERM, then SIGKILL after 10 s.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

PRELOAD = ("mili.cli", "mili.engine.async_llm", "mili.engine.core_process", "uvicorn", "mili.server.app")


def serve_forks() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    requests, replies = sys.stdin, sys.stdout
    codes: dict[int, int | None] = {}
    for line in requests:
        request = json.loads(line)
        if "start" in request:
            threads = len(os.listdir("/proc/self/task"))
            if threads != 1:
                reply = {"error": f"the fork server has {threads} threads: a fork is not safe"}
            else:
                pid = os.fork()
                if pid == 0:
                    sys.exit(_child(request["start"], request["env"], request["log"], request["cwd"]))
                codes[pid] = None
                reply = {"pid": pid}
        else:
            reply = {"code": _wait(codes, request["wait"], request["timeout"])}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    _end(codes)


def _child(argv: list[str], env: dict[str, str], log: str, cwd: str) -> int:
    """In the fork: the process ``python -m mili.cli <argv>`` would be, from main on."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)  # (these replace the fork server's pipes: the server holds none of them)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    import mili.cli

    sys.argv = [mili.cli.__file__, *argv]
    return mili.cli.main(argv)


def _wait(codes: dict[int, int | None], pid: int, timeout: float | None) -> int | None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while codes[pid] is None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            codes[pid] = os.waitstatus_to_exitcode(status)
        elif deadline is not None and time.monotonic() >= deadline:
            break
        else:
            time.sleep(0.05)
    return codes[pid]


def _end(codes: dict[int, int | None]) -> None:
    running = [pid for pid in codes if _wait(codes, pid, 0) is None]
    for pid in running:
        os.kill(pid, signal.SIGTERM)
    for pid in running:
        if _wait(codes, pid, 10) is None:
            os.kill(pid, signal.SIGKILL)
            _wait(codes, pid, None)
