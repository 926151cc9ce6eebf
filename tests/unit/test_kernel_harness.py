"""The C harness of every exported CPU kernel against plain scalar references (tests/kernels/harness.c), built with
each ISA's flags and run: every x86-64 ISA this CPU executes, natively, with the flags of mili.kernels.cpu's own
builds (and, where the CPU has AVX-512 BF16 / VNNI, the avx512 build without them too, as an Ice Lake and a
Skylake-X build it: their emulated bf16 paths); aarch64's neon and neon-dot, cross-compiled with
aarch64-linux-gnu-gcc and run under qemu-aarch64 (``-cpu cortex-a57``: Armv8.0, no dot product; ``-cpu max``: with
it). On an aarch64 machine its ISAs run natively instead.

The cross tools are required: without ``aarch64-linux-gnu-gcc`` and ``qemu-aarch64`` the aarch64 cases fail
(``apt-get install gcc-aarch64-linux-gnu qemu-user``), unless ``MILI_SKIP_CROSS_TESTS=1`` says to skip them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mili.kernels import cpu

HARNESS = Path(__file__).resolve().parents[1] / "kernels" / "harness.c"
CROSS_CC, QEMU, CROSS_SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"
INSTALL = "apt-get install gcc-aarch64-linux-gnu qemu-user"
CROSS = {"neon": (["-march=armv8-a"], "cortex-a57"), "neon-dot": (["-march=armv8.2-a+dotprod"], "max")}
SKIP_CROSS = os.environ.get("MILI_SKIP_CROSS_TESTS") == "1"


def _native_builds() -> list:
    """(id, ISA, flags) of each build this CPU runs: its ISAs ("amx": the avx512 library on AMX tiles), and avx512
    without the AVX-512 BF16 / VNNI this CPU has (the builds of CPUs without them)."""
    builds = [(isa, isa, cpu.compile_flags(isa)) for isa in cpu.runnable_isas() if isa != "none"]
    if any(isa == "avx512" for _, isa, _ in builds):
        features, seen = cpu.cpu_features(), [cpu.compile_flags("avx512")]
        for name, drop in (("avx512-no-bf16", {"avx512_bf16"}), ("avx512-no-bf16-no-vnni", {"avx512_bf16", "avx512_vnni"})):
            flags = cpu.compile_flags("avx512", features - drop)
            if flags not in seen:
                builds.append((name, "avx512", flags))
                seen.append(flags)
    return builds


BUILDS = [pytest.param("native", isa, flags, id=name) for name, isa, flags in _native_builds()]
if cpu.arch() != "aarch64":
    BUILDS += [pytest.param("qemu", isa, CROSS[isa][0], id=f"{isa}-qemu") for isa in CROSS]


def _defines(isa: str) -> list[str]:
    built = "avx512" if isa == "amx" else isa  # the name mili_isa() returns
    return [f'-DEXPECT_ISA="{built}"'] + (["-DHARNESS_AMX"] if isa == "amx" else [])


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _build_native(isa: str, flags: list[str], exe: Path) -> list[str]:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    assert compiler, "no C compiler (set $CC or install gcc)"
    cmd = [compiler, "-O3", *flags, "-fopenmp", *_defines(isa), str(HARNESS), "-o", str(exe), "-lm"]
    done = _compile(cmd)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}"
    return [str(exe)]


def _build_cross(isa: str, flags: list[str], exe: Path) -> list[str]:
    if SKIP_CROSS:
        pytest.skip("MILI_SKIP_CROSS_TESTS=1")
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: install them ({INSTALL}), or set MILI_SKIP_CROSS_TESTS=1 to skip "
                    "the aarch64 kernel harness", pytrace=False)
    qemu_cpu = CROSS[isa][1]
    head = [CROSS_CC, "-O3", *flags, "-fopenmp", *_defines(isa), str(HARNESS), "-o", str(exe)]
    done = _compile(head + ["-static", "-lm"])  # static: qemu needs no aarch64 sysroot
    if done.returncode == 0:
        return [QEMU, "-cpu", qemu_cpu, str(exe)]
    static_err = done.stderr
    done = _compile(head + ["-lm"])
    assert done.returncode == 0, f"{' '.join(head)} failed, static:\n{static_err[-2000:]}\nand dynamic:\n{done.stderr[-2000:]}"
    return [QEMU, "-cpu", qemu_cpu, "-L", CROSS_SYSROOT, str(exe)]


@pytest.mark.parametrize("how, isa, flags", BUILDS)
def test_kernel_harness(how, isa, flags, tmp_path):
    """Every exported kernel of the ISA's build agrees with its scalar reference (the harness prints one line per
    check and ends with "N passed, M failed")."""
    exe = tmp_path / f"harness-{isa}"
    run = _build_native(isa, flags, exe) if how == "native" else _build_cross(isa, flags, exe)
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    out = done.stdout
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    summary = re.search(r"^(\d+) passed, (\d+) failed$", out, re.M)
    detail = "\n".join(failed[:40] or out.splitlines()[-20:]) + (f"\nstderr: {done.stderr[-2000:]}" if done.stderr else "")
    assert done.returncode == 0 and summary and summary.group(2) == "0", (
        f"{' '.join(run)}: exit {done.returncode}, {summary.group(0) if summary else 'no summary line'}\n{detail}")
    assert int(summary.group(1)) >= 150, f"only {summary.group(1)} checks ran"


# each ISA's build of kernels.c to assembly: (compiler, flags, the prefetch instruction)
_ASM_BUILDS = [pytest.param(os.environ.get("CC", "cc"), cpu.compile_flags(isa), "prefetch", id=isa)
               for isa in ("avx2", "avx512")] if cpu.arch() == "x86_64" else []
_ASM_BUILDS += [pytest.param(CROSS_CC if cpu.arch() != "aarch64" else os.environ.get("CC", "cc"), CROSS[isa][0], "prfm",
                             id=isa) for isa in CROSS]


@pytest.mark.parametrize("compiler, flags, instruction", _ASM_BUILDS)
def test_decode_attention_keeps_its_prefetches(compiler, flags, instruction, tmp_path):
    """Decode attention over bf16 pages fetches the K and V rows of the positions 8 ahead, which lie scattered over
    pages (``prefetch`` in the ISA layers): its compiled body holds prefetch instructions. (The int8 pages' kernel
    reads whole pages in runs and issues none: kv_int8.c.) GCC 12 once dropped every
    prefetch of the linear micro-kernels without a word (the hint chosen by a ternary inside the helper, inlined into
    always_inline kernels); those kernels now issue none (measured slower). This checks the ones that remain."""
    if shutil.which(compiler) is None:
        if SKIP_CROSS and compiler == CROSS_CC:
            pytest.skip("MILI_SKIP_CROSS_TESTS=1")
        pytest.fail(f"{compiler} not found ({INSTALL})", pytrace=False)
    out = tmp_path / "kernels.s"
    done = _compile([shutil.which(compiler), "-O3", *flags, "-fopenmp", "-S", str(cpu.SOURCE), "-o", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    bodies: dict[str, list[str]] = {}
    name = None
    for line in out.read_text().splitlines():
        label = re.match(r"^([A-Za-z_][\w.]*):", line)
        if label:
            name = label.group(1).split(".")[0]
        elif name:
            bodies.setdefault(name, []).append(line)
    assert "decode_attention_bf16" in bodies, "decode_attention_bf16 (the bf16 pages' kernel) not in the assembly"
    count = sum(instruction in line for line in bodies["decode_attention_bf16"])
    assert count >= 2, f"decode_attention_bf16 holds {count} {instruction}: its K/V prefetches were compiled away"
