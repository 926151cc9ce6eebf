"""MILI on the CPUs people own: `mili generate` on the demo through every ISA path this machine executes
(MILI_CPU_ISA caps the kernels, and below AVX-512 oneDNN's bf16 packing too), a cap the CPU can't run refused by
name, and the same command on an emulated AVX2-only CPU (qemu-user's `-cpu Haswell`: CPUID says AVX2 without
AVX-512, so torch's own oneDNN check and MILI's probe both see the machine a Zen 3 or a Core i7 is).

qemu-user is required on x86-64: without `qemu-x86_64` the emulated test fails (CI installs it, see .ci/run),
unless MILI_SKIP_CROSS_TESTS=1 says to skip it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from pathlib import Path

import pytest

from mili.kernels import cpu

ROOT = Path(__file__).resolve().parents[2]
# The engine tests the lower paths run once more (the kernel tests take every path in-process already): those that
# run the kernels, in bf16 or quantized (a float32 model runs no C kernel: test_engine.py's run the same ops on every
# path, so they are not repeated)
ENGINE_TESTS = ["tests/unit/test_cpu_linear.py", "tests/unit/test_lm_head_dtype.py",
                "tests/unit/test_quantized_checkpoints.py", "tests/unit/test_selftest.py",
                "tests/unit/test_kv_cache_int8.py",  # the CPU's 8-bit KV pages: stored, gathered and attended
                # the fused decode step verifying drafts, bit for bit against plain decoding
                "tests/unit/test_speculative.py::test_bf16_verifications_run_fused_and_match_plain_decoding_bit_for_bit",
                # GGUF's blocks as stored (Q4_K_M's two-level scales) through the loader and the fused decode step
                "tests/unit/test_gguf.py::test_bf16_runs_the_blocks_on_the_kernels_as_stored",
                "tests/unit/test_gguf.py::test_each_type_on_its_kernel_is_gguf_dequantize"]

PROMPT = ["generate", "--prompt", "Hello", "--max-tokens", "8"]


def generate(env_extra: dict[str, str], prefix: list[str] | None = None, timeout: float = 300) -> tuple[str, str]:
    """(stdout, stderr) of `python -m mili.cli generate` on the demo (its log on stderr); rc 0 asserted."""
    env = {name: value for name, value in os.environ.items() if name != "MILI_CPU_ISA"} | env_extra
    done = subprocess.run([*(prefix or []), sys.executable, "-m", "mili.cli", *PROMPT], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def paths_line(log: str) -> str:
    return next(line for line in log.splitlines() if "CPU paths:" in line)


@pytest.fixture(scope="module")
def default_text():
    return generate({})[0]


@pytest.mark.parametrize("isa", cpu.runnable_isas())
def test_every_path_this_cpu_runs_generates_the_same_text(isa, default_text):
    """The demo's greedy reply through each forced path is the default path's, and the log names the path; below
    AVX-512, oneDNN's bf16 packing is held off as on such a CPU (aten's linear runs where the kernels don't)."""
    out, log = generate({"MILI_CPU_ISA": isa})
    line = paths_line(log)
    assert f"CPU ISA {isa} (MILI_CPU_ISA={isa}" in line or (isa == "none" and "CPU ISA none" in line), line
    assert out == default_text and out.strip()
    if isa == "none":  # torch's ops, and aten's linear: oneDNN's bf16 held off as on a CPU without AVX-512
        assert "norms, RoPE, SwiGLU: torch" in line and "bf16 linears: aten (no oneDNN bf16 packing" in line
    else:
        assert f"bf16 linears: MILI kernel ({isa})" in line


def test_a_cap_the_cpu_cannot_run_is_refused_by_name():
    """MILI_CPU_ISA asking for more than the CPU has (or for nothing MILI knows) is refused by name in the log,
    and the best path the CPU runs serves instead: no crash."""
    above = [isa for isa in cpu.ORDER[cpu.arch()] if isa not in cpu.runnable_isas()]
    for asked in above[:1] + ["sse9"]:
        out, log = generate({"MILI_CPU_ISA": asked})
        assert out.strip()
        assert f"MILI_CPU_ISA={asked}" in log and f"CPU ISA {cpu.best_isa()}" in paths_line(log)
        assert ("refused" if asked != "sse9" else "is not an ISA") in log


# Under qemu-user -cpu Haswell: MILI's probe, the kernels it builds, and one product of them against torch's
EMULATED = """
import torch
from mili.kernels import cpu
from mili.kernels.cpu import ops
torch.manual_seed(0)
w, x = torch.randn(64, 128).to(torch.bfloat16), torch.randn(3, 128).to(torch.bfloat16)
got, want = ops.linear(x, ops.pack_weight(w), 64).float(), x.float() @ w.float().T
print(cpu.headline())
print(cpu.paths())
print("max error", float((got - want).abs().max()))
"""


def qemu_haswell() -> list[str]:
    if os.environ.get("MILI_SKIP_CROSS_TESTS") == "1":
        pytest.skip("MILI_SKIP_CROSS_TESTS=1")
    qemu = shutil.which("qemu-x86_64")
    assert qemu, "qemu-x86_64 not found: apt-get install qemu-user (.ci/run does), or set MILI_SKIP_CROSS_TESTS=1"
    return [qemu, "-cpu", "Haswell"]


@pytest.mark.skipif(cpu.arch() != "x86_64", reason="emulates an x86-64 CPU")
def test_the_kernels_on_an_emulated_avx2_only_cpu(tmp_path):
    """qemu-x86_64 -cpu Haswell (AVX2, FMA, F16C; no AVX-512): MILI's probe reads the emulated CPUID, builds the AVX2
    kernels (a fresh cache: nothing built for this machine's AVX-512 is reused), torch says oneDNN has no bf16
    there, and a bf16 product on the kernels is torch's (to bf16's rounding). On a machine that is such a CPU
    (AVX2 its best path) the same script runs natively: the same checks, without a minute of emulation."""
    env = {name: value for name, value in os.environ.items() if name != "MILI_CPU_ISA"} | {"MILI_CACHE_DIR": str(tmp_path)}
    native = cpu.best_isa() == "avx2"
    if native:  # (the AVX2 library this machine has built: found, not compiled again)
        (tmp_path / "kernels").mkdir()
        shutil.copy(cpu.library("avx2"), tmp_path / "kernels")
    prefix = [] if native else qemu_haswell()  # (natively, neither qemu nor MILI_SKIP_CROSS_TESTS is asked)
    done = subprocess.run([*prefix, sys.executable, "-c", EMULATED], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    head, paths, error = done.stdout.splitlines()[-3:]
    assert head.startswith("CPU ISA avx2 (the best this CPU runs; CPU: avx2 f16c fma)"), head
    assert "torch says this CPU lacks it" in paths and "MILI kernel (avx2)" in paths, paths
    assert float(error.split()[-1]) < 0.1, error


@pytest.mark.slow
@pytest.mark.skipif(cpu.arch() != "x86_64", reason="emulates an x86-64 CPU")
def test_generate_on_an_emulated_avx2_only_cpu(tmp_path, default_text):
    """The demo's reply on the emulated AVX2-only CPU is the native one, and the log names its paths (slow: the whole
    engine under emulation; the default run checks the kernels there, and the AVX2 path's text natively)."""
    out, log = generate({"MILI_CACHE_DIR": str(tmp_path)}, prefix=qemu_haswell(), timeout=600)
    line = paths_line(log)
    assert "CPU ISA avx2 (the best this CPU runs; CPU: avx2 f16c fma)" in line, line
    assert "torch says this CPU lacks it" in line and "bf16 linears: MILI kernel (avx2)" in line
    assert out == default_text


LOWER_PATHS = [isa for isa in cpu.runnable_isas() if isa != cpu.best_isa()][:2]


def test_engine_tests_on_the_lower_paths(tmp_path):
    """The engine's tests that run the kernels (bf16/int8/AWQ/FP8 linears, GGUF's blocks as stored, the lm_head's
    dtype, the 8-bit KV cache, fused verification, selftest) once more as a CPU without the better ISA runs them:
    torch's ops alone (none, oneDNN's bf16 held off) and the lowest kernel ISA (avx2 on x86-64), each in a pytest of
    its own with MILI_CPU_ISA set. The two run at once (each is mostly one busy thread), each with its own temporary
    folder. Not the tests of the Triton path (``-k "not triton"``) nor float32 ones: they run no CPU kernel, whatever
    the ISA."""
    runs = {}
    for isa in LOWER_PATHS:
        env = {**os.environ, "MILI_CPU_ISA": isa}
        out, err = (open(tmp_path / f"{isa}.{name}", "w+") for name in ("out", "err"))
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                                 str(tmp_path / isa), "-k", "not triton", *ENGINE_TESTS], cwd=ROOT, env=env,
                                stdout=out, stderr=err)
        runs[isa] = (proc, out, err)
    try:
        for isa, (proc, out, err) in runs.items():
            proc.wait(timeout=1200)
            stdout, stderr = (f.seek(0) or f.read() for f in (out, err))
            assert proc.returncode == 0, f"MILI_CPU_ISA={isa}: " + stdout[-5000:] + stderr[-2000:]
            assert " passed" in stdout.splitlines()[-1] and "failed" not in stdout.splitlines()[-1]
    finally:  # (none left running after a failure)
        for proc, _, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
