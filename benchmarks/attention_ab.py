"""A/B of versions of MILI's CPU decode attention (kernels.c) in one process: batch-1 decode attention over every
layer of a Qwen3 shape after ``--depths`` tokens, each layer's K/V in its own pages (random values, as a step streams
them; L3 defeated), bf16 pages and int8 pages (``mili_decode_attention`` over either), the
versions alternating, so a shared machine's minutes hit them alike. The attention alone: the part of a long-context
decode step that ``--kv-cache-dtype int8`` changes (llamacpp_compare.py --depths measures whole steps).

    python benchmarks/attention_ab.py OLD.c NEW.c [--depths 4096 16384] [--kv bf16 int8] [--repeat 8]
    python benchmarks/attention_ab.py mili/kernels/cpu/kernels.c@avx512 mili/kernels/cpu/kernels.c@avx2

A version is ``SOURCE[@ISA]`` as in linear_ab.py (built the same way): today's entry point (one
``mili_decode_attention`` over a ``mili_kv_pages`` descriptor, kernels.c from 2026-12-01 on) or the one before it
(``mili_decode_attention`` and ``mili_decode_attention_int8`` apart). GB counts every byte a step's attention reads:
the pages' values and, for int8, their float32 scales. Per thread count (1, 2): each version's median and minimum
over the repeats, its GB/s at the minimum, that as a share of a copy (read + write, same threads, best of 6,
measured beside) and its ratio to the first version (of medians / of minima).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch
from common import machine, print_table
from linear_ab import alternate, build, copy_rate, version_cells

from mili.kernels.cpu import ops

SHAPES = {"0.6B": (16, 8, 128, 28), "4B:8": (32, 8, 128, 8)}  # Hq, Hkv, D, layers


def pages(kv: str, layers: int, n_pages: int, hkv: int, page: int, d: int, g: torch.Generator):
    """Per layer, (K, V) as the kernel reads them: bf16 [pages, Hkv, page, D], or (int8 values, float32 scales)."""
    out = []
    for _ in range(layers):
        if kv == "bf16":
            out.append(tuple(torch.randn(n_pages, hkv, page, d, generator=g).to(torch.bfloat16) for _ in range(2)))
        else:
            out.append(tuple((torch.randint(-127, 128, (n_pages, hkv, page, d), dtype=torch.int8, generator=g),
                              torch.rand(n_pages, hkv, page, generator=g) / 64) for _ in range(2)))
    return out


_P, _I = ctypes.c_void_p, ctypes.c_int64
# the entry points before the pages' descriptor (kernels.c before 2026-12-01): bf16 and int8 pages apart
OLD = {"mili_decode_attention": [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int],
       "mili_decode_attention_int8": [_P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float,
                                      ctypes.c_int]}


def old_abi(lib) -> bool:
    """A version from before the descriptor (it exports mili_decode_attention_int8): its old argument types set."""
    if not hasattr(lib, "mili_decode_attention_int8"):
        return False
    for name, argtypes in OLD.items():
        getattr(lib, name).argtypes = argtypes
    return True


def step(lib, kv: str, caches, q, out, table, lens, hq: int, hkv: int, d: int, page: int, threads: int) -> float:
    scale = d ** -0.5
    if old_abi(lib):
        start = time.perf_counter()
        for k, v in caches:
            if kv == "bf16":
                lib.mili_decode_attention(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), table.data_ptr(),
                                          table.stride(0), lens.data_ptr(), out.data_ptr(), 1, hq, hkv, d, page, scale,
                                          threads)
            else:
                lib.mili_decode_attention_int8(q.data_ptr(), q.stride(0), k[0].data_ptr(), k[1].data_ptr(),
                                               v[0].data_ptr(), v[1].data_ptr(), table.data_ptr(), table.stride(0),
                                               lens.data_ptr(), out.data_ptr(), 1, hq, hkv, d, page, scale, threads)
        return time.perf_counter() - start
    seqs = ops.SeqPages(table.data_ptr(), table.stride(0), lens.data_ptr(), 1)
    views = [ops.KVPages(k.data_ptr(), v.data_ptr(), None, None, hkv, d, page) if kv == "bf16" else
             ops.KVPages(k[0].data_ptr(), v[0].data_ptr(), k[1].data_ptr(), v[1].data_ptr(), hkv, d, page)
             for k, v in caches]
    start = time.perf_counter()
    for pages in views:
        lib.mili_decode_attention(q.data_ptr(), q.stride(0), hq, scale, ctypes.byref(pages), ctypes.byref(seqs),
                                  out.data_ptr(), threads)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", help="kernels.c versions (SOURCE[@ISA]); ratios are to the first")
    p.add_argument("--shape", default="0.6B", choices=list(SHAPES))
    p.add_argument("--depths", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--kv", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--page-order", choices=["sequential", "random"], default="sequential",
                   help="the page table: pages in order (as a fresh pool hands a long prompt's) or shuffled")
    p.add_argument("--repeat", type=int, default=8, help="rounds; each times 2 steps of every version")
    args = p.parse_args()
    libs = [build(s) for s in args.sources]
    hq, hkv, d, layers = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    rows = []
    for depth in args.depths:
        n_pages = -(-depth // args.page_size)
        order = torch.randperm(n_pages, generator=g) if args.page_order == "random" else torch.arange(n_pages)
        table = order[None].to(torch.int64)
        lens = torch.tensor([depth], dtype=torch.int64)
        q = torch.randn(1, hq, d, generator=g).to(torch.bfloat16)
        out = torch.empty(1, hq, d, dtype=torch.bfloat16)
        for kv in args.kv:
            caches = pages(kv, layers, n_pages, hkv, args.page_size, d, g)
            nbytes = sum(t.numel() * t.element_size() for layer in caches for c in layer
                         for t in (c if isinstance(c, tuple) else (c,)))
            for threads in args.threads:
                times = alternate(libs, args.repeat, 2, lambda lib: step(
                    lib, kv, caches, q, out, table, lens, hq, hkv, d, args.page_size, threads))
                rows += [[depth, kv, threads, *cells]
                         for cells in version_cells(args.sources, times, nbytes, copy_rate(threads))]
            del caches
    print(f"\nbatch-1 decode attention, {args.shape} shape (Hq {hq}, Hkv {hkv}, D {d}, {layers} layers), page size "
          f"{args.page_size}, pages in {args.page_order} order, {args.repeat} x 2 steps a version, alternating; {machine()}")
    print_table("decode attention A/B", ["depth", "KV", "threads", "kernels.c", "GB", "median ms", "min ms",
                                         "min GB/s", "min of copy GB/s", "vs first (median / min)"], rows, digits=3)


if __name__ == "__main__":
    main()
