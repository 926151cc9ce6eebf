"""Qwen3-30B-A3B-shaped decode on the CPU, cut to a few layers: MILI against HF transformers, one run.

    python benchmarks/moe_decode.py [--layers 2] [--new-tokens 32]

Random bf16 weights in the official shape (128 experts, 8 active, moe_intermediate 768, hidden 2048),
``--layers`` decoder layers (the full 48 do not fit this machine's memory as a random checkpoint).
Batch-1 greedy decode of the same prompt by both; the table gives tok/s, the bytes of weights one
decode step must read (attention, router, the 8 routed experts of every layer, the lm_head: the active
parameters) and what that makes as read bandwidth at the measured speed. Per-layer figures scale to 48
layers by the per-layer share of the step time.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import machine, print_table, qwen3_checkpoint


def active_bytes(cfg) -> int:
    """Weights one batch-1 decode step reads: attention, norms, router, k experts per layer, the lm_head."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    per_layer = attn + cfg.num_experts * h + experts
    return 2 * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    args = p.parse_args()
    path = qwen3_checkpoint("Qwen3-30B-A3B", layers=args.layers)
    prompt = list(range(1000, 1000 + args.prompt_len))

    from transformers import AutoConfig, Qwen3MoeForCausalLM

    from mili import LLM, SamplingParams

    cfg = AutoConfig.from_pretrained(path)
    rows = []
    llm = LLM(path, dtype="bfloat16", max_model_len=256, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m = out.metrics
    decode_s = m["finished_time"] - m["first_token_time"]
    rows.append(["MILI (CPU kernels, experts packed)", (args.new_tokens - 1) / decode_s])
    mili_tokens = out.outputs[0].token_ids
    del llm

    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        first = hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        ref = hf.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        hf_s = time.perf_counter() - start - prefill_s
    rows.append(["HF transformers", (args.new_tokens - 1) / hf_s])
    same = sum(a == b for a, b in zip(mili_tokens, ref[0, len(prompt):].tolist()))
    del first

    step_bytes = active_bytes(cfg)
    table = [[name, f"{tps:.1f}", f"{tps / rows[1][1]:.2f}x", f"{step_bytes / 1e6:.0f}",
              f"{step_bytes * tps / 1e9:.1f}"] for name, tps in rows]
    print_table(f"Qwen3-30B-A3B shape, {args.layers} layers, batch 1, {args.prompt_len}-token prompt, "
                f"{args.new_tokens} new tokens ({same}/{args.new_tokens} greedy tokens equal); {machine()}",
                ["engine", "decode tok/s", "vs HF", "active MB a step", "GB/s read at that speed"], table)
    head = 2 * cfg.vocab_size * cfg.hidden_size
    per_layer = (step_bytes - head) / args.layers
    print(f"\nper layer {per_layer / 1e6:.0f} MB active; 48 layers + head: {(48 * per_layer + head) / 1e9:.2f} GB a "
          f"step, i.e. {rows[0][1] * step_bytes / (48 * per_layer + head):.1f} tok/s at MILI's measured read rate")


if __name__ == "__main__":
    main()
