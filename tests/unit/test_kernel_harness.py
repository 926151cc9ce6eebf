"""The C harness of every exported CPU kernel against plain scalar references (tests/kernels/harness.c), linked
against each ISA's build of the kernels and run: every x86-64 ISA this CPU executes, natively, on the very libraries
mili.kernels.cpu builds and loads (and, where the CPU has AVX-512 BF16 / VNNI, the avx512 library without them too,
as an Ice Lake and a Skylake-X build it: their emulated bf16 paths); aarch64's neon and neon-dot, kernels.c
cross-compiled with aarch64-linux-gnu-gcc and the library's flags, run under qemu-aarch64 (``-cpu cortex-a57``:
Armv8.0, no dot product; ``-cpu max``: with it). On an aarch64 machine its ISAs run natively instead. The kernels are
built once into MILI's cache (the engine's own builds share it); the harness's references are compiled apart.

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
CROSS_CC, CROSS_OBJDUMP, QEMU = "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-objdump", "qemu-aarch64"
CROSS_SYSROOT = "/usr/aarch64-linux-gnu"
INSTALL = "apt-get install gcc-aarch64-linux-gnu qemu-user"
CROSS = {"neon": "cortex-a57", "neon-dot": "max"}  # each ISA's qemu CPU
SKIP_CROSS = os.environ.get("MILI_SKIP_CROSS_TESTS") == "1"


def _native_builds() -> list:
    """(id, ISA, features) of each build this CPU runs: its ISAs ("amx": the avx512 library on AMX tiles) as MILI
    builds them (features None), and avx512 without the AVX-512 BF16 / VNNI this CPU has (the builds of CPUs without
    them)."""
    builds = [(isa, isa, None) for isa in cpu.runnable_isas() if isa != "none"]
    if any(isa == "avx512" for _, isa, _ in builds):
        features, seen = cpu.cpu_features(), [cpu.compile_flags("avx512")]
        for name, drop in (("avx512-no-bf16", {"avx512_bf16"}), ("avx512-no-bf16-no-vnni", {"avx512_bf16", "avx512_vnni"})):
            flags = cpu.compile_flags("avx512", features - drop)
            if flags not in seen:
                builds.append((name, "avx512", features - drop))
                seen.append(flags)
    return builds


BUILDS = [pytest.param("native", isa, features, id=name) for name, isa, features in _native_builds()]
if cpu.arch() != "aarch64":
    BUILDS += [pytest.param("qemu", isa, None, id=f"{isa}-qemu") for isa in CROSS]


def _defines(isa: str, features) -> list[str]:
    built = "avx512" if isa == "amx" else isa  # the name mili_isa() returns
    # AVX-512 without VNNI (Skylake-X): the library never calls its int8 / int4 / int8g kernels (their vpdpbusd would
    # fault; aten's run instead, see mili.kernels.cpu.int8_available), so neither does the harness
    no_int = built == "avx512" and "-mavx512vnni" not in cpu.compile_flags(isa, features)
    return ([f'-DEXPECT_ISA="{built}"'] + (["-DHARNESS_AMX"] if isa == "amx" else [])
            + (["-DINT_KERNELS=0"] if no_int else []))


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _build_native(isa: str, features, exe: Path) -> list[str]:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    assert compiler, "no C compiler (set $CC or install gcc)"
    library = cpu.library(isa, features)  # (linked by its path: the executable loads that file)
    cmd = [compiler, "-O1", "-fopenmp", *_defines(isa, features), str(HARNESS), str(library), "-o", str(exe), "-lm"]
    done = _compile(cmd)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}"
    return [str(exe)]


def _cross_tools(*tools: str) -> None:
    if SKIP_CROSS:
        pytest.skip("MILI_SKIP_CROSS_TESTS=1")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: install them ({INSTALL}), or set MILI_SKIP_CROSS_TESTS=1 to skip "
                    "the aarch64 kernel harness", pytrace=False)


def _build_cross(isa: str, exe: Path) -> list[str]:
    _cross_tools(CROSS_CC, QEMU)
    kernels = cpu.cross_object(CROSS_CC, isa)
    head = [CROSS_CC, "-O1", *cpu.compile_flags(isa), "-fopenmp", *_defines(isa, None), str(HARNESS), str(kernels),
            "-o", str(exe)]
    done = _compile(head + ["-static", "-lm"])  # static: qemu needs no aarch64 sysroot
    if done.returncode == 0:
        return [QEMU, "-cpu", CROSS[isa], str(exe)]
    static_err = done.stderr
    done = _compile(head + ["-lm"])
    assert done.returncode == 0, f"{' '.join(head)} failed, static:\n{static_err[-2000:]}\nand dynamic:\n{done.stderr[-2000:]}"
    return [QEMU, "-cpu", CROSS[isa], "-L", CROSS_SYSROOT, str(exe)]


@pytest.mark.parametrize("how, isa, features", BUILDS)
def test_kernel_harness(how, isa, features, tmp_path):
    """Every exported kernel of the ISA's build agrees with its scalar reference (the harness prints one line per
    check and ends with "N passed, M failed")."""
    exe = tmp_path / f"harness-{isa}"
    run = _build_native(isa, features, exe) if how == "native" else _build_cross(isa, exe)
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    out = done.stdout
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    summary = re.search(r"^(\d+) passed, (\d+) failed$", out, re.M)
    detail = "\n".join(failed[:40] or out.splitlines()[-20:]) + (f"\nstderr: {done.stderr[-2000:]}" if done.stderr else "")
    assert done.returncode == 0 and summary and summary.group(2) == "0", (
        f"{' '.join(run)}: exit {done.returncode}, {summary.group(0) if summary else 'no summary line'}\n{detail}")
    assert int(summary.group(1)) >= 150, f"only {summary.group(1)} checks ran"


# each ISA's build of the kernels, disassembled: (the ISA, the prefetch instruction)
_ASM_BUILDS = [pytest.param(isa, "prefetch", id=isa) for isa in ("avx2", "avx512")] if cpu.arch() == "x86_64" else []
_ASM_BUILDS += [pytest.param(isa, "prfm", id=isa) for isa in CROSS]


@pytest.mark.parametrize("isa, instruction", _ASM_BUILDS)
def test_decode_attention_keeps_its_prefetches(isa, instruction):
    """Decode attention over bf16 pages fetches the K and V rows of the positions 8 ahead, which lie scattered over
    pages (``prefetch`` in the ISA layers): its compiled body holds prefetch instructions. (The int8 pages' kernel
    reads whole pages in runs and issues none: kv_int8.c.) GCC 12 once dropped every
    prefetch of the linear micro-kernels without a word (the hint chosen by a ternary inside the helper, inlined into
    always_inline kernels); those kernels now issue none (measured slower). This checks the ones that remain, in the
    library MILI builds (the cross-compiled object of kernels.c for aarch64 on another machine)."""
    if isa in CROSS and cpu.arch() != "aarch64":
        _cross_tools(CROSS_CC, CROSS_OBJDUMP)
        built, objdump = cpu.cross_object(CROSS_CC, isa), CROSS_OBJDUMP
    else:
        built, objdump = cpu.library(isa), "objdump"
        assert shutil.which(objdump), "objdump not found (binutils: apt-get install binutils)"
    done = _compile([objdump, "-d", "--no-show-raw-insn", str(built)])
    assert done.returncode == 0, done.stderr[-3000:]
    bodies: dict[str, list[str]] = {}
    name = None
    for line in done.stdout.splitlines():
        label = re.match(r"^[0-9a-f]+ <([A-Za-z_][\w.]*)>:", line)
        if label:  # (its clones and OpenMP regions, name.constprop.0 or name._omp_fn.0, count as its own)
            name = label.group(1).split(".")[0]
        elif name:
            bodies.setdefault(name, []).append(line)
    assert "decode_attention_bf16" in bodies, "decode_attention_bf16 (the bf16 pages' kernel) not in the disassembly"
    count = sum(instruction in line for line in bodies["decode_attention_bf16"])
    assert count >= 2, f"decode_attention_bf16 holds {count} {instruction}: its K/V prefetches were compiled away"
