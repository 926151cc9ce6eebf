"""The sampler's top-k/top-p masks: the partial path (one topk of each row's k best) against the full
vocabulary sort, in one process. Qwen3's defaults (top_k 20, top_p 0.95) over a 151,936-token vocabulary.

    python benchmarks/sampler_topk.py [--batch 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import machine, print_table

from mili.runtime import sampler


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    logits = torch.randn(args.batch, 151936) * 3
    ks, ps = torch.full((args.batch,), 20), torch.full((args.batch,), 0.95)
    partial = timed(lambda: sampler.apply_top_k_top_p(logits.clone(), ks, ps), args.repeat)
    limit, sampler._TOP_K_PARTIAL_MAX = sampler._TOP_K_PARTIAL_MAX, 0
    full = timed(lambda: sampler.apply_top_k_top_p(logits.clone(), ks, ps), args.repeat)
    sampler._TOP_K_PARTIAL_MAX = limit
    print(f"sampler_topk: batch {args.batch} x 151,936, top_k 20, top_p 0.95, float32; {machine()}")
    print_table("top-k/top-p masks (ms per step)", ["path", "ms", "speed-up"],
                [["full sort", full, 1.0], ["partial (topk)", partial, full / partial]])


if __name__ == "__main__":
    main()
