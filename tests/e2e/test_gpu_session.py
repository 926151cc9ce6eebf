"""benchmarks/gpu_session.sh, the prepared run for a session lent a GPU: its --tiny mode runs every row on the CPU
(the Triton rows under TRITON_INTERPRET=1), so the script is run here and cannot rot before the next GPU session."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"^-?\d+(\.\d+)?(e[+-]?\d+)? \S+$")  # a figure and its unit


def _session():
    spec = importlib.util.spec_from_file_location("gpu_session", ROOT / "benchmarks" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (imports no torch: the parent side of the script)
    return module


def test_full_run_fits_eight_minutes():
    s = _session()
    t = s.TIMEOUTS["full"]
    assert sum(t[g] for g in s.ORDER) <= 470  # each group's process timeout, the serve run's included
    offline = t["roofline"] + t["checkpoint"] + t["load"] + 2 * t["b1"] + t["batch"] + t["nano"]
    assert offline <= t["offline"] and 9 * t["kernel_row"] > t["kernel"] >= 30
    assert t["server_start"] < t["serve"]
    ids = [rid for rid, _ in s.row_order(False)]
    assert len(ids) == len(set(ids)) == 1 + 2 + 9 + 2 + 2 + 1 + 7 + 2


def test_tiny_session_prints_every_row(tmp_path):
    env = {**os.environ, "MILI_BENCH_CACHE": str(tmp_path / "cache"), "PYTHON": sys.executable}
    env.pop("MILI_GIT_COMMIT", None)
    script = ROOT / "benchmarks" / "gpu_session.sh"
    r = subprocess.run(["bash", str(script), "--tiny", "--logs", str(tmp_path / "logs")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout
    log = (tmp_path / "logs" / "session.log").read_text() if (tmp_path / "logs" / "session.log").exists() else ""
    assert r.returncode == 0, out + r.stderr + log[-4000:]
    assert "commit: " in out and "torch " in out and "triton " in out and "GPU: " in out
    cells = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| row "):
            rid, label, result, detail = [c.strip() for c in line.strip("|").split(" | ", 3)]
            cells[rid] = result
    expected = [rid for rid, _ in _session().row_order(True)]
    assert list(cells) == expected, out
    for rid, result in cells.items():
        assert NUMBER.match(result) or result == "n/a on cpu", (rid, result, out)
    assert (tmp_path / "logs" / "table.md").read_text().count("\n| ") == len(expected) + 1
