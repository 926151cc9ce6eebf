"""Speculative decoding on the CPU: batch-1 decode tokens/s with speculation off and on, in the same run, for a
0.6B-shaped Qwen3 and a Qwen3.5-0.8B-shaped hybrid (random weights, bf16, MILI's CPU kernels).

Each model is *scripted*: its residual branches (o_proj, down_proj, the linear attention's out_proj) are zeroed,
so its greedy next token is the current one (tied embeddings: a token's own row scores highest) and it repeats
its last prompt token; it reads every weight a real model reads. On it:

  off                    plain decoding
  ngram k=2, k=3         n-gram prompt lookup: after the first steps every draft is right (100%)
  ngram k=2, k=3 ~70%    the same drafts, each token replaced by a wrong one with probability q, chosen so that the
                         expected acceptance is 70%: the measured rate is printed

For each row: the acceptance rate, tokens a step emits, decode tok/s, the speed-up over off, and the bound the
bytes allow (a verifying step reads the weights once, as a plain step does, for 1 + accepted tokens: the
plain step's copy roofline times that). Then a batch sweep at 100% (k = 3, speculation forced on at every
batch size) against off: the batch size where speculation stops paying is what ``disable_by_batch_size``
defaults to (mili/config.py), and the last row checks batch 32 with the default is not slower than off.

    python benchmarks/speculative.py [--models 0.6B 0.8B] [--input-len 128] [--output-len 128] [--repeat 2]
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import statistics

import torch
from safetensors.torch import load_file, save_file

from common import hybrid_checkpoint, machine, print_table, qwen3_checkpoint, random_prompt, run_batch

from mili.bench import memory_bandwidth, step_bytes
from mili.config import DEFAULT_SPEC_DISABLE_BATCH, EngineConfig
from mili.engine.engine import LLMEngine
from mili.kernels import cpu
from mili.sampling_params import SamplingParams

MODELS = {"0.6B": lambda: qwen3_checkpoint("Qwen3-0.6B"), "0.8B": lambda: hybrid_checkpoint("Qwen3.5-0.8B", None,
                                                                                             torch.bfloat16)}
ZEROED = ("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")


def scripted(path: str) -> str:
    """A copy of the checkpoint with its residual branches zeroed (built once, beside it)."""
    out = path + "-scripted"
    if shutil.os.path.isfile(out + "/model.safetensors"):
        return out
    shutil.copytree(path, out + ".tmp", ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    tensors = load_file(path + "/model.safetensors")
    for name, t in tensors.items():
        if name.endswith(ZEROED):
            t.zero_()
    save_file(tensors, out + ".tmp/model.safetensors", metadata={"format": "pt"})
    shutil.os.replace(out + ".tmp", out)
    return out


def q_for(k: int, rate: float) -> float:
    """The per-token corruption probability q whose expected acceptance, mean over j < k of (1 - q)^(j + 1), is
    ``rate`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum((1 - q) ** (j + 1) for j in range(k)) / k > rate else (lo, q)
    return (lo + hi) / 2


def engine_for(path: str, spec: dict | None, threads: int | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, dtype="bfloat16", max_model_len=2048, kv_cache_memory=1 << 30,
                                  num_threads=threads, speculative_config=spec))


def corrupt(engine: LLMEngine, q: float) -> None:
    """Each drafted token is replaced by another with probability q (independently; seeded)."""
    rng, propose, vocab = random.Random(2026), engine.core.drafter.propose, engine.model_config.vocab_size
    engine.core.drafter.propose = lambda seq, k: [t if rng.random() >= q else (t + 1) % vocab
                                                  for t in propose(seq, k)]


def decode_speed(engine: LLMEngine, prompts: list[list[int]], output_len: int, repeat: int) -> float:
    """Median over ``repeat`` runs of the aggregate decode tok/s (the steps after every prompt is in)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    run_batch(engine, [p[:8] for p in prompts[:1]], SamplingParams(temperature=0, max_tokens=4))  # warm up
    speeds = []
    for _ in range(repeat):
        stats = []
        run_batch(engine, prompts, params, stats)
        engine.prefix_cache.evict(engine.runner.pool.num_pages)
        speeds.append(stats[1] / stats[0])
    return statistics.median(speeds)


def rate(engine: LLMEngine, before: dict) -> tuple[float, float]:
    """(acceptance rate, tokens a verifying step emits) since ``before``."""
    now = engine.spec_decode_stats()
    drafts, drafted, accepted = (now[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    return (accepted / drafted if drafted else 0.0), (1 + accepted / drafts if drafts else 1.0)


def bench_model(name: str, args) -> None:
    path = scripted(MODELS[name]())
    prompt = random_prompt(args.input_len, seed=1)
    rows, off = [], None
    configs = [("off", None, 0.0)]
    for k in (2, 3):
        configs.append((f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k}, 0.0))
    for k in (2, 3):
        configs.append((f"ngram k={k}, ~70%", {"method": "ngram", "num_speculative_tokens": k}, q_for(k, 0.70)))
    bandwidth = memory_bandwidth()
    for label, spec, q in configs:
        engine = engine_for(path, spec, args.num_threads)
        if q:
            corrupt(engine, q)
        before = engine.spec_decode_stats()
        speed = decode_speed(engine, [prompt], args.output_len, args.repeat)
        accept, per_step = rate(engine, before) if spec else (0.0, 1.0)
        parts = step_bytes(engine.runner, args.input_len + args.output_len // 2)
        roofline = bandwidth / sum(parts.values())
        off = off or speed
        rows.append([label, f"{100 * accept:.0f}%" if spec else "-", per_step, speed, f"{speed / off:.2f}x",
                     f"{per_step * roofline:.1f}", f"{100 * speed / (per_step * roofline):.0f}%"])
        weights = parts["weights"]
        del engine
        gc.collect()
    print(f"\n{name}: {path}; prompt {args.input_len} tokens, output {args.output_len}, batch 1, greedy, median of "
          f"{args.repeat}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; a step reads {weights / 1e9:.3f} GB of weights")
    print_table(f"speculative decoding, {name}", ["drafts", "acceptance", "tokens/step", "decode tok/s", "vs off",
                                                  "bytes bound tok/s", "of bound"], rows)
    if args.batches:
        sweep(path, prompt, args)


def sweep(path: str, prompt: list[int], args) -> None:
    """Aggregate decode tok/s at each batch size: off, and k = 3 at 100% forced on; then batch 32 with the default
    ``disable_by_batch_size``."""
    rows = []
    forced = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1024}
    engines = {"off": engine_for(path, None, args.num_threads), "on": engine_for(path, forced, args.num_threads)}
    for b in args.batches:
        prompts = [random_prompt(args.input_len // 4, seed=s) for s in range(b)]
        off, on = (decode_speed(engines[x], prompts, args.output_len // 2, 1) for x in ("off", "on"))
        rows.append([b, off, on, f"{on / off:.2f}x"])
    del engines
    gc.collect()
    default = {"method": "ngram", "num_speculative_tokens": 3}
    big = max(args.batches)
    prompts = [random_prompt(args.input_len // 4, seed=s) for s in range(big)]
    auto, off = (decode_speed(engine_for(path, spec, args.num_threads), prompts, args.output_len // 2, 1)
                 for spec in (default, None))
    rows.append([f"{big}, default (off above {DEFAULT_SPEC_DISABLE_BATCH})", off, auto, f"{auto / off:.2f}x"])
    print_table("batch sweep, k = 3 at 100% (aggregate decode tok/s)", ["batch", "off", "on", "on / off"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    print(f"machine: {machine()}; CPU kernels: {cpu.isa() if cpu.available() else 'off'}")
    for name in args.models:
        bench_model(name, args)


if __name__ == "__main__":
    main()
