"""What a JSON schema costs: the same concurrent requests with and without structured outputs, in one process.

    python benchmarks/structured_outputs.py                 # a random Qwen3-0.6B shape (bf16), 32 requests
    python benchmarks/structured_outputs.py --model tiny    # a tiny model on the real vocabulary (worst case)

Every request is sampled (temperature 1, unseeded) from random weights, with ``--output-len`` tokens at
most. The "notes" schema (an object holding an array of unbounded strings) keeps a random model
writing until the limit, so its run makes as many tokens as the unconstrained one; the "record" schema
(enums, bounded integers and strings, nested) ends each output when its object is complete. Grammars
are compiled once before the timed runs (the cold compile is reported on its own).
"""

from __future__ import annotations

import argparse
import time

from common import CACHE, machine, print_table, qwen3_checkpoint, random_prompt

from mili import LLM, SamplingParams, StructuredOutputsParams

NOTES = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
         "required": ["notes"]}
RECORD = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}},
                  "required": ["x"]},
    },
    "required": ["color", "count", "ok", "name", "tags", "inner"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="0.6B", help="0.6B, tiny, or a checkpoint path")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="timed runs per workload (the best is kept)")
    args = p.parse_args()
    model = {"0.6B": qwen3_checkpoint, "tiny": _tiny}.get(args.model, lambda: args.model)()
    llm = LLM(model, max_num_seqs=args.num_prompts, max_model_len=args.input_len + args.output_len + 8)
    prompts = [{"prompt_token_ids": random_prompt(args.input_len, seed)} for seed in range(args.num_prompts)]
    workloads = {"none": None, "json schema: notes": StructuredOutputsParams(json=NOTES),
                 "json schema: record": StructuredOutputsParams(json=RECORD)}

    compile_s = {}
    for name, so in workloads.items():  # warm up; the first constrained request compiles its grammar
        start = time.perf_counter()
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, structured_outputs=so), use_tqdm=False)
        compile_s[name] = time.perf_counter() - start

    results = {}
    for name, so in workloads.items():
        params = SamplingParams(temperature=1.0, max_tokens=args.output_len, structured_outputs=so,
                                ignore_eos=so is None)
        best = None
        for _ in range(args.repeat):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if best is None or tokens / seconds > best[0] / best[1]:
                best = (tokens, seconds, sum(o.outputs[0].finish_reason == "stop" for o in outs))
        results[name] = best

    base = results["none"][0] / results["none"][1]
    rows = [[name, str(tokens), str(stopped), f"{seconds:.2f}", f"{tokens / seconds:,.0f}",
             f"{tokens / seconds / base:.2f}x", f"{compile_s[name] * 1e3:.0f}"]
            for name, (tokens, seconds, stopped) in results.items()]
    print_table(f"{args.num_prompts} concurrent requests, {args.input_len} in / <= {args.output_len} out, "
                f"temperature 1; {model}; {machine()}", ["constraint", "tokens", "ended by grammar", "seconds", "tok/s", "vs none",
                 "first request ms (cold compile)"], rows)


def _tiny() -> str:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from common import DATA

    path = CACHE / "tiny-realvocab"
    if not (path / "model.safetensors").is_file():
        config = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                             max_position_embeddings=1024, eos_token_id=151645)
        Qwen3ForCausalLM(config).save_pretrained(path)
        AutoTokenizer.from_pretrained(DATA / "qwen3-tokenizer").save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    main()
