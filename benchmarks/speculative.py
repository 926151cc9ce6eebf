"""Speculative decoding on the CPU: batch-1 decode tokens/s with speculation off and on, in the same run, for a
0.6B-shaped Qwen3 and a Qwen3.5-0.8B-shaped hybrid (random weights, bf16, MILI's CPU kernels).

Each model is *scripted*: its residual branches (o_proj, down_proj, the linear attention's out_proj) are zeroed,
so its greedy next token is the current one (tied embeddings: a token's own row scores highest) and it repeats
its last prompt token; it reads every weight a real model reads. On it:

  off                    plain decoding
  ngram k=2, k=3         n-gram prompt lookup: after the first steps every draft is right (100%)
  ngram k=2, k=3 ~70%    the same drafts, each token replaced by a wrong one with probability q, chosen so that the
                         expected acceptance is 70%: the measured rate is printed
  mtp k=1, 2, 3          (the hybrid) its MTP head, scripted alike (fc passes the token's embedding through, the
                         layer's branches zeroed: it drafts the current token), at 100%; k=3 ~70% as above;
                         k=2 "all wrong": every draft replaced, what a useless head costs

For each row: the acceptance rate, tokens a step emits, decode tok/s, the speed-up over off, and the bound the
bytes allow (a verifying step reads the weights once, as a plain step does, for 1 + accepted tokens: the
plain step's copy roofline times that). Then a batch sweep at 100% (k = 3, speculation forced on at every
batch size) against off: the batch size where speculation stops paying is what ``disable_by_batch_size``
defaults to (mili/config.py), and the last row checks batch 32 with the default is not slower than off.

Then, with ``--demo``, the *real* acceptance of the trained ``demo-hybrid``'s jointly trained MTP head (and
of n-gram) on chat prompts, greedy: the rate a trained head reaches, and what it buys on a 13M model.

    python benchmarks/speculative.py [--models 0.6B 0.8B] [--input-len 128] [--output-len 128] [--repeat 2]
                                     [--batches 1 4 8 16 32] [--demo]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics

import torch
from safetensors.torch import load_file, save_file

from common import hybrid_checkpoint, machine, print_table, qwen3_checkpoint, random_prompt, run_batch

from mili.tools.bench import memory_bandwidth, step_bytes
from mili.config import DEFAULT_SPEC_DISABLE_BATCH, EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.kernels import cpu
from mili.sampling_params import SamplingParams

MODELS = {"0.6B": lambda: qwen3_checkpoint("Qwen3-0.6B"), "0.8B": lambda: hybrid_checkpoint("Qwen3.5-0.8B", None,
                                                                                             torch.bfloat16)}
HYBRIDS = ("0.8B",)
ZEROED = ("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")


def scripted(path: str) -> str:
    """A copy of the checkpoint with its residual branches zeroed (built once, beside it); a hybrid gains a
    scripted MTP head."""
    config = json.loads(open(path + "/config.json").read())
    hybrid = "linear_attention" in config.get("layer_types", ())
    out = path + ("-scripted-mtp" if hybrid else "-scripted")
    if shutil.os.path.isfile(out + "/model.safetensors"):
        return out
    shutil.copytree(path, out + ".tmp", ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    tensors = load_file(path + "/model.safetensors")
    for name, t in tensors.items():
        if name.endswith(ZEROED):
            t.zero_()
    if hybrid:
        tensors.update(scripted_mtp_head(config, tensors["model.embed_tokens.weight"].dtype))
    save_file(tensors, out + ".tmp/model.safetensors", metadata={"format": "pt"})
    shutil.os.replace(out + ".tmp", out)
    return out


def scripted_mtp_head(config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The hub's ``mtp.*`` tensors (one dense gated-attention layer) at this shape: q/k/v random, so the head
    reads and attends as a real one; fc = [I, 0] passes the token's normed embedding through, o_proj and
    down_proj are zero and the zero-centred norms scale by 1, so mtp.norm gives the token's embedding direction
    and the tied lm_head drafts the token itself, as the scripted trunk predicts."""
    h, d, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    g = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj.weight": (2 * nq * d, h), "self_attn.k_proj.weight": (nkv * d, h),
              "self_attn.v_proj.weight": (nkv * d, h), "self_attn.o_proj.weight": (h, nq * d),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    head = {f"mtp.layers.0.{k}": torch.randn(s, generator=g) / s[1] ** 0.5 for k, s in shapes.items()}
    for k in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        head[f"mtp.layers.0.{k}"].zero_()
    for k in ("mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.layers.0.input_layernorm",
              "mtp.layers.0.post_attention_layernorm"):
        head[k + ".weight"] = torch.zeros(h)
    for k in ("q_norm", "k_norm"):
        head[f"mtp.layers.0.self_attn.{k}.weight"] = torch.zeros(d)
    head["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    return {k: v.to(dtype) for k, v in head.items()}


def mtp_draft_bytes(model) -> int:
    """Bytes an MTP draft pass reads: the head's layer and the shared lm_head (0 without a head). A verifying
    step makes k of them, besides the pass that writes the step's pairs (counted once in the weights)."""
    if getattr(model, "mtp", None) is None:
        return 0
    def matrices(modules) -> int:
        return sum(t.numel() * t.element_size() for module in modules
                   for t in (getattr(module, a, None) for a in ("weight", "qweight", "packed", "scales"))
                   if isinstance(t, torch.Tensor) and t.dim() >= 2)

    head = matrices([model.lm_head] if model.lm_head is not None else [model.model.embed_tokens])
    return matrices(model.mtp.modules()) + head


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
    rng, vocab = random.Random(2026), engine.model_config.vocab_size
    if engine.core.runner.parts.mtp is not None:  # the head's drafts, as the runner computes them
        draft = engine.core.runner.parts.mtp.draft

        def spoilt(scheduled):
            draft(scheduled)
            for s in scheduled:
                s.draft[:] = [t if rng.random() >= q else (t + 1) % vocab for t in s.draft]
        engine.core.runner.parts.mtp.draft = spoilt
        return
    propose = engine.core.drafter.propose
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
        engine.reset_prefix_cache()
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
    if name in HYBRIDS:
        for k in (1, 2, 3):
            configs.append((f"mtp k={k}", {"method": "mtp", "num_speculative_tokens": k}, 0.0))
        configs.append(("mtp k=3, ~70%", {"method": "mtp", "num_speculative_tokens": 3}, q_for(3, 0.70)))
        configs.append(("mtp k=2, all wrong", {"method": "mtp", "num_speculative_tokens": 2}, 1.0))
    bandwidth = memory_bandwidth()
    for label, spec, q in configs:
        engine = engine_for(path, spec, args.num_threads)
        if q:
            corrupt(engine, q)
        before = engine.spec_decode_stats()
        speed = decode_speed(engine, [prompt], args.output_len, args.repeat)
        accept, per_step = rate(engine, before) if spec else (0.0, 1.0)
        parts = step_bytes(engine.core.runner, args.input_len + args.output_len // 2)
        roofline = bandwidth / (sum(parts.values()) + (spec or {}).get("num_speculative_tokens", 0)
                                * mtp_draft_bytes(engine.core.runner.parts.model))
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


DEMO_PROMPTS = ["Hello", "Who are you?", "Tell me a story.", "Tell me about wisdom.", "What does John 3:16 say?",
                "Finish this verse: In the beginning God", "What is the Lord's prayer?", "Who was Moses?"]


def demo(args) -> None:
    """The trained demo-hybrid, batch 1, greedy chat replies (until <|im_end|> or 200 tokens), one prompt at a
    time: the acceptance its trained MTP head reaches, against n-gram and off."""
    from transformers import AutoTokenizer

    from mili.demo import HYBRID_CHECKPOINT_DIR

    path = str(HYBRID_CHECKPOINT_DIR)
    tok = AutoTokenizer.from_pretrained(path)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=False) for p in DEMO_PROMPTS]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    params = SamplingParams(temperature=0, max_tokens=200)
    rows, off, texts = [], None, None
    for label, spec in [("off", None), ("ngram k=3", {"method": "ngram", "num_speculative_tokens": 3})] + [
            (f"mtp k={k}", {"method": "mtp", "num_speculative_tokens": k}) for k in (1, 2, 3)]:
        engine = engine_for(path, spec, args.num_threads)
        run_batch(engine, prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm up
        before, seconds, tokens, outs = engine.spec_decode_stats(), 0.0, 0, []
        for p in prompts:
            stats = []
            outs += run_batch(engine, [p], params, stats)[0]
            seconds, tokens = seconds + stats[0], tokens + stats[1]
        got = [o.outputs[0].token_ids for o in outs]
        texts = texts or got
        accept, per_step = rate(engine, before) if spec else (0.0, 1.0)
        off = off or tokens / seconds
        rows.append([label, f"{100 * accept:.0f}%" if spec else "-", per_step, tokens / seconds,
                     f"{tokens / seconds / off:.2f}x", "yes" if got == texts else "NO"])
        del engine
        gc.collect()
    print(f"\ndemo-hybrid: {path}; {len(prompts)} chat prompts one at a time, greedy, thinking off, replies to "
          f"<|im_end|> (at most 200 tokens)")
    print_table("speculative decoding on the trained demo-hybrid", ["drafts", "acceptance", "tokens/step",
                                                                   "decode tok/s", "vs off", "same tokens"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--demo", action="store_true", help="also the trained demo-hybrid's real acceptance")
    args = parser.parse_args()
    print(f"machine: {machine()}; CPU kernels: {cpu.isa() if cpu.available() else 'off'}")
    for name in args.models:
        bench_model(name, args)
    if args.demo:
        demo(args)


if __name__ == "__main__":
    main()
