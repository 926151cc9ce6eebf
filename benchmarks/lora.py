"""LoRA adapters on the CPU, side by side in one run: a Qwen3-0.6B-shaped random model (bf16, MILI's CPU kernels),
random rank-16 adapters on every linear projection (made by ``peft``), 8 sequences decoding at once.

  base            the base model alone, with --enable-lora off (the fused decode layer) and on (eager steps)
  4 adapters      the 8 sequences under 4 different adapters (2 each), in one batch
  one at a time   the same requests served one adapter at a time: 4 rounds of 2 sequences

Decode tok/s counts the decode-only steps (every sequence past its prompt): the median of --repeats rounds, each
round running every row in turn (after a warm-up of each).

    python benchmarks/lora.py [--rank 16] [--seqs 8] [--adapters 4] [--input-len 64] [--output-len 64]
                              [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import CACHE, machine, print_table, qwen3_checkpoint, random_prompt, run_batch

from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.kernels import cpu
from mili.lora import LoRARequest
from mili.sampling_params import SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapters(base: str, count: int, rank: int) -> list[LoRARequest]:
    """``count`` random adapters of ``base`` (rank ``rank``, every projection), made by peft once."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(count):
        path = CACHE / f"lora-{rank}-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            torch.manual_seed(i)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                          init_lora_weights=False))
            peft_model.save_pretrained(path)
        out.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    return out


def decode_rate(engine, prompts, params, loras) -> float:
    """Decode tok/s of one run of the batch."""
    stats: list = []
    run_batch(engine, prompts, params, stats, loras)
    engine.reset_prefix_cache()
    return stats[1] / stats[0]


def one_at_a_time(engine, prompts, params, loras) -> float:
    """Each adapter's requests served alone, one adapter after another: the decode tokens over the decode time."""
    seconds = tokens = 0.0
    for lora in dict.fromkeys(loras):
        mine = [p for p, l in zip(prompts, loras) if l == lora]
        stats: list = []
        run_batch(engine, mine, params, stats, [lora] * len(mine))
        seconds, tokens = seconds + stats[0], tokens + stats[1]
    engine.reset_prefix_cache()
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = qwen3_checkpoint("Qwen3-0.6B")
    loras = adapters(base, args.adapters, args.rank)
    prompts = [random_prompt(args.input_len, 10 + i) for i in range(args.seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    mixed = [loras[i % len(loras)] for i in range(args.seqs)]
    flags = sorted(f for f in cpu.cpu_features() if f.startswith(("avx", "amx")))
    print(f"machine: {machine()}; kernels: {cpu.best_isa()}; flags: {' '.join(flags)}")
    plain = LLMEngine(EngineConfig(model=base, num_threads=args.threads))
    engine = LLMEngine(EngineConfig(model=base, num_threads=args.threads, enable_lora=True,
                                    max_loras=args.adapters, max_lora_rank=args.rank))
    runs = {"base, --enable-lora off": lambda: decode_rate(plain, prompts, params, None),
            "base, --enable-lora on": lambda: decode_rate(engine, prompts, params, None),
            f"{args.adapters} adapters in one batch": lambda: decode_rate(engine, prompts, params, mixed),
            "one adapter at a time": lambda: one_at_a_time(engine, prompts, params, mixed)}
    for run in runs.values():  # (a warm-up each)
        run()
    rates = {name: [] for name in runs}
    for _ in range(args.repeats):  # rounds that take every run in turn: the machine's drift falls on all alike
        for name, run in runs.items():
            rates[name].append(run())
    rows = [[name, statistics.median(r)] for name, r in rates.items()]
    base_rate = rows[0][1]
    print_table(f"Decode, {args.seqs} sequences, rank {args.rank} on every projection (Qwen3-0.6B shape, bf16): "
                "tok/s and against the base model alone",
                ["run", "decode tok/s", "x base"], [r + [r[1] / base_rate] for r in rows])
    print(f"4 adapters in one batch against one at a time: {rows[2][1] / rows[3][1]:.2f}x")


if __name__ == "__main__":
    main()
