"""A/B of versions of MILI's CPU kernels (kernels.c) on the linear layers of a decode step, in one process:
every linear of a Qwen3 shape at M = 1 (distinct matrices, as a step streams them, L3 defeated), the versions
alternating, so that a shared machine's minutes hit them alike. A version is a source and an ISA
(``SOURCE[@ISA]``, default the best this CPU runs), so one source's AVX2 and AVX-512 paths compare too:

    python benchmarks/linear_ab.py OLD.c NEW.c [--shapes 0.6B 4B:8] [--formats int4 int8 bf16] [--repeat 10]
    python benchmarks/linear_ab.py mili/kernels/cpu/kernels.c@avx512 mili/kernels/cpu/kernels.c@avx2
    python benchmarks/linear_ab.py mili/kernels/cpu/kernels.c --shapes 0.6B --formats int8 q8_0 q6_k q5_k int4 q4_k
    python benchmarks/linear_ab.py mili/kernels/cpu/kernels.c --formats q6_k q6_k-int8g --rows 512  (prefill)

The formats: bf16; int8 (a float32 scale per output channel); int4 (AWQ's groups of 128, float32 scales and
offsets); q4_k (the int4 kernel, groups of 32, scales and offsets in GGUF's two levels: fp16 d per 256, int8 sc per
group); q6_k and q5_k (the int4 kernel with 2 and 1 bits above the nibble: groups of 16, two-level scales, no
offsets; groups of 32, two-level scales and offsets); and the int8g kernel's: q8_0 (groups of 32, fp16 scales, no
offsets), q6_k-int8g and q5_k-int8g (Q6_K's and Q5_K's forms as 8-bit u, as MILI ran them before the high bits).
q4_k-f32 and q6_k-f32: the same with float32 scales d sc (and offsets), as MILI kept them before. GB counts every
byte a format reads (weights, scales, offsets, column sums). ``--rows``: x's rows (default 1: decode).

e.g. ``mkdir /tmp/old && git archive HEAD~1 mili/kernels/cpu | tar -x -C /tmp/old``, then
``/tmp/old/mili/kernels/cpu/kernels.c`` against the working tree's (a version compiles with the files beside it: its
kernel families and ISA headers; a lone kernels.c from before 2026-12-01, one file, takes the working tree's ISA
headers). The int8, int4 and int8g calls are today's (over a ``mili_linear_desc``) where the version's own
``mili_kernels.h`` (beside it) declares them so, else the argument lists from before that descriptor (the int4
kernel's high_bits and both grouped kernels' ldy after scale_mode and sub): a version from before those takes its
arguments shifted, so its int4 and int8g figures mean nothing; its bf16 and int8 ones stand. Each version is built
like the library (cc -O3, the ISA's flags alone, -fopenmp) under /tmp, keyed by its source and flags. Per thread count
(1, 2): the median and the minimum (the trials that had the cores) of a sweep's time, its GB/s of weights,
the minimum's share of a 1 GiB copy (read + write, the best of 6, same threads) and each version's ratio to
the first. Calls go through ctypes (~1-2 µs each, which the engine's one call per layer does not pay).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from common import machine, print_table

from mili.kernels.cpu import HERE, abi, best_isa, compile_flags
from mili.kernels.cpu.ops import (grouped_desc, int8_column_sums, int8_desc, pack_int4, pack_int8g, pack_weight,
                                  scale_form)

# (out, in) of qkv, o, gate_up, down; decoder layers
SHAPES = {"0.6B": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], 28),
          "4B:8": ([(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)], 8)}
GROUP = 128  # AWQ's group size in Qwen's releases
# the int4 and int8g formats: (kernel, group, scales' form: float16, float32 or "k" (two levels), with offsets)
# (q6_k-int8g, q5_k-int8g: those blocks on the int8g kernel, as MILI ran them before the int4 kernel's high bits)
GROUPED = {"int4": ("int4", GROUP, torch.float32, True, 0), "q4_0": ("int4", 32, torch.float16, False, 0), "q4_k": ("int4", 32, "k", True, 0),
           "q4_k-f32": ("int4", 32, torch.float32, True, 0), "q8_0": ("int8g", 32, torch.float16, False, 0),
           "q6_k": ("int4", 16, "k", False, 2), "q5_k": ("int4", 32, "k", True, 1),
           "q6_k-int8g": ("int8g", 16, "k", False, 0), "q6_k-f32": ("int8g", 16, torch.float32, False, 0),
           "q5_k-int8g": ("int8g", 32, "k", True, 0)}
_P, _I = ctypes.c_void_p, ctypes.c_int64
# the quantized kernels' arguments before their descriptor: w, scales, column sums or offsets, x, y, M, N, K, then
# (int4, int8g) group, scale_mode, sub, high_bits (int8g: signed), ldy; threads
_GROUPED = [_P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int, _I, ctypes.c_int, _I, ctypes.c_int]
OLD = {"mili_linear_int8": [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int], "mili_linear_int4": _GROUPED,
       "mili_linear_int8g": _GROUPED}


def build(version: str) -> ctypes.CDLL:
    source, _, isa = version.partition("@")
    flags = compile_flags(isa or best_isa())
    # (the files it includes: those beside the source where it has them, else the working tree's)
    beside = Path(source).resolve().parent
    headers = sorted(set(beside.glob("*.[ch]")) - {Path(source).resolve()}) if any(beside.glob("isa_*.h")) else \
        sorted(set(HERE.glob("*.[ch]")) - {HERE / "kernels.c"})
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [Path(source), *headers])
                         + " ".join(flags).encode()).hexdigest()[:16]
    target = f"/tmp/mili_linear_ab_{key}.so"
    subprocess.run(["cc", "-O3", *flags, "-fopenmp", "-shared", "-fPIC", f"-I{HERE}", source, "-o", target, "-lm"],
                   check=True)
    lib = ctypes.CDLL(target)
    abi.bind(lib)  # (an older version may lack a newer function: bind skips it)
    header = beside / "mili_kernels.h"  # (a version's own ABI: its quantized kernels over a descriptor or not)
    lib.linear_desc = header.exists() and re.search(r"mili_linear_int8\s*\(\s*const\s+mili_linear_desc\b",
                                                    header.read_text()) is not None
    if not lib.linear_desc:
        for name, argtypes in OLD.items():
            if hasattr(lib, name):
                getattr(lib, name).argtypes = argtypes
    return lib


def weights(shape: str, fmt: str) -> list[tuple[int, int, tuple[torch.Tensor, ...], object]]:
    """(out, in, the kernel's tensors, the int8, int4 or int8g kernel's descriptor of them or None) of every linear of
    the shape, random, in the packed layouts."""
    mats, layers = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        for n, k in mats:
            if fmt in GROUPED:  # (int4: AWQ's group, float32 scales and offsets, as an AWQ checkpoint loads)
                kernel, group, form, offsets, high_bits = GROUPED[fmt]
                top = 16 << high_bits if kernel == "int4" else 256
                q = torch.randint(0, top, (n, k), dtype=torch.uint8, generator=g)
                if form == "k":  # d (fp16) per 256, sc (int8) per group; offsets -dmin, m
                    d = (torch.rand(2, n, k // 256, generator=g) * 1e-3).half().float()
                    sc = torch.randint(0, 64, (2, n, k // group), dtype=torch.int8, generator=g)
                    scales, zeros = (d[0], sc[0]), (-d[1], sc[1])
                else:
                    scales = torch.rand(n, k // group, generator=g) * 0.01
                    zeros = -scales * torch.randint(0, 16, scales.shape, generator=g)
                args = (q, scales, zeros if offsets else None, torch.float32 if form == "k" else form)
                packed = pack_int4(*args, high_bits=high_bits) if kernel == "int4" else pack_int8g(*args)
                desc = grouped_desc(*packed, k, 0 if kernel == "int4" else 1, high_bits)
                out.append((n, k, tuple(t for t in packed if t is not None), desc))
            elif fmt == "bf16":
                out.append((n, k, (pack_weight(torch.randn(n, k, generator=g).to(torch.bfloat16)),), None))
            else:
                packed = pack_weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
                tensors = (packed, torch.rand(n) * 0.01, int8_column_sums(packed))
                out.append((n, k, tensors, int8_desc(*tensors)))
    return out


def sweep(lib, fmt: str, mats, threads: int, xs: dict, ys: dict, m: int) -> float:
    start = time.perf_counter()
    for n, k, tensors, desc in mats:
        x, y, w = xs[k].data_ptr(), ys[n].data_ptr(), tensors[0].data_ptr()
        if fmt in GROUPED and lib.linear_desc:
            fn = lib.mili_linear_int4 if GROUPED[fmt][0] == "int4" else lib.mili_linear_int8g
            fn(ctypes.byref(desc), x, y, m, n, threads)
        elif fmt == "int8" and lib.linear_desc:
            lib.mili_linear_int8(ctypes.byref(desc), x, y, m, threads)
        elif fmt in GROUPED:  # (a version from before the descriptor)
            kernel, group, _, offsets, high_bits = GROUPED[fmt]
            mode, sub, _ = scale_form(tensors[1])
            b = tensors[2].data_ptr() if offsets else None
            if kernel == "int4":
                lib.mili_linear_int4(w, tensors[1].data_ptr(), b, x, y, m, n, k, group, mode, sub, high_bits, n, threads)
            else:
                lib.mili_linear_int8g(w, tensors[1].data_ptr(), b, x, y, m, n, k, group, mode, sub, 0, n, threads)
        elif fmt == "bf16":
            lib.mili_linear(w, x, y, m, n, k, threads)
        else:
            lib.mili_linear_int8(w, tensors[1].data_ptr(), tensors[2].data_ptr(), x, y, m, n, k, threads)
    return time.perf_counter() - start


def alternate(libs, repeat: int, each: int, run) -> list[list[float]]:
    """Each version's times: ``repeat`` rounds, in each every version in turn runs once untimed (the previous
    version's lines evicted) and ``each`` times timed (``run(lib)`` returns seconds)."""
    times: list[list[float]] = [[] for _ in libs]
    for _ in range(repeat):
        for lib, t in zip(libs, times):
            run(lib)
            t.extend(run(lib) for _ in range(each))
    return times


def version_cells(sources, times: list[list[float]], nbytes: int, copy: float) -> list[list]:
    """Per version: its name, GB, median and minimum ms, GB/s at the minimum, that as a share of ``copy`` (B/s), and
    its ratio to the first version (of medians / of minima)."""
    rows = []
    for source, t in zip(sources, times):
        med, low = statistics.median(t), min(t)
        rows.append([source, nbytes / 1e9, med * 1e3, low * 1e3, nbytes / low / 1e9,
                     f"{100 * nbytes / low / copy:.0f}% of {copy / 1e9:.1f}",
                     f"{statistics.median(times[0]) / med:.3f}x / {min(times[0]) / low:.3f}x"])
    return rows


def copy_rate(threads: int) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(1 << 30, dtype=torch.uint8)  # (written: an untouched one reads the shared zero page)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(6):
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() / (time.perf_counter() - start))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sources", nargs="+", help="kernels.c versions (SOURCE[@ISA]); ratios are to the first")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--formats", nargs="+", default=["int4"], choices=["int8", "bf16", *GROUPED])
    p.add_argument("--repeat", type=int, default=10, help="rounds; each times 3 sweeps of every version")
    p.add_argument("--rows", type=int, default=1, help="M, the rows of x (1: decode; 512: a prefill chunk)")
    args = p.parse_args()
    libs = [build(s) for s in args.sources]
    older = [s for s, lib in zip(args.sources, libs) if not hasattr(lib, "mili_linear_int8g")]
    int8g = [f for f, spec in GROUPED.items() if spec[0] == "int8g"]
    if older and set(args.formats) & set(int8g):
        p.error(f"{', '.join(older)} has no int8g kernel: leave out {', '.join(int8g)}")
    rows = []
    for shape in args.shapes:
        for fmt in args.formats:
            mats = weights(shape, fmt)
            nbytes = sum(t.numel() * t.element_size() for _, _, ts, _ in mats for t in ts)
            xs = {k: torch.randn(args.rows, k).to(torch.bfloat16) for _, k, _, _ in mats}
            ys = {n: torch.empty(args.rows, n, dtype=torch.bfloat16) for n, _, _, _ in mats}
            for threads in (1, 2):
                times = alternate(libs, args.repeat, 3,
                                  lambda lib: sweep(lib, fmt, mats, threads, xs, ys, args.rows))
                rows += [[shape, fmt, threads, *cells]
                         for cells in version_cells(args.sources, times, nbytes, copy_rate(threads))]
    print(f"\nevery linear at M = {args.rows}, distinct matrices, {args.repeat} x 3 sweeps a version, alternating; {machine()}")
    print_table("linear A/B", ["shape", "format", "threads", "kernels.c", "GB", "median ms", "min ms", "min GB/s",
                               "min of copy GB/s", "vs first (median / min)"], rows, digits=3)


if __name__ == "__main__":
    main()
