"""Batch-1 decode and a 512-token prefill of the hybrid Qwen generation on the CPU: MILI against HF
transformers in the same run, on random-weight checkpoints of released shapes (tests/data/qwen3.5):

  Qwen3.5-0.8B     -- the whole model (24 layers, 18 Gated DeltaNet + 6 gated attention, tied 248k vocabulary)
  Qwen3.5-4B/8     -- the 4B shape cut to 8 layers (6 + 2)

For each it prints the bytes one decode step moves (the weights read, the KV of the full-attention layers,
each linear layer's recurrent state read and written), the copy roofline those bytes allow at the measured
bandwidth, and each engine's share of it.

    python benchmarks/hybrid_decode.py [--shapes 0.8B 4B/8] [--dtype bfloat16] [--input-len 512] [--output-len 64]
"""

from __future__ import annotations

import argparse
import gc

import torch

from common import hybrid_checkpoint, machine, print_table, random_prompt

from mili.tools.bench import _hf_generate, _hf_model, _measure_latency, step_bytes
from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.kernels import cpu

SHAPES = {"0.8B": ("Qwen3.5-0.8B", None), "4B/8": ("Qwen3.5-4B", 8)}


def measure(label: str, path: str, args) -> list[list]:
    engine = LLMEngine(EngineConfig(model=path, dtype=args.dtype, max_model_len=2048, kv_cache_memory=1 << 30,
                                    max_num_seqs=4, num_state_snapshots=0))
    prompt = random_prompt(args.input_len, 0)
    ttft, decode, bandwidth = _measure_latency(engine, prompt, args)
    parts = step_bytes(engine.core.runner, args.input_len + args.output_len // 2)
    step = sum(parts.values())
    roofline = bandwidth / step
    hf = _hf_model(engine)
    _hf_generate(hf, [prompt[:16]], 2)
    hf_first = min(_hf_generate(hf, [prompt], 1) for _ in range(args.repeat))
    hf_all = _hf_generate(hf, [prompt], args.output_len)
    hf_decode = (args.output_len - 1) / (hf_all - hf_first)
    print(f"{label}: {path}; bandwidth {bandwidth / 1e9:.1f} GB/s; a decode step moves {step / 2**20:.0f} MiB ("
          + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in parts.items()) + f"); roofline {roofline:.1f} tok/s")
    rows = [[label, "MILI", ttft, args.input_len / ttft, decode, f"{100 * decode / roofline:.0f}%"],
            [label, "HF transformers", hf_first, args.input_len / hf_first, hf_decode,
             f"{100 * hf_decode / roofline:.0f}%"],
            [label, "MILI / HF", f"{hf_first / ttft:.2f}x", "", f"{decode / hf_decode:.2f}x", ""]]
    del engine, hf
    gc.collect()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="MILI: median of this many runs; HF prefill: best of")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for label in args.shapes:
        rows += measure(label, hybrid_checkpoint(*SHAPES[label], dtype), args)
    print(f"{machine()}; {args.dtype}; MILI's CPU kernels: {cpu.isa() or 'off (' + cpu.load()[1] + ')'}; "
          f"prompt {args.input_len} tokens, {args.output_len} out, batch 1, greedy")
    print_table("hybrid decode and prefill", ["shape", "engine", "TTFT s", "prefill tok/s", "decode tok/s",
                                              "of roofline"], rows)


if __name__ == "__main__":
    main()
