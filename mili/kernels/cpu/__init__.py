"""MILI's CPU kernels (``kernels.c``): matrix multiplies over packed bf16 or int8 weights (AMX tiles where
the CPU has them, AVX-512 BF16 / VNNI otherwise, AVX-512F where it lacks BF16), fused RMSNorm, q/k-norm +
RoPE, SwiGLU, and decode attention reading the paged pool in place.

Why C: decoding one token must stream every weight once, and the fastest path torch offers on this
class of CPU (oneDNN on prepacked weights) streams well below what the memory gives; the kernels here
stream near read speed (benchmarks/NOTES.md, steps 8 and 9). The small ops cost ~30 us each through
torch's dispatch and a few us here.

The library is built on first use with the system C compiler (``$CC`` or ``cc``) and cached under
``$MILI_CACHE_DIR/kernels`` (default ``~/.cache/mili``), keyed by the source, the compiler and the CPU.
Where it can't be used (no compiler, no AVX-512, not Linux x86-64) :func:`load` says why and
the engine runs torch ops instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: the library's libgomp must resolve to torch's)

SOURCE = Path(__file__).with_name("kernels.c")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")  # AVX-512 BF16 where present, else emulated in AVX-512F
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")  # optional: the linear layers use AMX when present
log = logging.getLogger("mili")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # name -> argument types (all return void but mili_amx_init)
    "mili_linear": [_P, _P, _P, _I, _I, _I, ctypes.c_int],
    "mili_linear_int8": [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int],
    "mili_linear_int4": [_P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int],
    "mili_use_amx": [ctypes.c_int],
    "mili_uses_amx": [],
    "mili_rms_norm": [_P, _I, _P, _P, _P, _P, _I, _I, _F, ctypes.c_int],
    "mili_qk_norm_rope": [_P, _I, _I, _I, _I, _I, _P, _P, _F, _P, _P, ctypes.c_int],
    "mili_silu_and_mul": [_P, _P, _I, _I, ctypes.c_int],
    "mili_decode_attention": [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, ctypes.c_int],
    "mili_prefill_attention": [_P, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, ctypes.c_int],
    "mili_argmax_rows": [_P, _I, _I, _I, _P, ctypes.c_int],
    "mili_apply_bitmask": [_P, _I, _P, _I, _P, _I, _I, ctypes.c_int],
    "mili_store_kv": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I],
    "mili_decode_layer": [_P, _P, _P, ctypes.c_int, _P, _P, _P, _P, _P, _P, _I, _P, _I, _I, _P, ctypes.c_int],
    "mili_gdn_decode": [_P, _I, _P, _I, ctypes.c_int, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I,
                        ctypes.c_int],
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    return Path(os.environ.get("MILI_CACHE_DIR") or Path.home() / ".cache" / "mili").expanduser() / "kernels"


def _build(compiler: str, flags: set[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(sorted(flags)).encode()).hexdigest()
    target = _cache_dir() / f"mili_kernels_{key[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", tmp, "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)  # atomic: processes building at once each land a whole file
    return target


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why it can't be used here). Built and loaded once per process."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the CPU kernels are for Linux x86-64 (this is {platform.system()} {platform.machine()})"
    flags = _cpu_flags()
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in flags]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None, "no C compiler (set $CC or install gcc)"
    try:
        lib = ctypes.CDLL(str(_build(compiler, flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"building the CPU kernels failed: {exc}"
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int if name == "mili_uses_amx" else None
    # AMX where the CPU has it and Linux grants this process its tile state, else AVX-512
    lib.mili_use_amx(int(all(f in flags for f in AMX_CPU_FLAGS) and lib.mili_amx_init() == 0))
    return lib, ""


def isa() -> str:
    """What the linear layers run on: "amx", "avx512" or "" (no kernels)."""
    if load()[0] is None:
        return ""
    return "amx" if load()[0].mili_uses_amx() else "avx512"


def int8_available() -> bool:
    """The int8 kernel needs AMX-INT8 or AVX-512 VNNI."""
    return isa() == "amx" or (isa() == "avx512" and "avx512_vnni" in _cpu_flags())


def available() -> bool:
    return load()[0] is not None
