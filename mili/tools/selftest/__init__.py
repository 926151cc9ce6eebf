"""`mili selftest [--device auto|cpu|cuda] [--quick]`: one table that says whether MILI is right and how fast
it is on this machine, and the facts a bug report needs. Sections: versions (torch, triton, transformers,
driver and GPU, CPU flags, which kernels MILI runs here); greedy parity against HF transformers on tiny
random checkpoints built in a temporary folder (dense, MoE and a hybrid Qwen3.5); the device's kernels against
their torch references; CUDA-graph replay against eager (CUDA); a short benchmark. Exits 1 when anything fails."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import tempfile
import time
import traceback
from pathlib import Path

import torch

OK, FAIL, SKIP, INFO = "ok", "FAIL", "skip", "info"
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu() -> tuple[str, str]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = " ".join(f if f in flags else f"-{f}" for f in _CPU_FLAGS)
    return f"{model}, {os.cpu_count()} threads", have


def versions(device: torch.device) -> list[tuple[str, str, str, str]]:
    from mili import __version__
    from mili.kernels import cpu

    model, flags = _cpu()
    rows = [("versions", "mili / python", INFO, f"{__version__} / {platform.python_version()} ({platform.platform()})"),
            ("versions", "torch / triton / transformers", INFO,
             f"{torch.__version__} / {_version('triton')} / {_version('transformers')}"),
            ("versions", "CPU", INFO, model), ("versions", "CPU flags", INFO, flags)]
    lib, why = cpu.load()
    rows.append(("versions", "MILI CPU kernels", INFO if lib is not None else SKIP,
                 f"{cpu.isa()} ({cpu.why()}; runs here: {', '.join(cpu.runnable_isas())})" if lib is not None
                 else f"unavailable: {why}; the torch path runs"))
    rows += [("CPU paths", family, INFO, path) for family, path in cpu.paths().items()]
    rows += plan_rows(device)
    if device.type == "cuda":
        from mili.kernels.triton.launch import device_spec

        spec = device_spec(device)
        try:
            driver = torch._C._cuda_getDriverVersion()  # (private, but stable since torch 1.x)
            driver = f"{driver // 1000}.{driver % 1000 // 10}"
        except Exception:
            driver = "unknown"
        rows += [("versions", "GPU", INFO, f"{spec.name}, {spec.arch}, {spec.num_sms} SMs, "
                                           f"{spec.smem_per_block // 1024} KiB shared memory per block"),
                 ("versions", "CUDA driver / runtime", INFO, f"{driver} / {torch.version.cuda}")]
    return rows


def plan_rows(device: torch.device) -> list[tuple[str, str, str, str]]:
    """The execution plan ``mili serve`` makes here for the demo model (mili/runtime/plan.py), a row a choice."""
    from mili.config import EngineConfig, ModelConfig
    from mili.model.checkpoint import load_hf_config, resolve_model_path
    from mili.runtime.plan import DeviceInfo, plan

    config = EngineConfig("demo", device=str(device))
    made = plan(config, ModelConfig.from_hf(load_hf_config(resolve_model_path("demo"))), DeviceInfo.probe(device))
    return [("execution plan (demo)", choice, INFO, value) for choice, value in made.describe().items()]


def _run(section: str, name: str, fn) -> list[tuple[str, str, str, str]]:
    """One check: fn() -> (ok, detail), ok None for a skip; an exception is a failure, its message the detail."""
    start = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as e:  # the table reports it; the exit status says it failed
        ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0][:200]
        if os.environ.get("MILI_SELFTEST_TRACE"):
            traceback.print_exc()
    result = SKIP if ok is None else OK if ok else FAIL
    return [(section, name, result, f"{detail} ({time.perf_counter() - start:.1f} s)")]


def run(device: torch.device, quick: bool) -> list[tuple[str, str, str, str]]:
    from mili.tools.selftest import kernels, parity, speed

    rows = versions(device)
    dev = str(device)
    with tempfile.TemporaryDirectory(prefix="mili-selftest-") as tmp:
        dense = parity.build(Path(tmp) / "dense", "dense")
        moe = parity.build(Path(tmp) / "moe", "moe")
        rows += _run("parity", "dense, greedy vs HF (float32)", lambda: parity.greedy_parity(dense, dev))
        rows += _run("parity", "MoE, greedy vs HF (float32)", lambda: parity.greedy_parity(moe, dev))
        rows += _run("parity", "hybrid Qwen3.5, greedy vs HF (float32)",
                     lambda: parity.hybrid_parity(Path(tmp) / "hybrid", dev))
        try:
            found = kernels.check(device)
        except Exception as e:
            found = [("kernels vs torch references", False, f"{type(e).__name__}: {e}".splitlines()[0][:200])]
        if not found:
            rows.append(("kernels", "vs torch references", SKIP, "no MILI kernels on this device: torch ops run"))
        rows += [("kernels", name, OK if ok else FAIL, detail) for name, ok, detail in found]
        if device.type == "cuda":
            rows += _run("cuda graphs", "replay == eager (bf16, greedy)", lambda: parity.graph_equals_eager(dense, dev))
            rows += _run("cuda graphs", "mixed steps: replay == eager (bf16, greedy)",
                         lambda: parity.mixed_graphs_equal_eager(dense, dev))
            rows += _run("async steps", "host syncs a step (sync debug mode)",
                         lambda: parity.async_steps_sync_once(dense, dev))
            rows += _run("async steps", "a launch never waits on the device",
                         lambda: parity.async_launch_never_waits(dense, dev))
        else:
            rows.append(("cuda graphs", "replay == eager", SKIP, "CUDA only"))
        path = dense if quick else speed.build_06b(Path(tmp) / "qwen3-0.6b-shape")
        what = "tiny checkpoint" if quick else "Qwen3-0.6B shape, random bf16"
        try:
            rows += [("speed", f"{name} ({what})", INFO, value) for name, value in speed.measure(path, dev, quick)]
        except Exception as e:
            rows.append(("speed", what, FAIL, f"{type(e).__name__}: {e}".splitlines()[0][:200]))
    return rows


def print_table(rows) -> None:
    header = ("section", "check", "result", "detail")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(3)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " | detail |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|--------|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + f" | {r[3]} |")


def main(device: str = "auto", quick: bool = False) -> int:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device")
        return 1
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the table is the output
    hf_logging.set_verbosity_error()
    os.environ["MILI_NO_PROGRESS"] = "1"
    start = time.perf_counter()
    rows = run(torch.device(device), quick)
    print_table(rows)
    failed = [r for r in rows if r[2] == FAIL]
    print(f"\nmili selftest --device {device}{' --quick' if quick else ''}: {len(failed)} failed "
          f"({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0
