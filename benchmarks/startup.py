"""Start-up time: `mili serve` until /health answers 200, and the offline `LLM()` from a fresh Python, this tree
against a baseline tree in the same run.

    git archive HEAD~1 mili | tar -x -C /tmp/base     # the baseline's package, beside nothing else
    python benchmarks/startup.py --baseline /tmp/base [--models demo demo-random] [--rounds 5]

Each round starts every (tree, model, measure) once, the trees' order swapped every round, one process at a time
(never two competing for the cores); the table gives each one's median and range over the rounds and the ratio of
the medians (this tree's time over the baseline's: below 1 is faster). A tree runs as ``PYTHONPATH=TREE python`` in that
folder, so its ``mili`` package is the one imported (each row says which file it loaded). Without ``--baseline`` the table
has this tree alone. The servers run ``--dtype float32`` (the tiny models' own dtype; no CPU kernel compile is
measured: the kernel cache is warmed first).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import machine, print_table

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ("import time; t = time.monotonic(); from mili import LLM; import mili; "
           "LLM({model!r}, dtype='float32'); print(time.monotonic() - t, mili.__file__)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "MILI_NO_PROGRESS": "1"}


def serve_seconds(tree: Path, model: str, timeout: float = 180) -> float:
    """Seconds from launching `mili serve` to its first /health 200; the server is then stopped (SIGTERM)."""
    port = _port()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "mili.cli", "serve", model, "--port", str(port), "--dtype", "float32"],
                            env=_env(tree), cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.monotonic() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{tree}: mili serve {model} exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"{tree}: mili serve {model} did not answer in {timeout} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def offline_seconds(tree: Path, model: str) -> tuple[float, str]:
    """Seconds a fresh Python takes to import mili and build ``LLM(model)``; the package file it imported."""
    done = subprocess.run([sys.executable, "-c", OFFLINE.format(model=model)], env=_env(tree), cwd=tree,
                          capture_output=True, text=True, check=True, timeout=300)
    seconds, where = done.stdout.split()[-2:]
    return float(seconds), where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="a tree holding another version's mili package")
    p.add_argument("--models", nargs="+", default=["demo", "demo-random"])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    trees = [("this tree", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    for _, tree in trees:  # (the kernels built and the demo checkpoints made before anything is timed)
        for model in args.models:
            offline_seconds(tree, model)
    got: dict[tuple[str, str, str], list[float]] = {}
    loaded: dict[str, str] = {}
    for r in range(args.rounds):
        for name, tree in trees if r % 2 == 0 else trees[::-1]:
            for model in args.models:
                got.setdefault((name, model, "mili serve -> /health 200"), []).append(serve_seconds(tree, model))
                seconds, loaded[name] = offline_seconds(tree, model)
                got.setdefault((name, model, "import mili + LLM()"), []).append(seconds)
    from mili.kernels import cpu

    print(f"{machine()}; CPU flags: {' '.join(sorted(cpu.cpu_features()))}; {args.rounds} rounds")
    for name, where in loaded.items():
        print(f"{name}: {where}")
    rows = []
    for (name, model, measure), values in got.items():
        if name != "this tree":
            continue
        row = [model, measure, f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"]
        base = got.get(("baseline", model, measure))
        if base:
            row += [f"{statistics.median(base):.2f} s ({min(base):.2f}-{max(base):.2f})",
                    f"{statistics.median(values) / statistics.median(base):.2f}"]
        rows.append(row)
    headers = ["model", "measure", "this tree"] + (["baseline", "this / baseline"] if args.baseline else [])
    print_table("start-up: median (range) over the rounds", headers, rows)


if __name__ == "__main__":
    main()
