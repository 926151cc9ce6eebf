"""What int8 quantization costs in accuracy against bf16, on the same checkpoint and prompts: MILI's
kernel (int8 weights and per-row int8 activations, on AVX-512 VNNI or AMX) and aten's weight-only int8 (``--no-cpu-kernels``).

Prints the logit error of the first generated position (max and mean |int8 - bf16| over max |bf16|,
and the share of prompts whose argmax agrees) and the greedy agreement of whole continuations (the
share of tokens equal before the paths first part, and the mean length of the common prefix).

    python benchmarks/quant_accuracy.py [--prompts 8] [--tokens 32]
"""

from __future__ import annotations

import argparse

import torch
from common import machine, print_table, qwen3_checkpoint, random_prompt

from mili import LLM, SamplingParams
from mili.kernels import cpu


def first_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The logits the model gives for the token after ``prompt`` (through the real engine path)."""
    engine = llm.engine
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    sched = engine.core.scheduler.schedule()
    logits, *_ = engine.core.runner.forward_logits(sched.scheduled)
    engine.core.scheduler.after_step(sched.scheduled)
    engine.abort_request(request.request_id)
    return logits[0].float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    path = qwen3_checkpoint(args.model)
    common_args = dict(dtype="bfloat16", max_model_len=2048, kv_cache_memory=1 << 30, enable_prefix_caching=False)
    engines = {"bf16": LLM(path, **common_args),
               # MILI's kernel: int8 weights and int8 activations (one scale per row, per step)
               "int8": LLM(path, quantization="int8", **common_args),
               # aten's weight-only kernel (activations stay bf16): what --no-cpu-kernels runs
               "int8 weight-only": LLM(path, quantization="int8", cpu_kernels=False, **common_args)}
    prompts = [random_prompt(args.prompt_len, 500 + i) for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = {k: [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)] for k, llm in engines.items()}
    columns = []
    for name in ("int8", "int8 weight-only"):
        errors, agree_argmax = [], 0
        for prompt in prompts:
            ref, q = first_logits(engines["bf16"], prompt), first_logits(engines[name], prompt)
            errors.append(((q - ref).abs() / ref.abs().max()))
            agree_argmax += int(q.argmax() == ref.argmax())
        pairs = list(zip(outs["bf16"], outs[name]))
        common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in pairs]
        equal = sum(a == b for x, y in pairs for a, b in zip(x, y)) / (args.tokens * len(prompts))
        columns.append([max(e.max().item() for e in errors), sum(e.mean().item() for e in errors) / len(errors),
                        f"{agree_argmax}/{len(prompts)}", f"{100 * equal:.1f}%", sum(common) / len(common)])
    print(f"int8 vs bf16: {args.model}-shaped random weights, {args.prompts} prompts of {args.prompt_len} "
          f"tokens, {args.tokens} greedy tokens; {machine()}; MILI's int8 kernel on {cpu.isa() or 'none'}")
    measures = ["max |logit error| / max |logit|", "mean |logit error| / max |logit|",
                "first-token argmax agreement", "tokens equal position by position", "mean common prefix (tokens)"]
    print_table("accuracy against bf16", ["measure", "int8 (MILI kernel, W8A8)", "int8 weight-only (aten)"],
                [[m, a, b] for m, a, b in zip(measures, *columns)], digits=3)

if __name__ == "__main__":
    main()
