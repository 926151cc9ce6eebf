"""The hybrid prefix cache (KV pages + recurrent-state snapshots) on vs off, in one run, on a random hybrid of
the Qwen3.5-0.8B shape cut to a few layers (three Gated DeltaNet layers in four, the real widths and vocabulary).

  shared -- a 1,000-token system prompt plus a short unique question per request, sent one after another:
            TTFT of a miss (cache off; and the first two requests with it on: the first leaves a snapshot at
            its own prompt's end, the second one where it parts from the first) vs a hit (the later ones).
  chat   -- one conversation, each turn resending the whole history plus a new user message: TTFT of the
            later turns (they resume where the previous reply ended).
  conversations -- each round, two conversations sharing a fresh 2,000-token system prompt, chat-formatted
            (``<|im_start|>system ... <|im_end|>\n<|im_start|>user ...``): TTFT of the second conversation's first
            request, the first to share the system prompt, against a cold miss (cache off). It resumes from the
            snapshot the first conversation took at its system prompt's end (a turn end's page boundary).
            Random token ids have no turn ends: the shared workload's second request still misses.

    python benchmarks/hybrid_prefix_cache.py [--layers 8] [--system 1000] [--conv-system 2000] [--dtype float32]
        [--workloads shared,chat,conversations]
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import hybrid_checkpoint, machine, percentile, print_table, random_prompt, run_batch, ttft

from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.sampling_params import SamplingParams



def shared(engines, args) -> dict:
    """Request i goes to the cache-off engine, then to the cache-on one (interleaved: a busy machine's noise
    falls on both alike)."""
    system, outs = random_prompt(args.system, 1), {label: [] for label in engines}
    params = SamplingParams(temperature=0, max_tokens=args.out, ignore_eos=True)
    for i in range(args.requests):
        for label, engine in engines.items():
            outs[label].append(run_batch(engine, [system + random_prompt(args.question, 100 + i)], params)[0][0])
    return outs


def chat(engines, args) -> dict:
    histories = {label: random_prompt(args.system, 2) for label in engines}
    outs = {label: [] for label in engines}
    params = SamplingParams(temperature=0, max_tokens=args.answer, ignore_eos=True)
    for turn in range(args.turns):
        for label, engine in engines.items():
            (out,), _ = run_batch(engine, [histories[label] + random_prompt(args.user, 300 + turn)], params)
            outs[label].append(out)
            histories[label] = list(out.prompt_token_ids) + out.outputs[0].token_ids
    return outs


def conversations(engines, args) -> dict:
    """Round r: conversation 1 then 2, each sent to the cache-off engine then the cache-on one; both share round
    r's system prompt (a new one each round: every round's first conversation misses)."""
    tokenizer = next(iter(engines.values())).tokenizer
    header = {role: tokenizer.encode(f"<|im_start|>{role}\n", add_special_tokens=False)
              for role in ("system", "user", "assistant")}
    turn_end = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    outs = {label: [] for label in engines}
    params = SamplingParams(temperature=0, max_tokens=args.out, ignore_eos=True)
    for r in range(args.rounds):
        system = header["system"] + random_prompt(args.conv_system, 500 + r) + turn_end
        for c in range(2):
            prompt = system + header["user"] + random_prompt(args.question, 600 + 2 * r + c) + turn_end \
                + header["assistant"]
            for label, engine in engines.items():
                outs[label].append(run_batch(engine, [prompt], params)[0][0])
    return outs


WORKLOADS = {"shared": shared, "chat": chat, "conversations": conversations}
# the requests each workload's summary compares (hits with the cache on: misses off)
COMPARED = {"shared": (slice(2, None), "requests 3+"), "chat": (slice(1, None), "turns 2+"),
            "conversations": (slice(1, None, 2), "each round's second conversation")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                   help="float32 by default: the hybrids run on torch's CPU path, where bf16 is slow without AMX")
    p.add_argument("--system", type=int, default=1000, help="shared system prompt tokens")
    p.add_argument("--question", type=int, default=32, help="unique tokens per shared-prompt request")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--out", type=int, default=4, help="output tokens per shared-prompt request")
    p.add_argument("--user", type=int, default=100, help="tokens per user message (chat)")
    p.add_argument("--answer", type=int, default=24, help="tokens per answer (chat)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--conv-system", type=int, default=2000,
                   help="system prompt tokens the two conversations of a round share (conversations)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of two conversations (conversations)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="which to run, comma-separated")
    args = p.parse_args()

    dtype = getattr(torch, args.dtype)
    path = hybrid_checkpoint("Qwen3.5-0.8B", args.layers, dtype)
    engines = {label: LLMEngine(EngineConfig(model=path, dtype=args.dtype, max_model_len=4096,
                                             kv_cache_memory=1 << 30, enable_prefix_caching=on))
               for label, on in (("off", False), ("on", True))}
    results = {}
    names = args.workloads.split(",")
    for name in names:
        for label, outs in WORKLOADS[name](engines, args).items():
            results[name, label] = outs
        print(f"  {name}: done", file=sys.stderr, flush=True)

    print(f"\nMILI hybrid prefix cache, Qwen3.5-0.8B shape cut to {args.layers} layers, random weights, {args.dtype}, "
          f"{machine()}")
    print(f"shared: {args.requests} requests in turn, {args.system}-token system prompt + {args.question} unique "
          f"tokens, {args.out} output tokens; chat: {args.turns} turns, system {args.system}, user {args.user}, "
          f"answers {args.answer} tokens; conversations: {args.rounds} rounds of 2, system {args.conv_system}, "
          f"question {args.question} (greedy, ignore_eos)")
    rows = []
    for (name, label), outs in results.items():
        for i, out in enumerate(outs):
            rows.append([name, label, i + 1, len(out.prompt_token_ids), out.num_cached_tokens, ttft(out)])
    print_table("TTFT per request (seconds)", ["workload", "cache", "request", "prompt", "cached", "TTFT"], rows,
                digits=3)
    for name in names:
        # p50, and the best of each (on a machine shared with other work, the least disturbed request)
        which, what = COMPARED[name]
        miss = [ttft(o) for o in results[name, "off"][which]]
        hit = [ttft(o) for o in results[name, "on"][which]]
        agree = [a == b for x, y in zip(results[name, "off"], results[name, "on"])
                 for a, b in zip(x.outputs[0].token_ids, y.outputs[0].token_ids)]
        if name == "conversations":  # each round's pair: its hit over the same request's cold miss
            print("conversations, hit / cold miss per round: "
                  + ", ".join(f"{h / m:.3f}" for h, m in zip(hit, miss)))
        print(f"{name}, {what}: TTFT p50 hit {percentile(hit, 50):.3f} s / miss "
              f"{percentile(miss, 50):.3f} s = {percentile(hit, 50) / percentile(miss, 50):.3f}; best hit "
              f"{min(hit):.3f} s / best miss {min(miss):.3f} s = {min(hit) / min(miss):.3f} (target <= 0.2); "
              f"output tokens equal on/off: {100 * sum(agree) / len(agree):.1f}%")


if __name__ == "__main__":
    main()
