"""flash-linear-attention's gated delta kernels (fla-core, what the hybrids run on CUDA: kernels/gated_delta_fla.py)
compiled ahead of time for an NVIDIA target without a GPU, as ``compile_check`` does MILI's own kernels.

The launches are not listed by hand: fla's own wrappers run, at the hybrids' shapes, on CPU tensors with
Triton's launch replaced by a recorder (``JITFunction.run``: Triton's own binder and ``_pack_args`` make the
signature, specialization and options a real launch would compile; ``Autotuner.run``: every config of an
autotuned kernel, since the GPU's timing would pick one of them). fla sizes its autotune lists from the
device at import time (shared memory per block, Hopper or not), so each target is recorded in its own process
with fla's hardware probe answering for that target (``_pretend``).

A launch fails when it does not compile, or needs more shared memory than the target gives a block. For an
autotuned kernel that is a failure only when no config of the launch fits: Triton's autotuner gives a config
that raises OutOfResources an infinite time and picks another (the others are reported as skipped). Registers
and spills (``ptxas -v``) are reported, not bounded (fla's kernels, fla's tuning).

    python -m mili.tools.triton_checks.fla_check [--targets sm_90] [--all-configs] [--dtypes bf16,fp32]

exits 1 when a launch fails, 2 when fla-core is not installed. Without ``--all-configs``, an autotuned
launch's configs are compiled from the smallest tiles and fewest stages up, until one fits. Must run where
``TRITON_INTERPRET`` is unset (``run`` starts such a process).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

# the hybrids' Gated DeltaNet shapes (Hk, Hv, Dk, Dv): Qwen3-Next 80B-A3B and the Qwen3.5 defaults (16 key heads,
# 32 value heads, 128 wide), and equal key / value heads
SHAPES = [(16, 32, 128, 128), (16, 16, 128, 128)]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _pretend(spec) -> None:
    """Make fla's import-time hardware probe answer for ``spec`` (before fla's op modules are imported)."""
    import fla.utils as fu
    import fla.utils.hardware as hw

    hopper = spec.capability[0] == 9
    hw.get_all_max_shared_mem = lambda: [spec.smem_per_block]
    for module in (hw, fu):
        for name, value in (("IS_NVIDIA", True), ("IS_NVIDIA_HOPPER", hopper), ("IS_NVIDIA_BLACKWELL", False),
                            ("IS_TF32_SUPPORTED", True), ("IS_AMD", False), ("IS_INTEL", False)):
            if hasattr(module, name):
                setattr(module, name, value)


class Recorder:
    """Triton's launch path up to the compile: what each launch would compile, nothing run."""

    def __init__(self, capability: tuple[int, int]):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
        self.backend = make_backend(self.target)
        self.launches: dict[tuple, tuple] = {}
        self.phase = ""
        self.group = None  # the autotuned call being recorded: its configs are alternatives
        self.num_groups = 0

    def install(self) -> None:
        from triton.runtime import autotuner, jit

        recorder = self

        def run(fn, *args, grid, warmup=False, **kwargs):
            binder = jit.create_function_from_signature(fn.signature, fn.params, recorder.backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(recorder.backend, kwargs, bound, specialization,
                                                                  options)
            key = (fn.__name__, repr(signature), repr(constexprs), repr(attrs), repr(options))
            recorder.launches.setdefault(key, (recorder.phase, fn, signature, constexprs, attrs, options,
                                               recorder.group))

        def autotune(tuner, *args, **kwargs):
            recorder.num_groups += 1
            recorder.group = recorder.num_groups
            try:
                for config in tuner.configs:  # each is a launch the GPU's timing may choose
                    tuner.fn.run(*args, **kwargs, **config.all_kwargs())
            finally:
                recorder.group = None

        jit.JITFunction.run = run
        autotuner.Autotuner.run = autotune


def record(capability: tuple[int, int], dtypes: list[str]) -> list[tuple]:
    """Every distinct launch of the hybrids' prefill (varlen chunk kernel, from states) and decode (fused
    recurrent, one token per sequence) at ``SHAPES`` in ``dtypes``."""
    import torch

    from mili.kernels.triton.launch import TARGETS

    spec = next(s for s in TARGETS.values() if s.capability == capability)
    _pretend(spec)
    recorder = Recorder(capability)
    recorder.install()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    for name in dtypes:
        dtype = getattr(torch, DTYPES[name])
        for hk, hv, dk, dv in SHAPES:
            recorder.phase = f"prefill {name}"
            t, cu = 300, torch.tensor([0, 200, 300])
            q, k = torch.zeros(1, t, hk, dk, dtype=dtype), torch.zeros(1, t, hk, dk, dtype=dtype)
            v = torch.zeros(1, t, hv, dv, dtype=dtype)
            g, beta = torch.zeros(1, t, hv), torch.zeros(1, t, hv, dtype=dtype)
            chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=dk ** -0.5, initial_state=torch.zeros(2, hv, dk, dv),
                                   output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                   cu_seqlens_cpu=cu)
            recorder.phase = f"decode {name}"
            b = 8
            fused_recurrent_gated_delta_rule(q[0, :b, None], k[0, :b, None], v[0, :b, None], g=g[0, :b, None],
                                             beta=beta[0, :b, None], scale=dk ** -0.5,
                                             initial_state=torch.zeros(b, hv, dk, dv), output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    return list(recorder.launches.values())


def _risk(launch) -> tuple:
    """(stages, the sum of the block sizes B*, warps): what drives shared memory."""
    _, fn, _, constexprs, _, options, _ = launch
    names = [p.name for p in fn.params]
    blocks = sum(v for path, v in constexprs.items() if len(path) == 1 and names[path[0]].startswith("B")
                 and isinstance(v, int) and not isinstance(v, bool))
    return options.num_stages, blocks, options.num_warps


def compile_one(launch, capability) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    from mili.tools.triton_checks.aot import ptxas_usage

    phase, fn, signature, constexprs, attrs, options, _ = launch
    names = [p.name for p in fn.params]
    consts = {names[path[0]]: v for path, v in constexprs.items() if len(path) == 1 and not callable(v)}
    config = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in consts.items()
                      if k.isupper() or k.startswith("B")) + f" w{options.num_warps}s{options.num_stages}"
    row = dict(kernel=fn.__name__, phase=phase, config=config, smem=None, regs=None, spills=None, error=None)
    start = time.perf_counter()
    try:
        src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                                options=options.__dict__)
        row["smem"] = kernel.metadata.shared
        row["regs"], row["spills"] = ptxas_usage(kernel.asm["ptx"])
    except Exception as e:  # a failure is a finding, reported in the table
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def check(target: str, all_configs: bool, dtypes: list[str]) -> list[dict]:
    from mili.kernels.triton.launch import TARGETS

    spec = TARGETS[target]
    groups: dict = {}
    for launch in record(spec.capability, dtypes):  # autotuned launches by call, the others alone
        groups.setdefault(launch[-1] if launch[-1] is not None else ("alone", id(launch)), []).append(launch)
    rows = []
    for key, launches in groups.items():
        tuned = isinstance(key, int)
        found = []
        for launch in sorted(launches, key=_risk):
            row = compile_one(launch, spec.capability)
            row["target"] = target
            row["fits"] = not row["error"] and row["smem"] <= spec.smem_per_block
            row["problems"] = [] if row["fits"] else [f"does not compile: {row['error']}"] if row["error"] else \
                [f"shared memory {row['smem']} B > {target}'s {spec.smem_per_block} B per block"]
            found.append(row)
            if tuned and row["fits"] and not all_configs:
                break
        if tuned:
            fits = sum(r["fits"] for r in found)
            for r in found:
                if fits and not r["fits"]:  # the autotuner skips it (OutOfResources): not a failure
                    r["note"] = "skipped by the autotuner: " + "; ".join(r["problems"])
                    r["problems"] = []
                elif r["fits"]:
                    r["note"] = f"config of {len(launches)}"
            if not fits:
                for r in found:
                    r["problems"].append(f"no config of the {len(launches)} fits")
        rows += found
    return rows


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """This check in a fresh process without TRITON_INTERPRET (what a test under the interpreter calls)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, "-m", "mili.tools.triton_checks.fla_check", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mili.tools.triton_checks.fla_check", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="sm_90")
    p.add_argument("--all-configs", action="store_true", help="every autotune config (default: the riskiest)")
    p.add_argument("--dtypes", default="bf16,fp32")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    if importlib.util.find_spec("fla") is None:
        print("fla-core is not installed (pip install fla-core)")
        return 2
    targets = [t for t in a.targets.split(",") if t]
    if len(targets) > 1:  # fla reads the device once, at import: one process per target
        codes = []
        for t in targets:
            result = run([f"--targets={t}", f"--dtypes={a.dtypes}"] + (["--all-configs"] if a.all_configs else []),
                         timeout=3600)
            print(result.stdout, end="")
            codes.append(result.returncode)
        return max(codes)
    rows = check(targets[0], a.all_configs, a.dtypes.split(","))
    header = ["kernel", "phase", "target", "config", "smem B", "regs", "spills B", "s", "ok"]
    cells = [[r["kernel"], r["phase"], r["target"], r["config"], str(r["smem"]), str(r["regs"]), str(r["spills"]),
              str(r["seconds"]), ("ok" + (f" ({r['note']})" if r.get("note") else "")) if not r["problems"]
              else "FAIL: " + "; ".join(r["problems"])] for r in rows]
    widths = [max(len(c[i]) for c in cells + [header]) for i in range(len(header) - 1)]
    for c in [header] + cells:
        print(" | ".join(x.ljust(w) for x, w in zip(c, widths)) + " | " + c[-1])
    failed = sum(bool(r["problems"]) for r in rows)
    skipped = sum("skipped" in r.get("note", "") for r in rows)
    print(f"{len(rows)} launches, {failed} failed, {skipped} autotune configs too large (skipped by the autotuner)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
