"""The compile check: every Triton kernel, at every configuration the runner launches (``inventory``), compiled
ahead of time for sm_80, sm_89 and sm_90 (``aot``); each must compile, fit its target's shared memory per
block, fit the GEMMs' shared-memory bound the runtime choice relies on, and spill at most its stated bound.

    python -m mili.tools.triton_checks.compile_check [--targets sm_80,sm_89,sm_90] [--full] [--jobs 2]

prints the inventory (kernel, target, config, shared memory, registers, spills) and exits 1 if anything
fails. Without ``--full``: one launch per kernel, phase, FP8-ness and float32-ness (the riskiest) per
target, bf16 and float32, page size 16, sm_89 only where its launch is not sm_80's. ``--broken`` adds a
deliberately too-large tile (sm_80), which must fail. ``run`` starts it in a process without
``TRITON_INTERPRET`` (the tests set it; compilation needs real ``@triton.jit`` kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[3] / "tests" / "data" / "qwen3_configs.json"

# Spill bounds (bytes of spill stores) where zero is not met, and why: float32 models' dots are IEEE
# ``tl.dot``s on the CUDA cores (no tensor cores), which Triton lowers with the operand tiles in registers and
# a local-memory stack. Correct, slow, and there for float32 parity runs; measured with triton 3.9 (most
# spilled: GEMMs 4,472 B, decode 2,196 B; the old prefill kernel 14,072 B at page size 64), bounded with some margin.
SPILL_BOUNDS = {
    "quant_gemm._fp8_gemm_kernel": 8192,
    "quant_gemm._int4_gemm_kernel": 8192,
    "quant_gemm._int8_gemm_kernel": 8192,
    "attention._decode_kernel": 4096,
    "varlen_attention._varlen_kernel": 16384,
}


def spill_bound(launch) -> int:
    """0, or the kernel's bound above for its float32 (EXACT) configurations."""
    return SPILL_BOUNDS.get(launch.kernel, 0) if dict(launch.constexprs).get("EXACT", False) else 0


def broken_launch():
    """A tile no A100 can hold: float32 activations 128 x 128 a K step, 4 stages (about 200 KiB of shared
    memory: Triton multi-buffers the activation tile)."""
    import torch

    from mili.tools.triton_checks.aot import Launch

    meta = dict(SCALE_N=128, SCALE_K=128, FP8_ACT=False, BLOCK_K=128, BLOCK_M=128, BLOCK_N=64, EXACT=False)
    return Launch("quant_gemm._fp8_gemm_kernel", "broken", tuple(meta.items()),
                  (("A", torch.float32), ("A_SCALE", torch.float32), ("W", torch.uint8), ("W_SCALE", torch.float32),
                   ("C", torch.float32)), num_warps=4, num_stages=4)


def _compile(job):
    from mili.tools.triton_checks.aot import compile_launch

    target, spec, launch = job
    start = time.perf_counter()
    try:
        c = compile_launch(launch, spec.capability)
        return target, launch, c.shared, c.regs, c.spills, None, time.perf_counter() - start
    except Exception as e:  # a failure to compile is a finding, reported in the table
        msg = " ".join(str(e).split())[:300]
        return target, launch, None, None, None, f"{type(e).__name__}: {msg}", time.perf_counter() - start


def problems(launch, spec, shared, spills, error) -> list[str]:
    from mili.tools.triton_checks.inventory import gemm_bounded, risk

    if error:
        return [f"does not compile: {error}"]
    found = []
    if shared > spec.smem_per_block:
        found.append(f"shared memory {shared} B > {spec.arch}'s {spec.smem_per_block} B per block")
    if gemm_bounded(launch) and launch.phase != "broken" and shared > risk(launch):
        found.append(f"shared memory {shared} B above launch.gemm_smem_bound's {risk(launch)} B")
    if spills > spill_bound(launch):
        found.append(f"spills {spills} B > its bound {spill_bound(launch)} B")
    return found


def check(targets: list[str], full: bool, jobs: int, broken: bool = False) -> list[dict]:
    from mili.tools.triton_checks import inventory
    from mili.kernels.triton.launch import TARGETS

    configs = [v for k, v in json.loads(CONFIGS.read_text()).items() if not k.startswith("_")]
    work, on_sm80 = [], set()
    for target in targets:
        spec = TARGETS[target]
        found = inventory.launches(configs, spec, full)
        for launch in found if full else inventory.representatives(found):
            # Without --full, a launch sm_80 compiles at the same configuration is not compiled again for sm_89:
            # both lower tl.dot to the same mma (measured: the same shared memory each time, registers within a
            # few). sm_89 compiles what differs: its FP8 launches and the tiles its smaller shared memory picks.
            same = (launch.kernel, launch.phase, launch.config())
            if not full and target == "sm_89" and same in on_sm80:
                continue
            if target == "sm_80":
                on_sm80.add(same)
            work.append((target, spec, launch))
    if broken:
        work.append(("sm_80", TARGETS["sm_80"], broken_launch()))
    with ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else _Serial() as pool:
        results = list(pool.map(_compile, work))
    rows = []
    for target, launch, shared, regs, spills, error, seconds in results:
        rows.append(dict(kernel=launch.kernel, phase=launch.phase, target=target, config=launch.config(),
                         smem=shared, regs=regs, spills=spills, seconds=round(seconds, 1),
                         problems=problems(launch, TARGETS[target], shared, spills, error)))
    return rows


class _Serial:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, items):
        return map(fn, items)


def print_table(rows: list[dict], file=sys.stdout) -> None:
    header = ["kernel", "phase", "target", "config", "smem B", "regs", "spills B", "s", "ok"]
    cells = [[r["kernel"], r["phase"], r["target"], r["config"], str(r["smem"]), str(r["regs"]), str(r["spills"]),
              str(r["seconds"]), "ok" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])] for r in rows]
    widths = [max(len(c[i]) for c in cells + [header]) for i in range(len(header) - 1)]
    for c in [header] + cells:
        print(" | ".join(x.ljust(w) for x, w in zip(c, widths)) + " | " + c[-1], file=file)


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """This check in a fresh process without TRITON_INTERPRET (what a test under the interpreter calls)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # [triton-version] 3.9 warns when unset; 1 = 3.6's default
    return subprocess.run([sys.executable, "-m", "mili.tools.triton_checks.compile_check", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mili.tools.triton_checks.compile_check", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="sm_80,sm_89,sm_90")
    p.add_argument("--full", action="store_true", help="every distinct launch (default: one per kernel and phase)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--broken", action="store_true", help="add a deliberately too-large tile for sm_80 (must fail)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: TRITON_INTERPRET=1 is set; use compile_check.run() or unset it", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = check([t for t in args.targets.split(",") if t], args.full, args.jobs, args.broken)
    print_table(rows)
    failed = [r for r in rows if r["problems"]]
    print(f"\n{len(rows)} launches compiled for {args.targets} in {time.perf_counter() - start:.0f} s: "
          f"{len(rows) - len(failed)} ok, {len(failed)} failed")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
