"""Two checkouts of MILI side by side: `mili bench latency` and `mili bench throughput` run in each, alternately, on
the same checkpoint, with the medians and the new tree's ratio printed as one table. For a refactor that must not
slow any path down (issue 43: measured before and after in one run).

    git worktree add /tmp/mili-base <commit>
    python benchmarks/tree_ab.py --base /tmp/mili-base [--new .] [--model demo] [--rounds 3] [--dtype bfloat16]
        [--extra "--no-cpu-kernels"]

Each run is its own process (`python -m mili.cli bench ...` with the tree first on sys.path), so the trees share
nothing but the machine; rounds alternate base, new, base, new... so drift hits both alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

LATENCY = ["latency", "--input-len", "128", "--output-len", "64", "--repeat", "3"]
THROUGHPUT = ["throughput", "--num-requests", "32", "--min-input", "32", "--max-input", "128", "--min-output", "32",
              "--max-output", "64"]


def bench(tree: Path, mode: list[str], model: str, extra: list[str]) -> dict[str, float]:
    """The figures of one `mili bench` run: the numbers of its table's `mili` row, by column name."""
    env = dict(os.environ, PYTHONPATH=str(tree), MILI_NO_PROGRESS="1")
    out = subprocess.run([sys.executable, "-m", "mili.cli", "bench", mode[0], model, *mode[1:], "--max-model-len", "1024", *extra],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise SystemExit(f"{tree}: mili bench {mode[0]} failed:\n{out.stderr[-2000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    row = next(c for c in lines[2:] if c.strip("| ").startswith("mili"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return {h: float(re.sub(r"[^0-9.]", "", c)) for h, c in zip(head, cells) if re.fullmatch(r"[0-9.]+%?", c)}


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.machine()
    return " ".join(f for f in flags.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, type=Path)
    p.add_argument("--new", default=Path(__file__).parents[1], type=Path)
    p.add_argument("--model", default="demo")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default=None)
    p.add_argument("--extra", default="", help="more `mili bench` flags, as one string")
    args = p.parse_args()
    extra = args.extra.split() + (["--dtype", args.dtype] if args.dtype else [])
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} threads; flags: {cpu_flags()}")
    print(f"model {args.model}, flags {' '.join(extra) or '(defaults)'}, {args.rounds} rounds, medians\n")
    print("| mode | figure | base | new | new / base |")
    print("|------|--------|------|-----|------------|")
    for mode in (LATENCY, THROUGHPUT):
        runs = {"base": [], "new": []}
        for _ in range(args.rounds):
            for name, tree in (("base", args.base), ("new", args.new)):
                runs[name].append(bench(tree.resolve(), mode, args.model, extra))
        for figure in runs["base"][0]:
            if "roofline" in figure:
                continue
            base, new = (statistics.median(r[figure] for r in runs[k]) for k in ("base", "new"))
            print(f"| {mode[0]} | {figure} | {base:.2f} | {new:.2f} | {new / base:.2f}x |" if base else
                  f"| {mode[0]} | {figure} | {base:.2f} | {new:.2f} | - |")


if __name__ == "__main__":
    main()
