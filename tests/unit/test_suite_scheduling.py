"""The suite's own xdist scheduling (pyproject.toml's addopts) keeps a module's tests on one worker, so a
module-scoped server or checkpoint is made once. Checked by running a two-module suite under the same options: with
`--dist loadgroup` and pytest 9 this failed (xdist's group marks no longer reached its scheduler, and every e2e
module's servers started on both workers)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODULE = '''
import os
import pytest

@pytest.fixture(scope="module")
def made_once():
    return os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.parametrize("i", range(6))
def test_one(made_once, i):
    with open(os.environ["RAN_LOG"], "a") as log:
        print(__name__, made_once, os.environ["PYTEST_XDIST_WORKER"], file=log)
'''


def test_a_module_runs_on_one_worker(tmp_path):
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    dist = [opt for opt in shlex.split(addopts) if opt.startswith("--dist") or opt in ("loadfile", "loadscope")]
    assert dist, addopts
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")  # (its own rootdir: none of this project's conftests)
    for name in ("test_first", "test_second", "test_third"):
        (suite / f"{name}.py").write_text(MODULE)
    log = tmp_path / "ran.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", *shlex.split(addopts), "-q",
                           "-p", "no:cacheprovider", str(suite)], capture_output=True, text=True, timeout=120,
                          cwd=suite, env={**os.environ, "RAN_LOG": str(log)})
    assert done.returncode == 0, done.stdout + done.stderr
    workers = defaultdict(set)
    for line in log.read_text().splitlines():
        module, fixture_worker, worker = line.split()
        workers[module] |= {fixture_worker, worker}
    assert set(workers) == {"test_first", "test_second", "test_third"}, log.read_text()
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert len(set().union(*workers.values())) == 2, dict(workers)  # (both workers used)
