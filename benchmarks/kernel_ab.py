"""A/B of versions of MILI's CPU kernels (kernels.c) inside one engine: each version built as its own library and
swapped into the running engine in turn, so that every version decodes the same model, with the same weights in the
same memory, in the same minutes (this VM's memory bandwidth moves by ±20% over minutes; separate processes compare
those minutes, not the kernels). Two measures:

* ``--mode layers`` (default): one decode step's decoder layers (``CpuDecodeRunner.run``: one C call over them) replayed
  over a step recorded after a ``--context``-token prompt, the versions alternating every 5 replays. The lm_head stays
  on the engine's own library.
* ``--mode e2e``: whole greedy decodes of ``--output-len`` tokens after the prompt (``mili bench latency``'s measure),
  the versions alternating each decode; the whole library swapped (layers, lm_head, sampler).

    python benchmarks/kernel_ab.py OLD.c NEW.c [--model M] [--mode layers|e2e] [--rounds 16] [--context 64]

e.g. ``mkdir /tmp/old && git archive HEAD~1 mili/kernels/cpu | tar -x -C /tmp/old``, then
``/tmp/old/mili/kernels/cpu/kernels.c`` (a version needs today's ``mili_decode_layers``, over ``mili_kv_pages``
descriptors: kernels.c from 2026-12-01 on; ``--mode e2e`` runs today's ops over it, so there every kernel's arguments
must be today's: the norms', attention's, linears' and Gated DeltaNet's argument structs too). A version is a kernels.c path: the ISA headers it
includes are those beside it where it has them (a copy of ``mili/kernels/cpu`` with one file changed compares a
header change), else the working tree's; ``SOURCE@ISA`` picks an ISA. Built by ``linear_ab.build`` (cc -O3, the ISA's
flags, -fopenmp, under /tmp). Default
model: the 0.6B shape's Q4_0 GGUF that ``llamacpp_compare.py --same-file`` makes (the cache must hold it).
Prints each version's median and minimum and its ratio to the first (of medians).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import CACHE, machine
from linear_ab import build

from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.kernels.cpu import ops
from mili.tools.bench import _run

DEFAULT_MODEL = CACHE / "Qwen3-0.6B-random-bfloat16-s0-Q4_0.gguf"


def recorded_step(engine, prompt: list[int]):
    """(batch, kv caches) of the first decode step after ``prompt`` (the fused layers' inputs)."""
    runner = engine.core.runner.parts.cpu_decode
    assert runner is not None, "the engine runs no fused CPU decode (GPU, MoE, or the kernels are off)"
    saved, run = [], runner.run

    def record(batch, kv, verifying=False):
        out = run(batch, kv, verifying)
        if out is not None and not saved:
            saved.append((batch, kv))
        return out

    runner.run = record
    try:
        _run(engine, [prompt], [2])
    finally:
        runner.run = run
    engine.reset_prefix_cache()
    return saved[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", help="kernels.c versions; ratios are to the first")
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--mode", choices=["layers", "e2e"], default="layers")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--context", type=int, default=64, help="prompt tokens before the measured steps")
    p.add_argument("--output-len", type=int, default=96, help="e2e: tokens a decode")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    libs = [build(s) for s in args.sources]
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", max_model_len=args.context + args.output_len + 8,
                                    kv_cache_memory=1 << 30, num_threads=args.threads))
    cpu_decode = engine.core.runner.parts.cpu_decode
    prompt = [1000 + i for i in range(args.context)]
    _run(engine, [prompt], [4])  # warm up
    engine.reset_prefix_cache()
    times: list[list[float]] = [[] for _ in libs]
    if args.mode == "layers":
        batch, kv = recorded_step(engine, prompt)
        with torch.inference_mode():
            for _ in range(args.rounds):
                for lib, t in zip(libs, times):
                    cpu_decode.lib = lib
                    cpu_decode.run(batch, kv)  # (the other version's lines out of the caches)
                    for _ in range(5):
                        start = time.perf_counter()
                        cpu_decode.run(batch, kv)
                        t.append(time.perf_counter() - start)
        unit, scale = "ms a step's layers", 1e3
    else:
        for _ in range(args.rounds):
            for lib, t in zip(libs, times):
                cpu_decode.lib = lib
                with ops.library(lib):
                    stats: list = []
                    _run(engine, [prompt], [args.output_len], stats)
                    engine.reset_prefix_cache()
                t.append(stats[0] / stats[1])  # seconds a token
        unit, scale = "ms a token", 1e3
    print(f"\n{args.mode}: {Path(args.model).name}, prompt {args.context}, {args.rounds} rounds, {machine()}")
    base = statistics.median(times[0])
    for source, t in zip(args.sources, times):
        med = statistics.median(t)
        print(f"{source:40s} median {med * scale:.3f} {unit}, min {min(t) * scale:.3f}, "
              f"speed vs first {base / med:.3f}x")


if __name__ == "__main__":
    main()
