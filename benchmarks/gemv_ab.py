"""A/B of the split-K Triton GEMV (mili/kernels/triton/gemv.py) against cuBLAS (F.linear) on the linear layers of a
decode step: Qwen3-0.6B's shapes (q|k|v 1024 -> 4096, o 2048 -> 1024, gate|up 1024 -> 6144, down 3072 -> 1024, the
lm_head 1024 -> 151936) at M = 1, 4 and 8 rows, bf16 by default.

    python benchmarks/gemv_ab.py [--rows 1 4 8] [--dtype bfloat16|float16] [--repeat 50] [--eager]

Each shape gets enough distinct weight matrices (at least 256 MB together) that the calls stream them from HBM, not
the L2, as a decode step does; one timed round calls every copy in turn, captured in a CUDA graph (the engine's
decode steps run in graphs; ``--eager``: plain launches) and replayed ``--repeat`` times. Prints each side's time a
call (the median round's), its GB/s of weights and activations, cuBLAS's time over the GEMV's (above 1: the GEMV is
faster), and the largest difference of the two outputs (the same float32 products summed in other orders, then
rounded: about one bf16 rounding). Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}  # name: (N, K) of Qwen3-0.6B
STREAM_BYTES = 256 << 20  # weights a timed round streams at least (H100's L2: 50 MB)


def time_call(fn, x, ws, repeat: int, eager: bool) -> float:
    """Median seconds a call of ``fn(x, w)`` over the copies ``ws`` (a round calls each once)."""
    def round_():
        for w in ws:
            fn(x, w)

    for _ in range(3):  # compile, warm up
        round_()
    torch.cuda.synchronize()
    if not eager:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            round_()
        round_ = graph.replay
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        round_()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(ws))
    return statistics.median(times)


def bench_shape(name: str, n: int, k: int, m: int, dtype: torch.dtype, repeat: int, eager: bool) -> list:
    from mili.kernels.triton.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    copies = max(2, -(-STREAM_BYTES // (n * k * dtype.itemsize)))
    ws = [torch.randn(n, k, generator=g, device="cuda").to(dtype) for _ in range(copies)]
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    bytes_ = (n * k + m * (k + n)) * dtype.itemsize
    t_gemv = time_call(gemv, x, ws, repeat, eager)
    t_cublas = time_call(F.linear, x, ws, repeat, eager)
    diff = (gemv(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
    return [name, f"{n} x {k}", m, f"{t_gemv * 1e6:.1f}", f"{bytes_ / t_gemv / 1e9:.0f}", f"{t_cublas * 1e6:.1f}",
            f"{bytes_ / t_cublas / 1e9:.0f}", f"{t_cublas / t_gemv:.2f}", f"{diff:.3g}"]


HEADER = ["layer", "N x K", "M", "gemv us", "gemv GB/s", "cublas us", "cublas GB/s", "cublas / gemv", "max |diff|"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--eager", action="store_true", help="plain launches instead of a CUDA graph")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gemv_ab: needs CUDA (the GEMV's speed against cuBLAS is a GPU measurement); nothing run")
        return
    from common import print_table

    dtype = getattr(torch, args.dtype)
    rows = [bench_shape(name, n, k, m, dtype, args.repeat, args.eager) for name, (n, k) in SHAPES.items()
            for m in args.rows]
    print_table(f"split-K GEMV vs cuBLAS: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
                f"{'eager' if args.eager else 'CUDA graph'}", HEADER, rows)


if __name__ == "__main__":
    main()
