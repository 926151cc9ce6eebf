"""`mili bench`: latency, throughput and serve benchmarks, each printing a table and its configuration,
with HF transformers `generate` on the same checkpoint and requests in the same run (``--baseline hf``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time

import torch

from mili.kernels.cpu.ops import Int8Pages


# -- helpers -------------------------------------------------------------------------------------
def print_table(title: str, header: list[str], rows: list[list], digits: int = 2) -> None:
    cells = [[str(h) for h in header]] + [[f"{c:.{digits}f}" if isinstance(c, float) else str(c) for c in r]
                                          for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for k, r in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if k == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_batch(engine, prompts: list[list[int]], params, decode_stats: list | None = None,
              loras: list | None = None) -> tuple[list, float]:
    """Add every prompt (``params``: one SamplingParams or one per prompt; ``loras``: a LoRARequest or None per
    prompt), step until all finish; returns (the final outputs in order, seconds). With ``decode_stats`` (a list),
    appends [seconds, tokens] of the decode-only steps (every running sequence computing just its next token), the
    figure llama.cpp's batched-bench reports as its generation speed."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    loras = loras or [None] * len(prompts)
    start = time.perf_counter()
    ids = [engine.add_request(p, sp, lora_request=lora).request_id for p, sp, lora in zip(prompts, params, loras)]
    done = {}
    decode_seconds = decode_tokens = 0
    while len(done) < len(ids):
        sched = engine.core.scheduler
        # (every running sequence past its prompt: a step may still recompute a few tokens, as a hybrid whose
        # draft was rejected does)
        decode_only = not sched.waiting and all(s.num_computed_tokens >= s.prompt_len - 1 for s in sched.running)
        t = time.perf_counter()
        generated = engine.core.num_generated_tokens
        outs = engine.step()
        if decode_only:
            decode_seconds += time.perf_counter() - t
            decode_tokens += engine.core.num_generated_tokens - generated  # (speculation: several a sequence)
        for out in outs:
            if out.finished:
                done[out.request_id] = out
    if decode_stats is not None:
        decode_stats += [decode_seconds, decode_tokens]
    return [done[i] for i in ids], time.perf_counter() - start


def _prompts(n: int, lo: int, hi: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, min(vocab, 151643), (k,), generator=g).tolist() for k in lens]


def _lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed + 1)).tolist()


def memory_bandwidth(mib: int = 1024) -> float:
    """Bytes moved per second by a large copy (read + write), as STREAM counts it."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, n = time.perf_counter(), 5
    for _ in range(n):
        dst.copy_(src)
    return 2 * src.numel() * 4 * n / (time.perf_counter() - start)


def weight_bytes_per_step(model) -> int:
    """Bytes a decode step reads: every matrix of the linear layers and the lm_head (not the
    embedding table, of which a step reads one row)."""
    total = 0
    for name, module in model.named_modules():
        if name == "model.embed_tokens":
            continue
        for attr in ("weight", "qweight", "packed", "scales", "offsets", "zeros", "weight_scale"):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                total += t.numel() * t.element_size()
    if model.lm_head is None:
        total += model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return total


def step_bytes(runner, context: int) -> dict[str, int]:
    """What one batch-1 decode step at ``context`` tokens reads and writes: the weights (read), the KV of the
    full-attention layers (read: K and V of every earlier token), and a hybrid's recurrent state (each linear
    layer's conv and SSM state read and written back)."""
    parts = runner.parts
    cfg = parts.model_config
    row = (Int8Pages.row_bytes(cfg.head_dim) if parts.plan.kv_dtype == torch.int8  # (int8 pages: D bytes and a scale)
           else cfg.head_dim * parts.plan.kv_dtype.itemsize)
    kv = 2 * cfg.num_attention_layers * context * cfg.num_key_value_heads * row
    state = 2 * parts.states.bytes_per_slot if parts.states is not None else 0
    return {"weights": weight_bytes_per_step(parts.model), "kv": kv, "state": state}


# the engine options `mili bench` takes (their flags made from EngineConfig's fields, as `mili serve`'s are), and the
# defaults it runs at where they are not the engine's
ENGINE_OPTIONS = ("model", "dtype", "max_model_len", "kv_cache_memory", "max_num_seqs", "seed", "num_threads",
                  "quantization", "lm_head_dtype", "cpu_kernels", "cpu_isa", "speculative_config")
ENGINE_DEFAULTS = {"max_model_len": 4096, "kv_cache_memory": 2 << 30}


def _engine(args):
    from mili import options
    from mili.config import EngineConfig
    from mili.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**options.values_from(args, EngineConfig, ENGINE_OPTIONS)))


def spec_summary(engine) -> str | None:
    """Speculative decoding's line for a table: drafts, acceptance rate, tokens a verifying step emits."""
    stats = engine.spec_decode_stats()
    if engine.config.speculative_config is None:
        return None
    drafts, drafted, accepted = stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]
    if not drafts:
        return "speculative decoding: no drafts were proposed"
    per_pos = ", ".join(f"{n / drafts:.0%}" for n in stats["accepted_per_pos"])
    return (f"speculative decoding ({engine.config.speculative_config.method}): {drafts} drafts of {drafted} tokens, "
            f"acceptance rate {accepted / drafted:.1%} (by position: {per_pos}), {1 + accepted / drafts:.2f} "
            f"tokens a verifying step")


def _run(engine, prompts, out_lens, decode_stats: list | None = None) -> tuple[list, float]:
    from mili.sampling_params import SamplingParams

    return run_batch(engine, prompts, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
                                       for o in out_lens], decode_stats)


def _hf_model(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=engine.core.runner.parts.dtype).to(
        engine.core.runner.parts.device).eval()


@torch.inference_mode()
def _hf_generate(model, batch: list[list[int]], new_tokens: int) -> float:
    """Seconds for HF generate (greedy, exactly new_tokens each), left-padding a batch."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _header(args, engine) -> None:
    print(f"mili bench {args.mode}: model {engine.model_path}, dtype {str(engine.core.runner.parts.dtype)[6:]}, "
          f"quantization {args.quantization or 'none'}, device {engine.core.runner.parts.device}, "
          f"CPU kernels {'on (' + engine.plan.device.cpu_kernels + ')' if engine.plan.cpu_kernels else 'off'}, "
          f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")


# -- modes ---------------------------------------------------------------------------------------
def _measure_latency(engine, prompt: list[int], args) -> tuple[float, float, float]:
    """Median TTFT (s), decode tok/s (the tokens after the first over the time of their steps) and copy
    bandwidth (B/s, measured before each repeat, so that the roofline follows the machine through the
    run) over ``args.repeat`` runs of one request."""
    _run(engine, [prompt[:16]], [4])  # warm up
    ttfts, decodes, bandwidths = [], [], []
    for _ in range(args.repeat):
        bandwidths.append(memory_bandwidth())
        (first,), t_first = _run(engine, [prompt], [1])
        engine.reset_prefix_cache()  # every repeat is a miss
        decode = []  # [seconds, tokens] of the steps after the first token
        _run(engine, [prompt], [args.output_len], decode)
        engine.reset_prefix_cache()
        ttfts.append(t_first)
        decodes.append(decode[1] / decode[0] if decode[1] else 0.0)  # (--output-len 1: no decode step)
    return statistics.median(ttfts), statistics.median(decodes), statistics.median(bandwidths)


def latency(args) -> None:
    engine = _engine(args)
    vocab = engine.model_config.vocab_size
    prompt = _prompts(1, args.input_len, args.input_len, args.seed, vocab)[0]
    ttft, decode, bandwidth = _measure_latency(engine, prompt, args)
    parts = step_bytes(engine.core.runner, args.input_len + args.output_len // 2)  # (the decode's middle step)
    step = sum(parts.values())
    roofline = bandwidth / step
    rows = [["mili" + (f" ({args.quantization})" if args.quantization else ""), ttft, args.input_len / ttft, decode,
             f"{100 * decode / roofline:.0f}%"]]
    base_decode = None
    if args.baseline == "bf16":  # the same engine unquantized, in the same run
        base = _engine(argparse.Namespace(**{**vars(args), "quantization": None}))
        b_ttft, base_decode, b_bandwidth = _measure_latency(base, prompt, args)
        b_roofline = b_bandwidth / sum(step_bytes(base.core.runner, args.input_len + args.output_len // 2).values())
        rows.append(["mili (bf16)", b_ttft, args.input_len / b_ttft, base_decode,
                     f"{100 * base_decode / b_roofline:.0f}% of its {b_roofline:.1f}"])
        del base
    if args.baseline == "hf":
        model = _hf_model(engine)
        _hf_generate(model, [prompt[:16]], 2)
        t_first = _hf_generate(model, [prompt], 1)
        t_all = _hf_generate(model, [prompt], args.output_len)
        base_decode = (args.output_len - 1) / (t_all - t_first)
        rows.append(["HF transformers", t_first, args.input_len / t_first, base_decode,
                     f"{100 * base_decode / roofline:.0f}%"])
    _header(args, engine)
    print(f"prompt {args.input_len} tokens, output {args.output_len} tokens, batch 1, greedy; median of "
          f"{args.repeat}; memory bandwidth (1 GiB copy, read+write, median of one before each run) "
          f"{bandwidth / 1e9:.1f} GB/s; bytes a decode step moves {step / 1e9:.3f} GB ("
          + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in parts.items() if v) + f"); roofline {roofline:.1f} tok/s")
    print_table("latency", ["engine", "TTFT s", "prefill tok/s", "decode tok/s", "of roofline"], rows)
    if spec_summary(engine):
        print(spec_summary(engine))
    if base_decode is not None:
        print(f"mili / {rows[1][0]}: decode {decode / base_decode:.2f}x, TTFT {rows[1][1] / ttft:.2f}x faster")


def throughput(args) -> None:
    engine = _engine(args)
    vocab = engine.model_config.vocab_size
    prompts = _prompts(args.num_requests, args.min_input, args.max_input, args.seed, vocab)
    out_lens = _lengths(args.num_requests, args.min_output, args.max_output, args.seed)
    _run(engine, [prompts[0][:16]], [4])
    decode_stats = []
    outs, seconds = _run(engine, prompts, out_lens, decode_stats)
    engine.reset_prefix_cache()
    n_in, n_out = sum(map(len, prompts)), sum(out_lens)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == n_out
    rows = [["mili (continuous batching)", seconds, n_out / seconds, (n_in + n_out) / seconds, "1.00x"]]
    decode_seconds, decode_tokens = decode_stats
    if args.baseline == "hf":
        model = _hf_model(engine)
        _hf_generate(model, [prompts[0][:16]], 2)
        k = min(args.hf_sequential_sample, len(prompts))
        t_seq = sum(_hf_generate(model, [p], o) for p, o in zip(prompts[:k], out_lens[:k])) * len(prompts) / k
        rows.append([f"HF one after another (first {k} timed, scaled)", t_seq, n_out / t_seq,
                     (n_in + n_out) / t_seq, f"{t_seq / seconds:.2f}x"])
        t_pad = _hf_generate(model, prompts, max(out_lens))  # useful tokens: the requested ones
        rows.append(["HF one padded batch", t_pad, n_out / t_pad, (n_in + n_out) / t_pad, f"{t_pad / seconds:.2f}x"])
    _header(args, engine)
    print(f"{args.num_requests} requests, input {args.min_input}-{args.max_input}, output {args.min_output}-"
          f"{args.max_output} tokens (uniform, seed {args.seed}), greedy, ignore_eos; {n_in} prompt + {n_out} "
          f"output tokens")
    print_table("throughput", ["engine", "seconds", "output tok/s", "total tok/s", "mili speed-up"], rows)
    if spec_summary(engine):
        print(spec_summary(engine))
    if decode_seconds:
        print(f"mili decode-only steps: {decode_tokens} tokens in {decode_seconds:.2f} s = "
              f"{decode_tokens / decode_seconds:.1f} tok/s of decode in aggregate (llama-batched-bench's S_TG)")


def processes_cpu_seconds(pids: list) -> float | None:
    """The sum of ``process_cpu_seconds`` over ``pids`` (None if any is not here)."""
    seconds = [process_cpu_seconds(pid) for pid in pids]
    return None if not seconds or None in seconds else sum(seconds)


def process_cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds of process ``pid``'s live threads (the nanosecond run times in /proc/PID/task/*/schedstat),
    or None where there is no such process here (a server on another machine) or no /proc."""
    try:
        tasks = os.listdir(f"/proc/{int(pid)}/task")
    except (OSError, TypeError, ValueError):
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/{int(pid)}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # (a thread that ended meanwhile)
            continue
        except OSError:
            return None
    return total / 1e9


def serve_dataset(num_prompts: int, input_len: int, output_len: int, vocab: int, seed: int):
    """A random dataset with fixed lengths (vllm bench serve's 'random'): token-id prompts, so every
    prompt is exactly ``input_len`` tokens whatever the tokenizer; ids below Qwen3's special tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, min(vocab, 151643), (num_prompts, input_len), generator=g).tolist()
    return prompts, [output_len] * num_prompts


async def run_serve_load(url: str, model: str, prompts: list[list[int]], out_lens: list[int],
                         request_rate: float = float("inf"), max_concurrency: int | None = None,
                         seed: int = 0) -> dict:
    """Send the requests (streamed /v1/completions, ignore_eos) with Poisson arrivals at ``request_rate``
    (inf: all at once), at most ``max_concurrency`` in flight; per-request timings and the totals."""
    import random

    import httpx

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        if request_rate != float("inf"):
            t += rng.expovariate(request_rate)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(client, prompt, n, arrival, origin):
        await asyncio.sleep(max(0.0, origin + arrival - time.perf_counter()))
        if sem is not None:
            await sem.acquire()
        try:
            start, stamps, tokens = time.perf_counter(), [], n
            body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return {"ok": False, "error": (await r.aread()).decode()[:200]}
                buffer = b""
                async for data in r.aiter_bytes():  # SSE lines end at \n alone (not at splitlines' breaks)
                    buffer += data
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            stamps.append(time.perf_counter())
                        elif chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
            return {"ok": bool(stamps), "start": start, "stamps": stamps, "tokens": tokens}
        finally:
            if sem is not None:
                sem.release()

    limits = httpx.Limits(max_connections=max(max_concurrency or len(prompts), 1))
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        cpu0, origin = time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(one(client, p, n, a, origin) for p, n, a in zip(prompts, out_lens, arrivals)))
        seconds, client_cpu = time.perf_counter() - origin, time.process_time() - cpu0
    ok = [r for r in results if r["ok"]]
    ttft = [r["stamps"][0] - r["start"] for r in ok]
    e2e = [r["stamps"][-1] - r["start"] for r in ok]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    out_tokens = sum(r["tokens"] for r in ok)

    def summary(values):
        return {"mean_ms": 1e3 * statistics.fmean(values), "median_ms": 1e3 * percentile(values, 50),
                "p99_ms": 1e3 * percentile(values, 99)} if values else None

    return {"num_prompts": len(prompts), "completed": len(ok), "failed": len(results) - len(ok),
            "errors": [r["error"] for r in results if not r["ok"] and "error" in r][:3],
            "duration_s": seconds, "request_throughput": len(ok) / seconds, "output_throughput": out_tokens / seconds,
            "total_token_throughput": (out_tokens + sum(len(p) for p, r in zip(prompts, results) if r["ok"])) / seconds,
            "output_tokens": out_tokens, "ttft": summary(ttft), "tpot": summary(tpot), "itl": summary(itl),
            "e2e": summary(e2e), "client_cpu_s": client_cpu, "client_cpu_share": client_cpu / seconds,
            "request_rate": request_rate, "max_concurrency": max_concurrency}


def print_serve_result(result: dict) -> None:
    rows = [[name, m["mean_ms"], m["median_ms"], m["p99_ms"]] for name in ("ttft", "tpot", "itl", "e2e")
            if (m := result[name]) is not None]
    print_table("latency (ms)", ["metric", "mean", "median", "p99"], rows)
    print(f"requests: {result['completed']} completed, {result['failed']} failed in {result['duration_s']:.2f} s: "
          f"{result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} output tok/s, "
          f"{result['total_token_throughput']:.1f} total tok/s")
    print(f"client: {result['client_cpu_s']:.2f} s of CPU over {result['duration_s']:.2f} s "
          f"({100 * result['client_cpu_share']:.0f}% of one core: the load generator is "
          f"{'NOT ' if result['client_cpu_share'] < 0.5 else 'possibly '}the bottleneck)")
    if "cpu_us_per_token" in result:
        cpu = result["cpu_us_per_token"]
        print("CPU per streamed output token: " + ", ".join(
            f"{label} {cpu[name]:.0f} µs" if cpu[name] is not None else f"{label} (not on this machine)"
            for name, label in (("api", "API process" + (f" (sum of {result['api_server_count']})"
                                                         if result.get("api_server_count", 1) > 1 else "")),
                                ("core", "engine core"), ("client", "load generator"))))
    for e in result["errors"]:
        print(f"error: {e}")


def measure_serve_load(health: dict, url: str, model: str, prompts: list, out_lens: list, *load) -> dict:
    """``run_serve_load`` with each process's CPU per streamed output token read from /proc around it: the API
    processes (one, or --api-server-count of them, summed), the engine core and this load generator."""
    pids = {"api": health.get("api_server_pids") or [health.get("api_server_pid")],
            "core": [health.get("engine_core_pid")]}
    before = {name: processes_cpu_seconds(p) for name, p in pids.items()}
    result = asyncio.run(run_serve_load(url, model, prompts, out_lens, *load))
    after = {name: processes_cpu_seconds(p) for name, p in pids.items()}
    tokens = max(result["output_tokens"], 1)
    result["api_server_count"] = len(pids["api"])
    result["cpu_us_per_token"] = {  # (None where the server runs on another machine: no /proc entry here)
        **{name: 1e6 * (after[name] - before[name]) / tokens if None not in (before[name], after[name]) else None
           for name in pids}, "client": 1e6 * result["client_cpu_s"] / tokens}
    return result


def serve(args) -> None:
    import httpx

    health = httpx.get(f"{args.url}/health").json()
    model = args.served_model or httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    prompts, out_lens = serve_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                                      health.get("vocab_size", 151643), args.seed)
    print(f"mili bench serve: {args.url} model {model}; {args.num_prompts} prompts, random dataset "
          f"{args.random_input_len} in / {args.random_output_len} out, request rate {args.request_rate} req/s "
          f"(Poisson), max concurrency {args.max_concurrency or 'none'}, streamed")
    result = measure_serve_load(health, args.url, model, prompts, out_lens, args.request_rate,
                                args.max_concurrency, args.seed)
    print_serve_result(result)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)


def add_parser(sub) -> None:
    from mili import options
    from mili.config import EngineConfig

    p = sub.add_parser("bench", help="benchmarks: latency | throughput | serve")
    p.add_argument("mode", choices=["latency", "throughput", "serve"])
    # the checkpoint (latency, throughput) and the engine's options; --seed seeds the requests too
    options.add_arguments(p, EngineConfig, ENGINE_OPTIONS, ENGINE_DEFAULTS)
    p.add_argument("--baseline", default=None, choices=[None, "hf", "bf16"],
                   help="also run HF transformers generate (hf), or latency: MILI unquantized (bf16)")
    p.add_argument("--input-len", type=int, default=512, help="latency: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="latency: output tokens")
    p.add_argument("--repeat", type=int, default=3, help="latency: runs (median)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-input", type=int, default=128)
    p.add_argument("--max-input", type=int, default=128)
    p.add_argument("--min-output", type=int, default=128)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--hf-sequential-sample", type=int, default=4,
                   help="throughput: HF one-after-another times this many requests and scales to all")
    p.add_argument("--url", "--base-url", default="http://127.0.0.1:8000", help="serve: the server")
    p.add_argument("--served-model", default=None)
    p.add_argument("--num-prompts", type=int, default=256, help="serve: requests to send")
    p.add_argument("--random-input-len", type=int, default=128, help="serve: prompt tokens of each request")
    p.add_argument("--random-output-len", type=int, default=128, help="serve: output tokens of each request")
    p.add_argument("--max-concurrency", type=int, default=None, help="serve: most requests in flight")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="serve: requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--save-result", default=None, metavar="FILE", help="serve: the figures as JSON")
    p.set_defaults(func=lambda a: {"latency": latency, "throughput": throughput, "serve": serve}[a.mode](a) or 0)
