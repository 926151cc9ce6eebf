"""One table of MILI's speed on a GPU, for a session lent an H100/H200 for minutes (issue 58); run it through
benchmarks/gpu_session.sh, which installs the carried wheels first. Every row is measured in the same run:

  0   the random-weight checkpoint (Qwen3-0.6B shape, bf16, seed 0; on CUDA initialised on the GPU)
  1a  the copy roofline: a device-to-device copy's GB/s, bytes read + written (median of 5 timings of 10 copies)
  1b  batch-1 decode roofline: 1a over the bytes of weights a decode step reads (mili.tools.bench's count)
  2   the Triton decode attention (mili.kernels.triton.attention.paged_decode): KV bytes read / time, at batch
      1/64/256 x context 64/512/4096, 16 query heads, 8 KV heads, head_dim 128, bf16, MILI's default page size;
      pages in a seeded random order; triton.testing.do_bench's median (it empties the L2 between calls)
  3   batch-1 decode tok/s after an 8- and a 512-token prompt, through LLM.generate (128 greedy tokens,
      ignore_eos): the tokens after the first over the time between the first and the last (the request's own
      timestamps), median of 3; as a share of 1b
  4   LLM.generate, 64 sequences x 256 greedy tokens (8-token prompts): output tok/s over the call's wall time;
      and the engine's decode-only steps a second on the same batch (mili bench's figure, selftest's)
  5   nano-vllm's bench.py workload: 256 sequences, prompt and output lengths uniform in 100-1024 (Python's
      random, seed 0, prompt ids < 10000), temperature 0.6, ignore_eos; output tok/s over the call
  6   `mili serve` + `mili bench serve`: 500 streamed /v1/completions at once, 512 prompt / 128 output tokens,
      greedy, ignore_eos: req/s, output tok/s, TTFT and TPOT medians, and CPU per output token of the load
      generator (its own window), the API process and the engine core (/proc/PID/stat utime+stime around the
      load, pids from /health)
  7   embeddings (benchmarks/pooling.py's embed row): LLM.embed of 64 documents of 256 tokens against
      transformers' batched bf16 forward (batches of 32, last token, normalised), docs/s

Each group of rows runs in its own process with a timeout (a serve run's server and client too), and each row
within it under its own alarm: a failure prints an ERROR row and the rest go on. The groups' timeouts add up to
470 s, and each is cut to what is left of --budget (default 465: the session script's 8 minutes less its start and
a margin for the teardowns), so the whole run ends within 8 minutes.

``--tiny``: every row on the CPU at a tiny size (a tiny random Qwen3 on the real tokenizer, float32, few
requests, short lengths; the Triton rows under TRITON_INTERPRET=1 at small batches and contexts: figures of
the interpreter, not speeds), for tests/e2e/test_gpu_session.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARK = "@@ROW "
NA_CPU = "n/a on cpu"

SIZES = {
    "full": dict(device="cuda", dtype="bfloat16", copy_mib=1024, b1_prompts=(8, 512), b1_out=128, repeats=3,
                 batch=64, batch_out=256, batch_prompt=8, nano=(256, 100, 1024), serve=(500, 512, 128),
                 embed=(64, 256, 3), kernel=((1, 64, 256), (64, 512, 4096))),
    "tiny": dict(device="cpu", dtype="float32", copy_mib=64, b1_prompts=(8, 32), b1_out=8, repeats=1,
                 batch=4, batch_out=8, batch_prompt=8, nano=(8, 8, 32), serve=(8, 32, 8),
                 embed=(4, 32, 1), kernel=((1, 2, 4), (16, 32, 64))),
}
# seconds: each group's process (the backstop), and each row's alarm inside it
TIMEOUTS = {
    "full": dict(kernel=45, offline=275, serve=105, embed=45, kernel_row=15, checkpoint=60, load=75, roofline=10,
                 b1=15, batch=25, nano=75, server_start=50),
    "tiny": dict(kernel=120, offline=180, serve=120, embed=90, kernel_row=60, checkpoint=60, load=60, roofline=20,
                 b1=30, batch=30, nano=60, server_start=90),
}
ORDER = ("kernel", "offline", "serve", "embed")  # (the order they run in; the table is by row)
ENGINE_ROWS = ("1b", "3a", "3b", "4a", "4b", "5")  # the offline rows that need the loaded engine


def plan(tiny: bool) -> dict[str, list[tuple[str, str]]]:
    """Each group's rows: (id, label), in the table's order."""
    s = SIZES["tiny" if tiny else "full"]
    nano_n, lo, hi = s["nano"]
    n, inp, out = s["serve"]
    docs, doc_len, _ = s["embed"]
    batches, contexts = s["kernel"]
    b1 = [(f"3{'ab'[i]}", f"batch-1 decode after a {p}-token prompt (LLM.generate, {s['b1_out']} out), "
                          "% of 1b") for i, p in enumerate(s["b1_prompts"])]
    return {
        "offline": [("0", f"random checkpoint ({'tiny Qwen3, float32' if tiny else 'Qwen3-0.6B shape, bf16'})"),
                    ("1a", "copy roofline (device copy, read + write)"),
                    ("1b", "batch-1 decode roofline (1a / weight bytes a step)"), *b1,
                    ("4a", f"LLM.generate, batch {s['batch']} x {s['batch_out']} out: output tok/s"),
                    ("4b", f"engine decode-only steps, same batch (x {s['batch']} = tok/s)"),
                    ("5", f"nano-vllm workload: {nano_n} seqs, in/out U({lo},{hi}), ignore_eos")],
        "kernel": [(f"2 b{b} c{c}", f"Triton paged_decode, batch {b}, context {c}: KV bytes / time")
                   for b in batches for c in contexts],
        "serve": [("6a", f"serve: {n} streamed completions at once, {inp} in / {out} out: req/s"),
                  ("6b", "serve: output tok/s"), ("6c", "serve: TTFT median"), ("6d", "serve: TPOT median"),
                  ("6e", "serve: load generator CPU per output token"),
                  ("6f", "serve: API process CPU per output token"), ("6g", "serve: engine core CPU per output token")],
        "embed": [("7a", f"embeddings, MILI LLM.embed ({docs} docs x {doc_len} tokens)"),
                  ("7b", "embeddings, transformers batched bf16 forward")],
    }


def row_order(tiny: bool) -> list[tuple[str, str]]:
    rows = [r for g in ("offline", "kernel", "serve", "embed") for r in plan(tiny)[g]]
    first = {"0": 0, "1": 1, "2": 2, "3": 3, "4": 4, "5": 5, "6": 6, "7": 7}
    return sorted(rows, key=lambda r: first[r[0][0]])  # (stable: the kernel rows between 1b and 3a)


# -- the child side: a group's rows, each under an alarm ---------------------------------------------------
_emitted: set[str] = set()


def emit(rid: str, value, unit: str = "", detail: str = "", **extra) -> None:
    _emitted.add(rid)
    print(MARK + json.dumps({"id": rid, "value": value, "unit": unit, "detail": detail, **extra}), flush=True)


class RowTimeout(BaseException):
    """A row's alarm: a BaseException, so that no ``except Exception`` on the way (the engine's) swallows it."""


def attempt(ids: list[str], seconds: float, fn, *args):
    """``fn(*args)`` under a ``seconds`` alarm; on any failure an ERROR row for each of ``ids`` not emitted yet
    (the cause in its detail), and None."""
    def alarm(*_):
        raise RowTimeout(f"timed out after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001  (a row's failure of any kind, KeyboardInterrupt aside, is its row's)
        if isinstance(e, KeyboardInterrupt):
            raise
        import traceback

        traceback.print_exc()
        message = f"{type(e).__name__}: {e}".strip().splitlines()[0][:200]
        for rid in ids:
            if rid not in _emitted:
                emit(rid, "ERROR", detail=message)
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine_default(name: str):
    import dataclasses

    from mili.config import EngineConfig

    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def _token_ids(n: int, seed: int, vocab: int = 151643) -> list[int]:
    import torch

    return torch.randint(0, min(vocab, 151643), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def build_checkpoint(tiny: bool, device: str) -> tuple[str, str]:
    """(path, how): the random checkpoint, built once under the benchmark cache (MILI_BENCH_CACHE). Full: the
    Qwen3-0.6B shape in bf16 as benchmarks/common.py builds it, initialised on the GPU where there is one (seconds,
    not a minute: other weights than common's CPU-built ones, as seeded); tiny: that config cut to 2 layers of
    width 64 on the real vocabulary, float32."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(HERE))
    from common import CACHE, DATA, qwen3_checkpoint

    on_gpu = device.startswith("cuda") and torch.cuda.is_available()
    if not tiny and not on_gpu:
        path = qwen3_checkpoint("Qwen3-0.6B")
        return path, "common.qwen3_checkpoint (CPU init)"
    path = CACHE / ("gpu-session-tiny-qwen3-float32-s0" if tiny else "Qwen3-0.6B-random-bfloat16-s0-cudainit")
    if (path / "model.safetensors").is_file():
        return str(path), "cached"
    shape = {k: v for k, v in json.loads((DATA / "qwen3_configs.json").read_text())["Qwen3-0.6B"].items()
             if not k.startswith("_")}
    shape.pop("torch_dtype", None)
    if tiny:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_window_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda" if on_gpu else "cpu"):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(torch.float32 if tiny else torch.bfloat16).eval()
    model = model.to("cpu")
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the real Qwen3 tokenizer, as the hub's folders hold it
        shutil.copy(DATA / "qwen3-tokenizer" / name, tmp / name)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return str(path), "built" + (" on the GPU" if on_gpu else "")


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes a second a ``mib`` MiB copy moves on ``device`` (read + write, as STREAM counts): the median of 5
    timings of 10 copies."""
    import statistics

    import torch

    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 * 10 / statistics.median(times)


def group_offline(args, s, t) -> None:
    import random
    import statistics

    import torch

    from mili import LLM, SamplingParams
    from mili.tools.bench import run_batch, weight_bytes_per_step

    device = s["device"]
    found = {}

    def roofline():  # (first: the GPU's memory is free)
        found["bw"] = copy_bandwidth(device, s["copy_mib"])
        name = torch.cuda.get_device_name() if device.startswith("cuda") else device
        emit("1a", found["bw"] / 1e9, "GB/s", f"{s['copy_mib']} MiB copy on {name}, median of 5 x 10 copies")
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    attempt(["1a"], t["roofline"], roofline)

    def checkpoint():
        if args.model:
            emit("0", 0.0, "s", f"given: {args.model}", path=args.model)
            return
        start = time.perf_counter()
        args.model, how = build_checkpoint(args.tiny, device)
        emit("0", time.perf_counter() - start, "s", f"{how}: {args.model}", path=args.model)

    attempt(["0", *ENGINE_ROWS], t["checkpoint"], checkpoint)
    if not args.model:
        return
    llm = attempt(list(ENGINE_ROWS), t["load"], lambda: LLM(args.model, dtype=s["dtype"], device=device,
                                                            max_model_len=4096, seed=0))
    if llm is None:
        return
    engine = llm.engine
    greedy = dict(temperature=0.0, ignore_eos=True)

    def decode_roofline():
        weights = weight_bytes_per_step(engine.core.runner.parts.model)
        found["roof"] = found["bw"] / weights
        emit("1b", found["roof"], "tok/s", f"{weights / 2**30:.3f} GiB of weights a step (its KV not counted)")

    attempt(["1b"], 5, decode_roofline)

    def batch1(rid: str, prompt_len: int, seed: int):
        n = s["b1_out"]
        params = SamplingParams(max_tokens=n, **greedy)
        llm.generate([{"prompt_token_ids": _token_ids(prompt_len, seed - 1)}], params, use_tqdm=False)  # warm-up
        rates, ttfts = [], []
        for r in range(s["repeats"]):
            llm.reset_prefix_cache()
            (out,) = llm.generate([{"prompt_token_ids": _token_ids(prompt_len, seed + r)}], params, use_tqdm=False)
            m = out.metrics
            got = len(out.outputs[0].token_ids)
            rates.append((got - 1) / (m["finished_time"] - m["first_token_time"]))
            ttfts.append(m["first_token_time"] - m["arrival_time"])
        rate = statistics.median(rates)
        share = f"{100 * rate / found['roof']:.0f}% of 1b; " if "roof" in found else ""
        emit(rid, rate, "tok/s", f"{share}TTFT {1e3 * statistics.median(ttfts):.1f} ms; median of {s['repeats']}")

    for i, prompt_len in enumerate(s["b1_prompts"]):
        attempt([f"3{'ab'[i]}"], t["b1"], batch1, f"3{'ab'[i]}", prompt_len, 1000 * (i + 1))

    def batched():
        b, n = s["batch"], s["batch_out"]
        prompts = [{"prompt_token_ids": _token_ids(s["batch_prompt"], 5000 + i)} for i in range(b)]
        llm.generate(prompts, SamplingParams(max_tokens=4, **greedy), use_tqdm=False)  # warm-up at this batch
        llm.reset_prefix_cache()
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, **greedy), use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        emit("4a", tokens / seconds, "tok/s", f"{tokens} tokens in {seconds:.2f} s, {s['batch_prompt']}-token prompts")
        llm.reset_prefix_cache()
        stats: list = []
        run_batch(engine, [p["prompt_token_ids"] for p in prompts], SamplingParams(max_tokens=n, **greedy), stats)
        llm.reset_prefix_cache()
        dsec, dtok = stats
        emit("4b", dtok / b / dsec, "steps/s", f"= {dtok / dsec:.0f} tok/s over {dtok} tokens of decode-only steps "
                                              "(run_batch, as mili bench)")

    attempt(["4a", "4b"], t["batch"], batched)

    def nano():  # nano-vllm's bench.py, with its seed and draws
        count, lo, hi = s["nano"]
        rng = random.Random(0)
        prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(lo, hi))
                  for _ in range(count)]
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
        _sync(device)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        total = sum(p.max_tokens for p in params)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == total
        emit("5", total / seconds, "tok/s", f"{sum(map(len, prompts))} prompt + {total} output tokens in "
                                           f"{seconds:.1f} s (max_num_seqs {engine.config.max_num_seqs})")

    attempt(["5"], t["nano"], nano)


def group_kernel(args, s, t) -> None:
    import math

    ids = [rid for rid, _ in plan(args.tiny)["kernel"]]
    try:
        import torch

        if s["device"] == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ImportError("TRITON_INTERPRET is not 1")
        import triton
        import triton.testing

        from mili.kernels.triton.attention import paged_decode
    except ImportError as e:
        for rid in ids:
            emit(rid, NA_CPU if s["device"] == "cpu" else "ERROR", detail=f"{type(e).__name__}: {e}")
        return
    device, dtype = s["device"], torch.bfloat16
    hq, hkv, d = (4, 2, 32) if device == "cpu" else (16, 8, 128)  # (full: Qwen3-0.6B's attention)
    page = _engine_default("page_size")
    batches, contexts = s["kernel"]
    note = "; TRITON_INTERPRET=1 on the CPU: not a speed" if device == "cpu" else ""

    def one(b: int, ctx: int):
        g = torch.Generator(device=device).manual_seed(b * 10007 + ctx)
        per_seq = math.ceil(ctx / page)
        pages = b * per_seq
        k = torch.randn(pages, page, hkv, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(pages, page, hkv, d, generator=g, device=device, dtype=dtype)
        table = torch.randperm(pages, generator=g, device=device).view(b, per_seq).to(torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(b, hq, d, generator=g, device=device, dtype=dtype)

        def call():
            return paged_decode(q, k, v, table, lens, d ** -0.5, max_pages=per_seq)

        if device.startswith("cuda"):
            ms = triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median")
        else:  # (the interpreter: one call, nothing to compile)
            start = time.perf_counter()
            call()
            ms = 1e3 * (time.perf_counter() - start)
        kv = 2 * b * ctx * hkv * d * dtype.itemsize
        emit(f"2 b{b} c{ctx}", kv / ms / 1e6, "GB/s", f"{1e3 * ms:.1f} us a call, {kv / 2**20:.3g} MiB of KV, "
                                                     f"{hq}/{hkv} heads x {d}, page {page}{note}")

    for b in batches:
        for ctx in contexts:
            attempt([f"2 b{b} c{ctx}"], t["kernel_row"], one, b, ctx)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()


def group_embed(args, s, t) -> None:
    import gc

    import torch

    sys.path.insert(0, str(HERE))
    from pooling import embedding_checkpoint, random_texts, timed
    from transformers import AutoModel, AutoTokenizer

    from mili import LLM

    docs, doc_len, repeats = s["embed"]
    device = s["device"]
    found = {}

    def mili_row():
        path = embedding_checkpoint(args.model)
        texts = random_texts(AutoTokenizer.from_pretrained(args.model), docs, doc_len - 1, seed=1)  # (+ <|endoftext|>)
        found.update(path=path, texts=texts)
        llm = LLM(path, task="embed", max_model_len=2048, device=device,
                  kv_cache_memory=(4 << 30) if device.startswith("cuda") else (256 << 20))
        seconds = timed(lambda: llm.embed(texts, use_tqdm=False), repeats, llm.reset_prefix_cache)
        tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts, use_tqdm=False))
        found["mili"] = seconds
        emit("7a", docs / seconds, "docs/s", f"{tokens / docs:.0f} tokens a document, median of {repeats} "
                                             f"(benchmarks/pooling.py's embed row)")
        del llm

    attempt(["7a"], t["embed"] * 0.5, mili_row)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if "texts" not in found:
        emit("7b", "ERROR", detail="no documents (row 7a failed before making them)")
        return

    def hf_row():
        path, texts = found["path"], found["texts"]
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModel.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()

        def hf():  # what sentence-transformers runs, in batches of 32: the last token's hidden state, normalised
            for i in range(0, len(texts), 32):
                batch = tokenizer(texts[i:i + 32], padding=True, return_tensors="pt").to(device)
                with torch.inference_mode():
                    torch.nn.functional.normalize(model(**batch).last_hidden_state[:, -1].float(), dim=1)

        seconds = timed(hf, repeats)
        ratio = f"MILI {seconds / found['mili']:.2f}x its speed" if "mili" in found else ""
        emit("7b", docs / seconds, "docs/s", f"{ratio}; batches of 32, left-padded, median of {repeats}")

    attempt(["7b"], t["embed"] * 0.4, hf_row)


GROUPS = {"offline": group_offline, "kernel": group_kernel, "embed": group_embed}


# -- the parent side: groups in processes, the serve run, the table ------------------------------------------
def child_env(tiny: bool, group: str) -> dict:
    env = {**os.environ, "MILI_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if tiny and group == "kernel":
        env["TRITON_INTERPRET"] = "1"
    return env


def _kill(proc: subprocess.Popen) -> None:
    """The process and whatever it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_group(name: str, args, timeout: float, log) -> dict[str, dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--group", name] + (["--tiny"] if args.tiny else [])
    if args.model:
        cmd += ["--model", args.model]
    log.write(f"\n===== {name}: {' '.join(cmd)} (timeout {timeout:.0f} s)\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                            env=child_env(args.tiny, name), start_new_session=True)
    cause = None
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        cause = f"the group's process timed out after {timeout:.0f} s"
    rows = {}
    for line in out.splitlines():
        if line.startswith(MARK):
            r = json.loads(line[len(MARK):])
            rows[r["id"]] = r
        else:
            log.write(line + "\n")
    log.flush()
    if cause is None and proc.returncode != 0:
        cause = f"the group's process exited {proc.returncode}: {_last_line(log.name)}"
    for rid, _ in plan(args.tiny)[name]:
        rows.setdefault(rid, {"id": rid, "value": "ERROR", "unit": "", "detail": cause or "no figure"})
    return rows


def _last_line(path: str) -> str:
    try:
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def _alive(pid: int) -> bool:
    """A process here that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def _stat_cpu_seconds(pids: list) -> float | None:
    """utime + stime of each process (/proc/PID/stat: its threads, the ended ones too), summed."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{int(pid)}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError, ValueError):
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def group_serve(args, timeout: float, log, logdir: Path) -> dict[str, dict]:
    """``mili serve`` and ``mili bench serve`` as processes; the CPU of each server process from /proc around the
    load, the load generator's in its own window (and the whole process's, getrusage)."""
    import resource
    import socket
    import urllib.request

    s = SIZES["tiny" if args.tiny else "full"]
    t = TIMEOUTS["tiny" if args.tiny else "full"]
    ids = [rid for rid, _ in plan(args.tiny)["serve"]]
    rows: dict[str, dict] = {}

    def put(rid, value, unit="", detail=""):
        rows[rid] = {"id": rid, "value": value, "unit": unit, "detail": detail}

    deadline = time.monotonic() + timeout
    n, inp, out = s["serve"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server_log = open(logdir / "serve-server.log", "w")
    cmd = [sys.executable, "-m", "mili.cli", "serve", args.model, "--port", str(port), "--served-model-name", "bench",
           "--device", s["device"], "--dtype", s["dtype"], "--max-model-len", str(max(1024, inp + out + 64)),
           "--log-level", "warning"]
    log.write(f"\n===== serve: {' '.join(cmd)}\n")
    log.flush()
    server = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=child_env(args.tiny, "serve"), start_new_session=True)
    pids: dict[str, list] = {}
    try:
        health = None
        waited = time.monotonic()
        start_by = min(deadline, waited + t["server_start"])
        while time.monotonic() < start_by and server.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    health = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.3)
        if health is None:
            why = (f"the server exited {server.returncode}" if server.poll() is not None
                   else f"the server did not answer /health in {time.monotonic() - waited:.0f} s")
            raise RuntimeError(f"{why}: {_last_line(server_log.name)}")
        pids = {"api": health.get("api_server_pids") or [health.get("api_server_pid")],
                "core": [health.get("engine_core_pid")]}
        result_path = logdir / "serve-result.json"
        client_cmd = [sys.executable, "-m", "mili.cli", "bench", "serve", "--url", url, "--served-model", "bench",
                      "--num-prompts", str(n), "--random-input-len", str(inp), "--random-output-len", str(out),
                      "--seed", "0", "--save-result", str(result_path)]
        log.write(f"===== client: {' '.join(client_cmd)}\n")
        log.flush()
        before = {k: _stat_cpu_seconds(p) for k, p in pids.items()}
        usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        client = subprocess.run(client_cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=child_env(args.tiny, "serve"), timeout=max(deadline - time.monotonic() - 8, 1))
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        after = {k: _stat_cpu_seconds(p) for k, p in pids.items()}
        log.flush()
        if client.returncode != 0:
            raise RuntimeError(f"mili bench serve exited {client.returncode}: {_last_line(log.name)}")
        res = json.loads(result_path.read_text())
        tokens = max(res["output_tokens"], 1)
        failed = f"; {res['failed']} failed: {res['errors'][:1]}" if res["failed"] else ""
        put("6a", res["request_throughput"], "req/s",
            f"{res['completed']} of {res['num_prompts']} completed in {res['duration_s']:.1f} s{failed}")
        put("6b", res["output_throughput"], "tok/s", f"{res['output_tokens']} output tokens")
        put("6c", res["ttft"]["median_ms"], "ms", f"p99 {res['ttft']['p99_ms']:.1f} ms")
        put("6d", res["tpot"]["median_ms"] if res["tpot"] else "ERROR", "ms",
            f"p99 {res['tpot']['p99_ms']:.2f} ms" if res["tpot"] else "no request had two tokens")
        whole = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
        put("6e", 1e6 * res["client_cpu_s"] / tokens, "us",
            f"over the load (process time); the whole process with its start-up (getrusage) "
            f"{1e6 * whole / tokens:.0f} us")
        theirs = res.get("cpu_us_per_token") or {}
        for rid, name in (("6f", "api"), ("6g", "core")):
            if None in (before[name], after[name]):
                put(rid, "ERROR", detail=f"no /proc/PID/stat for {name} pids {pids[name]}")
                continue
            alt = f"; bench serve's schedstat reading {theirs[name]:.0f} us" if theirs.get(name) is not None else ""
            put(rid, 1e6 * (after[name] - before[name]) / tokens, "us",
                f"/proc/PID/stat utime+stime of pid {', '.join(map(str, pids[name]))}{alt}")
    except Exception as e:  # noqa: BLE001  (the serve rows' failure, whatever it is, is theirs)
        message = (f"mili bench serve timed out after {e.timeout:.0f} s" if isinstance(e, subprocess.TimeoutExpired)
                   else f"{type(e).__name__}: {e}".splitlines()[0][:200])
        log.write(f"serve failed: {message}\n")
        for rid in ids:
            rows.setdefault(rid, {"id": rid, "value": "ERROR", "unit": "", "detail": message})
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                pass
        _kill(server)  # (its engine core too, if it outlived it)
        server.wait()
        gone_by = time.monotonic() + 10  # the core's GPU memory back before the next group starts
        while any(_alive(pid) for pid in pids.get("core", []) if pid) and time.monotonic() < gone_by:
            time.sleep(0.2)
        server_log.close()
    return rows


def fmt(value) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def header(args) -> list[str]:
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    commit = os.environ.get("MILI_GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True).stdout.strip()
            commit += " (with uncommitted changes)" if dirty else ""
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown (no .git here: set MILI_GIT_COMMIT, or carry the wheels folder's COMMIT)"
    if os.environ.get("MILI_WHEELS_COMMIT"):  # (gpu_wheels.sh wrote it where the wheels were fetched)
        commit += f"; the wheels folder's COMMIT: {os.environ['MILI_WHEELS_COMMIT']}"
    gpu = "none"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        gpu = q.stdout.strip().replace("\n", "; ") or f"nvidia-smi failed: {q.stderr.strip()[:100]}"
    import platform

    s = SIZES["tiny" if args.tiny else "full"]
    return [f"MILI GPU session (benchmarks/gpu_session.sh{' --tiny' if args.tiny else ''}), "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"commit: {commit}",
            f"GPU: {gpu}; measured on: {s['device']}; CPU: {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores",
            f"python {platform.python_version()}, torch {version('torch')}, triton {version('triton')}, "
            f"transformers {version('transformers')}",
            "model: " + ("tiny random Qwen3 (2 layers, width 64, real vocabulary), float32" if args.tiny
                         else "Qwen3-0.6B shape, random bf16 weights (seed 0)") + ", the real Qwen3 tokenizer"]


def parent(args) -> int:
    started = time.monotonic()
    deadline = started + args.budget
    mode = "tiny" if args.tiny else "full"
    logdir = Path(args.logs or os.environ.get("MILI_GPU_SESSION_LOGS") or "/tmp/mili-gpu-session")
    logdir.mkdir(parents=True, exist_ok=True)
    lines = header(args)
    if not args.tiny and not shutil.which("nvidia-smi"):
        lines.append("WARNING: no nvidia-smi here: the full run measures CUDA (--tiny runs every row on the CPU)")
    for line in lines:
        print(line, flush=True)
    rows: dict[str, dict] = {}
    took = []
    with open(logdir / "session.log", "w") as log:
        for name in ORDER:
            group_start = time.monotonic()
            left = deadline - time.monotonic()
            timeout = min(TIMEOUTS[mode][name], left)
            print(f"[{time.monotonic() - started:5.0f} s] {name} (at most {max(timeout, 0):.0f} s) ...",
                  file=sys.stderr, flush=True)
            if timeout < 5:
                for rid, _ in plan(args.tiny)[name]:
                    rows[rid] = {"id": rid, "value": "ERROR", "unit": "", "detail": "no time left in the budget"}
                continue
            if name in ("serve", "embed") and not args.model:
                for rid, _ in plan(args.tiny)[name]:
                    rows[rid] = {"id": rid, "value": "ERROR", "unit": "", "detail": "no checkpoint (row 0 failed)"}
                continue
            if name == "serve":
                found = group_serve(args, timeout, log, logdir)
            else:
                found = run_group(name, args, timeout, log)
            if name == "offline" and not args.model and isinstance(found["0"]["value"], (int, float)):
                args.model = found["0"]["path"]
            rows.update(found)
            took.append(f"{name} {time.monotonic() - group_start:.0f} s")
    table = ["| row | measurement | result | detail |", "|---|---|---|---|"]
    for rid, label in row_order(args.tiny):
        r = rows[rid]
        value = fmt(r["value"]) + (f" {r['unit']}" if isinstance(r["value"], (int, float)) and r["unit"] else "")
        table.append(f"| {rid} | {label} | {value} | {r['detail'].replace('|', '/')} |")
    wall = time.monotonic() - started
    footer = f"wall time {wall:.0f} s (budget {args.budget:.0f} s: {', '.join(took)}); logs in {logdir}"
    print("\n" + "\n".join(table) + "\n\n" + footer, flush=True)
    (logdir / "table.md").write_text("\n".join(lines + [""] + table + ["", footer]) + "\n")
    errors = sum(1 for r in rows.values() if r["value"] == "ERROR")
    if errors:
        print(f"{errors} row(s) failed: see the table's details and {logdir}", file=sys.stderr)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="every row on the CPU at a tiny size (the test's mode)")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of building the random one")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for everything (default 465: 8 minutes less the script's start; tiny 600)")
    ap.add_argument("--logs", default=None, help="folder for the logs, the serve result and table.md "
                                                 "(default $MILI_GPU_SESSION_LOGS or /tmp/mili-gpu-session)")
    ap.add_argument("--group", choices=sorted(GROUPS), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.group:  # a child: one group's rows as MARK lines
        mode = "tiny" if args.tiny else "full"
        GROUPS[args.group](args, SIZES[mode], TIMEOUTS[mode])
        return 0
    if args.budget is None:
        args.budget = 600.0 if args.tiny else 465.0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
