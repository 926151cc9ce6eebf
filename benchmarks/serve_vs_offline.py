"""The server against the offline engine on the same requests, in one run: does serving cost throughput?

    python benchmarks/serve_vs_offline.py                       # demo-random, 256 x (128 in, 128 out)
    python benchmarks/serve_vs_offline.py --model 0.6B --num-prompts 32

Offline: ``LLM.generate`` on every request at once. Served: ``mili serve`` (the engine core in its own
process) with the same engine settings, and ``mili bench serve``'s load generator sending the same
token-id prompts all at once, streamed. Both greedy with ignore_eos, so both produce exactly
``num_prompts x output_len`` tokens. The two run one after the other (never competing for the cores).
The served run prints each process's CPU per streamed token (API, engine core, load generator), as
``mili bench serve`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx

from common import machine, print_table, qwen3_checkpoint

from mili import LLM, SamplingParams
from mili.tools.bench import measure_serve_load, print_serve_result, run_serve_load, serve_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo-random",
                   help="demo-random (the tiny random demo: the HTTP path is the bottleneck), demo, 0.6B (a random "
                        "Qwen3-0.6B shape), or a checkpoint")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    args = p.parse_args()
    model = qwen3_checkpoint() if args.model == "0.6B" else args.model
    engine_flags = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "kv_cache_memory": args.kv_cache_memory,
                    "max_model_len": args.input_len + args.output_len + 16}

    llm = LLM(model, **engine_flags)
    vocab = llm.engine.model_config.vocab_size
    prompts, out_lens = serve_dataset(args.num_prompts, args.input_len, args.output_len, vocab, seed=0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": q} for q in prompts[:4]], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    offline_s = time.perf_counter() - start
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs

    cmd = [sys.executable, "-m", "mili.cli", "serve", model, "--port", str(args.port), "--log-level", "warning",
           *[x for k, v in engine_flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    server = subprocess.Popen(cmd, env={**os.environ, "MILI_NO_PROGRESS": "1"})
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run_serve_load(url, name, prompts[:4], out_lens[:4]))  # warm-up
        served = measure_serve_load(httpx.get(url + "/health").json(), url, name, prompts, out_lens)
    finally:
        server.terminate()
        server.wait(60)

    print(f"serve_vs_offline: model {model}; {args.num_prompts} requests x ({args.input_len} in, "
          f"{args.output_len} out), greedy, ignore_eos, all at once; engine {engine_flags}; {machine()}")
    offline_rate = offline_tokens / offline_s
    print_table("output throughput", ["path", "seconds", "output tokens", "output tok/s", "/ offline"], [
        ["offline LLM.generate", offline_s, offline_tokens, offline_rate, 1.0],
        ["mili serve, streamed", served["duration_s"], served["output_tokens"], served["output_throughput"],
         served["output_throughput"] / offline_rate]])
    print_serve_result(served)


if __name__ == "__main__":
    main()
