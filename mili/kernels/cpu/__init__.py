"""MILI's CPU kernels (``kernels.c``): matrix multiplies over packed bf16, int8, int4 and grouped 8-bit (int8g)
weights, fused RMSNorm, q/k-norm + RoPE, SwiGLU, paged decode and prefill attention, the Gated DeltaNet decode
step, argmax and the grammar bitmask; one C source over a thin per-ISA layer (``isa_avx512.h``, ``isa_avx2.h``,
``isa_neon.h``).

Why C: decoding one token must stream every weight once, and the fastest path torch offers on a CPU (oneDNN on
prepacked weights) streams well below what the memory gives; the kernels here stream near read speed
(benchmarks/NOTES.md, steps 8 and 9). The small ops cost ~30 us each through torch's dispatch and a few us here.

**The ISA.** What the CPU can run comes from CPUID (``probe.c``: the instruction sets and the OS's consent to
their register state), not from /proc/cpuinfo, which shows the host's flags under an emulator. The kernels
run the best of, in order:

* x86-64: ``avx2`` (AVX2 + FMA + F16C), ``avx2-vnni`` (and AVX-VNNI's 256-bit ``vpdpbusd``; on a CPU with
  AVX-512 VNNI, its EVEX form), ``avx512`` (F/BW/VL; AVX-512 BF16 and VNNI where present), ``amx`` (the
  AVX-512 library with the linear layers on AMX tiles);
* aarch64: ``neon`` (Advanced SIMD), ``neon-dot`` (and the ``sdot`` dot product);
* ``none``: no kernels, torch's ops run.

An engine's ``cpu_isa`` option (``--cpu-isa``; auto: ``MILI_CPU_ISA``, any of those names) caps the choice, so a
machine with AVX-512 runs and tests the AVX2 and torch-only paths too; a cap above what the CPU has is refused by
name (the best it has runs instead). The choice is the engine's plan's, made once at start-up (:func:`choose`, from
``DeviceInfo.probe``), and the engine's runner runs its steps on that library (``ops.library``); the functions here
that take no ISA (:func:`load`, :func:`isa`, ...) answer for MILI_CPU_ISA's choice, what a direct call of a kernel
runs on. Each ISA
is its own build, compiled for that ISA alone (``-mavx2 -mfma -mf16c``, never ``-march=native``), so the
library that runs under ``MILI_CPU_ISA=avx2`` on a Zen 4 is the one a Zen 3 runs.

The library is built on first use with the system C compiler (``$CC`` or ``cc``) and cached under
``$MILI_CACHE_DIR/kernels`` (default ``~/.cache/mili``), keyed by the source, the compiler and the flags. Where
it can't be used (no compiler, no ISA it knows) :func:`load` says why and the engine runs torch ops instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401  (loaded first: the library's libgomp must resolve to torch's)

from mili.cpu_isas import ISAS, ORDER
from mili.kernels.cpu import abi

HERE = Path(__file__).parent
SOURCE = HERE / "kernels.c"
# what kernels.c includes, itself or through common.h: the ABI's header, the ISA layers, the kernel families' files
HEADERS = sorted(set(HERE.glob("*.[ch]")) - {SOURCE, HERE / "probe.c"})
log = logging.getLogger("mili")

# Each architecture's ISAs, lowest first (mili/cpu_isas.py), and the CPU features each needs (as /proc/cpuinfo names
# them).
_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = _AVX2 + ("avx512f", "avx512bw", "avx512vl")
NEEDS = {"none": (), "avx2": _AVX2, "avx2-vnni": _AVX2, "avx512": _AVX512,
         "amx": _AVX512 + ("amx_tile", "amx_bf16", "amx_int8"), "neon": ("asimd",), "neon-dot": ("asimd", "asimddp")}

# name -> argument types, as the ABI's header declares them (abi.py reads mili_kernels.h)
SIGNATURES = {name: argtypes for name, (_, argtypes) in abi.FUNCTIONS.items()}


def arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _cache_dir() -> Path:
    return Path(os.environ.get("MILI_CACHE_DIR") or Path.home() / ".cache" / "mili").expanduser() / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _proc_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile(cmd_head: list[str], source: Path, extra_key: str, suffix: str) -> Path:
    """``source`` compiled by ``cmd_head + [source, -o, out]`` into the cache (once per source, compiler and
    flags); the path of the result."""
    compiler = cmd_head[0]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    blob = source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS) + version.encode()
    key = hashlib.sha256(blob + " ".join(cmd_head[1:]).encode() + extra_key.encode()).hexdigest()
    target = _cache_dir() / f"{source.stem}_{key[:16]}{suffix}"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=target.parent)
    os.close(fd)
    cmd = cmd_head + [str(source), "-o", tmp]
    done = subprocess.run(cmd + ([] if "-c" in cmd_head else ["-lm"]), capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)  # atomic: processes building at once each land a whole file
    return target


def cpu_features() -> frozenset[str]:
    """The features this CPU and OS run, from CPUID (``probe.c``); /proc/cpuinfo where nothing can be compiled (or
    those of the CPU a test simulates: :func:`simulated`)."""
    if _simulation and _simulation[-1][0] is not None:
        return _simulation[-1][0]
    return _probed_features()


@functools.cache
def _probed_features() -> frozenset[str]:
    compiler = _compiler()
    if compiler is not None and arch() in ORDER:
        try:
            probe = ctypes.CDLL(str(_compile([compiler, "-O1", "-shared", "-fPIC"], HERE / "probe.c", "", ".so")))
            buf = ctypes.create_string_buffer(4096)
            probe.mili_cpu_probe(buf, len(buf))
            out = buf.value.decode()
            return frozenset(name for name, bit in (line.split() for line in out.splitlines()) if bit == "1")
        except (OSError, RuntimeError, subprocess.SubprocessError, ValueError) as exc:
            log.warning("CPU probe failed (%s): reading /proc/cpuinfo", exc)
    return frozenset(_proc_flags())


def runnable(isa: str) -> str:
    """"" where this CPU runs ``isa``'s kernels, else why not."""
    if isa == "none":  # (torch's ops: anywhere)
        return ""
    if platform.system() != "Linux":  # (macOS: Apple's clang has no OpenMP; not built there yet)
        return f"MILI's CPU kernels are built on Linux only; on {platform.system()} torch's ops run"
    order = ORDER.get(arch())
    if order is None or isa not in order:
        return f"{isa!r} is not an ISA of {arch()} (its kernels: {', '.join(order or ('none',))})"
    missing = [f for f in NEEDS[isa] if f not in cpu_features()]
    if isa == "avx2-vnni" and not ({"avx_vnni"} <= cpu_features() or {"avx512_vnni", "avx512vl"} <= cpu_features()):
        missing.append("avx_vnni")
    return f"this CPU lacks {', '.join(missing)}" if missing else ""


def runnable_isas() -> list[str]:
    """Every ISA path this machine can execute, ``none`` included, lowest first (what the tests run over)."""
    return [isa for isa in ORDER.get(arch(), ("none",)) if not runnable(isa)]


def best_isa() -> str:
    return runnable_isas()[-1]


def requested() -> str | None:
    """``MILI_CPU_ISA`` as set (lower-cased), or None."""
    value = os.environ.get("MILI_CPU_ISA", "").strip().lower()
    return value or None


def _asked(asked: str | None) -> tuple[str | None, str]:
    """(the ISA asked for, who asked): an engine's ``cpu_isa``, else MILI_CPU_ISA, else none (None)."""
    if asked:
        return asked.strip().lower(), f"cpu_isa={asked.strip().lower()}"
    cap = requested()
    return cap, f"MILI_CPU_ISA={cap}"


@functools.cache
def _chosen(cap: str | None, source: str) -> tuple[str, str]:
    """(the ISA to run, a note on why) from the CPU and ``cap`` as ``source`` asked for it (None: nothing asked)."""
    best = best_isa()
    if cap is None:
        return best, "the best this CPU runs"
    if cap not in ISAS:
        log.warning("%s is not one of %s: ignored", source, ", ".join(ISAS))
        return best, f"{source} is not an ISA: the best this CPU runs"
    why = runnable(cap)
    if why:
        log.warning("%s refused (%s): %s runs", source, why, best)
        return best, f"{source} refused ({why})"
    return cap, source


@dataclass(frozen=True)
class Choice:
    """The kernels an engine runs (its plan's, made once at start-up: ``DeviceInfo.probe``): ``isa`` ("none": no
    kernels, torch's ops), its ``lib`` (None with none) and ``why``."""

    isa: str
    lib: ctypes.CDLL | None
    why: str


def choose(asked: str | None = None) -> Choice:
    """The kernels for ``asked`` (an ISA name; None: MILI_CPU_ISA, else the best this CPU runs): that ISA's library,
    or where it fails to build or to pass its check at load, the next one down that does (none: torch's ops).
    Decided once per ISA asked for and CPU (each library is built and loaded once per process)."""
    return _choose(*_asked(asked))


@functools.cache
def _choose(cap: str | None, source: str) -> Choice:
    chosen, note = _chosen(cap, source)
    order = ORDER.get(arch(), ("none",))
    failed = []
    for name in reversed(order[:order.index(chosen) + 1] if chosen in order else ("none",)):
        lib, why = _load(name)
        if lib is not None or name == "none":
            if failed:
                log.warning("MILI's CPU kernels: %s; %s runs", "; ".join(failed), name)
                note = f"{note}; {'; '.join(failed)}"
            return Choice(name, lib, note if lib is not None else (f"{note}: torch's ops run" if failed else why))
        failed.append(f"{name} failed ({why})")
    return Choice("none", None, note)


def current() -> str:
    """The ISA path the kernels take outside an engine (an engine's is its plan's): the one MILI_CPU_ISA asks for
    (default the best this CPU runs), or the next one down that loads where it fails to build or to pass its check."""
    return choose().isa


_simulation: list[tuple[frozenset[str] | None, frozenset[str]]] = []  # simulated()'s stack: (features, failing)


def _forget() -> None:
    """Drop every choice and library made so far: the next call decides again (each library is loaded once more
    from its built file)."""
    for cached in (_load, _choose, _chosen):
        cached.cache_clear()


@contextlib.contextmanager
def simulated(features=None, failing=()):
    """Within the block, the kernels are chosen and loaded as on another CPU: one with ``features`` (as
    :func:`cpu_features` names them; default this one's), where the builds of the ISAs in ``failing`` fail to load
    (as with a broken compiler). Tests of the paths a lesser CPU takes, run on a better one; everything is decided
    afresh on leaving."""
    _simulation.append((None if features is None else frozenset(features), frozenset(failing)))
    _forget()
    try:
        yield
    finally:
        _simulation.pop()
        _forget()


def compile_flags(isa: str, features: frozenset[str] | set[str] | None = None) -> list[str]:
    """The compiler flags of ``isa``'s library: its instruction sets alone, so one built here is the one a CPU
    with nothing more runs."""
    features = cpu_features() if features is None else features
    if isa in ("avx512", "amx"):
        flags = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"]
        flags += [f"-m{name.replace('_', '')}" for name in ("avx512dq", "avx512_bf16", "avx512_vnni") if name in features]
        return flags
    if isa == "avx2":
        return ["-mavx2", "-mfma", "-mf16c"]
    if isa == "avx2-vnni":  # AVX-VNNI's VEX vpdpbusd, or (a CPU with AVX-512 VNNI only) its EVEX form
        return ["-mavx2", "-mfma", "-mf16c"] + (["-mavxvnni"] if "avx_vnni" in features else
                                                 ["-mavx512vnni", "-mavx512vl"])
    if isa == "neon":
        return ["-march=armv8-a"]
    if isa == "neon-dot":
        return ["-march=armv8.2-a+dotprod"]
    raise ValueError(f"no kernels for {isa!r}")


def library(isa: str, features: frozenset[str] | set[str] | None = None) -> Path:
    """The kernels' shared library for ``isa``, built on first use into the cache: the file ``load`` loads, or with
    ``features`` the one a CPU with only those features builds (compile_flags'). RuntimeError if it can't be built."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (set $CC or install gcc)")
    tune = ["-mtune=native"] if arch() == "x86_64" else []
    cmd = [compiler, "-O3", *compile_flags(isa, features), *tune, "-fopenmp", "-shared", "-fPIC"]
    return _compile(cmd, SOURCE, "avx512" if isa == "amx" else isa, ".so")


def cross_object(compiler: str, isa: str) -> Path:
    """kernels.c compiled by ``compiler`` (a cross compiler) for another architecture's ``isa`` into an object file,
    with the library's flags, cached as the libraries are: the kernel harness's aarch64 builds on x86-64."""
    return _compile([compiler, "-O3", *compile_flags(isa), "-fopenmp", "-c"], SOURCE, isa, ".o")


@functools.cache
def _load(isa: str) -> tuple[ctypes.CDLL | None, str]:
    if _simulation and isa in _simulation[-1][1]:
        return None, "a simulated failure"
    if isa == "none":
        return None, ("held at none (MILI_CPU_ISA or a test)" if best_isa() != "none"
                      else f"this CPU runs none of the kernels' ISAs ({', '.join(ORDER.get(arch(), ())[1:]) or arch()})")
    why = runnable(isa)
    if why:
        return None, why
    if _compiler() is None:
        return None, "no C compiler (set $CC or install gcc)"
    try:
        path = library(isa)
        if isa == "amx":  # the avx512 build, loaded from its own copy so that its AMX switch is its own
            copy = path.with_name(path.stem + "_amx.so")
            if not copy.is_file():
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
                os.close(fd)
                shutil.copyfile(path, tmp)
                os.replace(tmp, copy)
            path = copy
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"building the CPU kernels for {isa} failed: {exc}"
    abi.bind(lib)
    lib.mili_path = str(path)  # (the built file: its exported symbols, for the ABI's test)
    built = lib.mili_isa().decode()
    if built != ("avx512" if isa == "amx" else isa):  # the flags and the source's layer disagree: a bug, not a CPU
        return None, f"the {isa} build compiled the {built} layer"
    from mili.kernels.cpu import checks

    if isa == "amx" and lib.mili_amx_init() != 0:
        return None, "Linux did not grant this process the AMX tile state"
    lib.mili_use_amx(int(isa == "amx"))
    failed = checks.check_core(lib)
    if failed:
        log.warning("MILI's %s kernels disagree with torch on a tiny input (%s): not used", isa, failed)
        return None, f"the {isa} kernels failed their check at load: {failed}"
    lib.mili_int_check = checks.check_int(lib) if _int_instructions(isa) else "AVX-512 without VNNI"
    if lib.mili_int_check and _int_instructions(isa):
        log.warning("MILI's %s int8/int4 kernels failed their check at load (%s): not used", isa, lib.mili_int_check)
    return lib, ""


def _int_instructions(isa: str) -> bool:
    """The int8 and int4 kernels need a dot product of bytes: every ISA but AVX-512 without VNNI (Skylake-X)."""
    return isa not in ("avx512", "amx") or "avx512_vnni" in cpu_features()


def load(isa: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the library of ``isa``, default :func:`current`'s, "") or (None, why it can't be used here). Built and
    loaded once per process and ISA (amx: the avx512 build, a copy of its own with AMX on)."""
    if isa is None:
        chosen = choose()
        return chosen.lib, "" if chosen.lib is not None else chosen.why
    return _load(isa)


def isa() -> str:
    """The ISA the kernels run outside an engine: one of :data:`ISAS` ("none": no kernels)."""
    return current()


def why() -> str:
    """Why the kernels run the ISA they do outside an engine, or why none."""
    return choose().why


def int8_available() -> bool:
    """The int8, int4 and int8g kernels: every ISA but AVX-512 without VNNI (Skylake-X: there aten's weight-only int8
    runs, and AWQ layers are dequantized), where they passed their check at load."""
    lib = load()[0]
    return lib is not None and not lib.mili_int_check


def onednn_bf16(asked: str | None = None) -> str:
    """"" where oneDNN's bf16 weight packing runs here, else why not (checks.onednn_bf16): held off too when
    ``asked`` (an engine's cpu_isa, else MILI_CPU_ISA) holds the kernels below AVX-512, as on a CPU without it."""
    from mili.kernels.cpu import checks

    order = ORDER.get(arch(), ())
    rank = {name: i for i, name in enumerate(order)}
    cap = _chosen(*_asked(asked))[0]
    held = "avx512" in rank and rank.get(cap, 0) < rank["avx512"] <= rank[best_isa()]
    return checks.onednn_bf16(held)


def paths(off: str = "", asked: bool = True) -> dict[str, str]:
    """Each layer family's CPU path and why (``mili selftest``; the engine's plan calls :func:`family_paths` with
    what it probed). ``off``: why the engine's model does not take MILI's kernels though they may load (another
    dtype, the Triton back-end, tensor parallelism: the Gated DeltaNet step and the grammar bitmask still do, in
    any dtype); ``asked`` False (--no-cpu-kernels): none is built or loaded."""
    lib, why_not = load() if asked else (None, "--no-cpu-kernels")
    return family_paths(current() if lib is not None else "", why_not, lib.mili_int_check if lib is not None else "",
                        onednn_bf16(), off)


def family_paths(isa: str, why_not: str, int_check: str, onednn: str, off: str = "") -> dict[str, str]:
    """Each layer family's CPU path, from what was probed: ``isa`` the kernels' ("" where none loads, ``why_not``
    says why), ``int_check`` why their int8/int4 paths are off ("" where on), ``onednn`` why oneDNN's bf16 packing
    is off ("" where on); ``off`` as :func:`paths`."""
    kernels = bool(isa) and not off
    why_not = off or why_not
    aten = "aten" + (" on oneDNN-packed weights" if not onednn else f" (no oneDNN bf16 packing: {onednn})")
    if off.startswith("the model runs"):  # (float32 / float16 linears: aten's, unpacked)
        aten = f"aten ({off.split(';')[0].removeprefix('the model runs ')})"
    name = f"MILI kernel ({isa})" if isa else ""
    side = name or f"torch (MILI kernels off: {why_not})"
    if not kernels:
        return {"bf16 linears": aten, "int8 / int4 linears": "aten weight-only int8; AWQ dequantized to bf16",
                "norms, RoPE, SwiGLU": f"torch (MILI kernels off: {why_not})",
                "attention": "torch (SDPA over gathered pages)", "Gated DeltaNet decode": side,
                "argmax, grammar bitmask": "torch argmax" + (f"; bitmask {side}" if isa else ", xgrammar"),
                "oneDNN bf16 packing": onednn or "runs"}
    amx = " on AMX tiles" if isa == "amx" else ""
    int_path = f"{name}{amx}" if not int_check else f"aten weight-only int8; AWQ dequantized ({int_check})"
    return {"bf16 linears": name + amx, "int8 / int4 linears": int_path, "norms, RoPE, SwiGLU": name,
            "attention": name + ", paged in place", "Gated DeltaNet decode": name, "argmax, grammar bitmask": name,
            "oneDNN bf16 packing": f"{onednn or 'runs'} (used where the kernels are off)"}


def headline(asked: bool = True, chosen: Choice | None = None) -> str:
    """The ISA, why, and the CPU's SIMD flags (the head of the start-up log's "CPU paths" line); ``chosen``: an
    engine's (default MILI_CPU_ISA's choice)."""
    chosen = chosen or choose()
    flags = " ".join(sorted(cpu_features() & {f for needs in NEEDS.values() for f in needs} | (
        cpu_features() & {"avx512_vnni", "avx512_bf16", "avx_vnni", "avx512dq", "i8mm", "bf16"})))
    return (f"CPU ISA {chosen.isa} ({chosen.why}; CPU: {flags or 'no SIMD flags known'})" if asked
            else f"MILI's CPU kernels not asked for (--no-cpu-kernels; CPU: {flags or 'no SIMD flags known'})")


def available() -> bool:
    return load()[0] is not None
