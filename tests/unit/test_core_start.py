"""The engine core's process forked at `mili serve`'s start (mili.engine.core_start): a fork nothing was sent to
exits with the process that made it, whatever way that one ends."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from support.server import process_gone, wait_for

# `mili serve` refusing a checkpoint (exit 2), and a traceback
ENDINGS = {"fails": "raise SystemExit(2)", "raises": "raise RuntimeError('a refused checkpoint')"}


@pytest.mark.skipif(sys.platform != "linux", reason="the core is forked on Linux only")
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_an_unused_fork_leaves_with_its_parent(ending):
    script = f"""
import os, threading
from mili.engine.core_start import prefork
assert prefork() and prefork()  # (a second call keeps the first fork)
with open(f"/proc/self/task/{{threading.get_native_id()}}/children") as f:
    print(f.read().split(), flush=True)
{ENDINGS[ending]}
"""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == {"fails": 2, "raises": 1}[ending], done.stderr[-2000:]
    children = eval(done.stdout.splitlines()[-1])
    assert len(children) == 1, children  # the fork, waiting
    assert wait_for(lambda: process_gone(int(children[0])), 10), "the forked process outlived its parent"
    assert time.monotonic() - started < 60

