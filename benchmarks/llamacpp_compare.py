"""MILI against llama.cpp on the CPU, side by side in one run: batch-1 decode and prefill for the same random
checkpoint in each format pair (MILI bf16 / llama.cpp BF16, MILI int8 / Q8_0, MILI AWQ int4 / Q4_0), the same
thread count, in paired rounds (the engines back to back, their order swapped each round).

llama.cpp comes from the ``llama-cpp-python`` sdist on PyPI (its vendored tree), built here with
``GGML_NATIVE=ON`` (only ``llama-bench`` and ``llama-quantize``); the checkpoint goes to GGUF BF16 with
llama.cpp's own ``convert_hf_to_gguf.py``, then Q8_0 and Q4_0 with ``llama-quantize``. MILI reads the same
checkpoint in bf16, with ``--quantization int8``, and as an AWQ checkpoint made from it
(benchmarks/quant_decode.py; its lm_head on the int8 kernel, ``--lm-head-dtype auto``). Everything is cached
under ``~/.cache/mili/bench`` (``MILI_BENCH_CACHE``).

    python benchmarks/llamacpp_compare.py [--models Qwen3-0.6B Qwen3-4B:8] [--threads 2] [--input-len 64]
                                          [--output-len 32] [--repeat 3] [--llama-cpp-python 0.3.36]
                                          [--cpu-isa native]

``--same-file`` has both engines read the same GGUF files (Q8_0, Q4_0 and Q4_K_M from ``llama-quantize``): MILI
through its GGUF loader, the blocks as stored on its int4 and int8g kernels.

``--cpu-isa avx2`` measures both engines as they would run on an AVX2-only CPU (a Zen 3, say) on a newer one:
llama.cpp built a second time (``build-avx2``) with ``GGML_NATIVE=OFF`` and only the AVX2-class flags (SSE4.2,
AVX, AVX2, FMA, F16C, BMI2; no AVX-512, AVX-VNNI or AMX, checked on the binary: no zmm register), and MILI
with ``MILI_CPU_ISA=avx2``. torch reads ``ATEN_CPU_CAPABILITY`` only at import and MILI its ISA from the
environment, so set both when starting the script (it refuses otherwise)::

    MILI_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/llamacpp_compare.py --cpu-isa avx2

``native`` (the default): llama.cpp with ``GGML_NATIVE=ON`` (``build``), MILI's best path, and
``MILI_CPU_ISA`` must be unset. A 512-token prefill: ``--input-len 512`` (prompt + output up to 1024 tokens).

``--depths 4096 16384`` measures batch-1 decode after that many tokens instead, for the KV cache's formats: MILI
with its bf16 pages and with ``--kv-cache-dtype int8`` (int8 and a float32 scale per token and kv head), and
llama.cpp's best of its f16 and q8_0 caches with flash attention off and on (``-ctk``/``-ctv``, ``-fa``; q8_0 V
needs flash attention), all on the bf16 weights (``--depth-weights Q8_0``: both engines on the same Q8_0 GGUF file,
MILI through its GGUF loader). MILI prefills each depth once (the prompt then stays in its
prefix cache, so each round decodes after it without prefilling again); llama-bench decodes at ``-d``. The roofline
is the copy bandwidth (the mean of a copy just before and one just after each MILI run: this VM's rate moves within a
round) over the bytes a step reads: the weights and the K/V of every earlier token (MILI: its pages' bytes, int8's
scales included). ``--skip-llama`` measures MILI alone (no llama.cpp build). ``--synthetic`` skips
MILI's prefill (minutes at 16k on two cores): each step runs as the runner runs a batch-1 decode (the C decode layers,
the head, the argmax) over pages filled with random K/V, at the depth's position; a step costs the same whatever the
pages hold::

    python benchmarks/llamacpp_compare.py --models Qwen3-0.6B --depths 4096 16384 --output-len 32 [--skip-llama]

Per format, MILI's engine is loaded once; then ``--rounds`` paired rounds, each a copy-rate measure, one MILI
measure (the median of ``--repeat`` requests, ``mili bench latency``'s measure) and one llama-bench run (its mean of
``-r`` ``--repeat``) back to back, the engines' order swapped every round. A ratio is taken within each round and the
table gives the rounds' median and range: this VM's memory bandwidth moves by ±20% over minutes, and a pair taken in
the same half minute shares them. Both engines decode after the prompt: llama-bench's decode test runs at depth
``--input-len`` (``-d``), its prefill test from an empty context; each with flash attention off and on (``-fa 0,1``),
the faster kept. The roofline is a copy (read + write) with the same thread count, measured each round, over the
bytes a decode step reads: MILI's weights as loaded (the head as read), llama.cpp's GGUF file (tied: its token table
is the output matrix, read whole each step).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
from common import CACHE, machine, print_table, qwen3_checkpoint, random_prompt
from quant_decode import _quantized_copy

from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.tools.bench import _measure_latency, memory_bandwidth, weight_bytes_per_step

MAX_MODEL_LEN = 1024  # MILI's context: --input-len + --output-len must fit
# llama.cpp's build per --cpu-isa: (build folder, the CMake flags that pick its instruction set)
LLAMA_ISA = {
    "native": ("build", ["-DGGML_NATIVE=ON"]),
    "avx2": ("build-avx2", ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                            "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF",
                            "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
                            "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                            "-DGGML_AMX_BF16=OFF"]),
}
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512vbmi", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
PAIRS = [  # (label, MILI: (checkpoint kind, --quantization), llama.cpp GGUF type)
    ("bf16 / BF16", ("dense", None), "BF16"),
    ("int8 / Q8_0", ("dense", "int8"), "Q8_0"),
    ("AWQ int4 / Q4_0", ("awq", None), "Q4_0"),
]
# --same-file: both engines read the same GGUF file (MILI's GGUF loader, its blocks on the int4 / int8g kernels)
SAME_FILE_PAIRS = [(f"GGUF {kind}", ("gguf", None), kind) for kind in ("Q8_0", "Q4_0", "Q4_K_M")]


def llama_cpp(version: str, isa: str = "native") -> Path:
    """llama.cpp's bin/ folder, built once from the llama-cpp-python sdist's vendored tree, for ``isa`` (a
    key of LLAMA_ISA; each in its own build folder of the same tree)."""
    root = CACHE / "llamacpp"
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    build, isa_flags = LLAMA_ISA[isa]
    bin_dir = src / build / "bin"
    if (bin_dir / "llama-bench").is_file() and (bin_dir / "llama-quantize").is_file():
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                        "--no-binary", ":all:", "-d", str(root)], check=True)
    if not src.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / build), "-DCMAKE_BUILD_TYPE=Release", *isa_flags,
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                    "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(src / build), "--target", "llama-bench", "llama-quantize", "-j",
                    str(os.cpu_count() or 2)], check=True)
    if isa == "avx2":  # (static build: ggml's CPU backend is inside llama-bench)
        zmm = zmm_count(bin_dir / "llama-bench")
        if zmm:
            sys.exit(f"{bin_dir / 'llama-bench'} has {zmm} instructions on zmm registers (AVX-512): "
                     f"not an AVX2-only build")
    return bin_dir


def zmm_count(binary: Path) -> int:
    """How many instructions of ``binary`` use a zmm (AVX-512) register."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(binary)], check=True, capture_output=True,
                         text=True).stdout
    return sum("%zmm" in line for line in out.splitlines())


def cpu_flags() -> str:
    """The instruction-set flags of CPU_FLAGS this CPU has (/proc/cpuinfo), and those it lacks."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return "CPU flags unknown"
    have = set(line.partition(":")[2].split())
    return (f"CPU flags {' '.join(f for f in CPU_FLAGS if f in have)} "
            f"(lacks {' '.join(f for f in CPU_FLAGS if f not in have) or 'none'})")


def cpu_model() -> str:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"
    return line.partition(":")[2].strip()


def gguf(checkpoint: str, kind: str, bin_dir: Path) -> Path:
    """The checkpoint as GGUF ``kind`` (BF16 converted by llama.cpp's script; Q8_0, Q4_0 quantized from it)."""
    src = bin_dir.parents[1]
    bf16 = Path(f"{checkpoint}-BF16.gguf")
    if not bf16.is_file():
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), checkpoint, "--outtype", "bf16",
                        "--outfile", str(bf16) + ".tmp"], check=True, env=env)
        os.replace(str(bf16) + ".tmp", bf16)
    if kind == "BF16":
        return bf16
    out = Path(f"{checkpoint}-{kind}.gguf")
    if not out.is_file():
        subprocess.run([str(bin_dir / "llama-quantize"), str(bf16), str(out) + ".tmp", kind], check=True)
        os.replace(str(out) + ".tmp", out)
    return out


def run_llama(bin_dir: Path, model: Path, args) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s): llama-bench's mean over ``--repeat`` runs of each test. The decode runs at
    the prompt's depth (``-d``: its ``--output-len`` tokens after ``--input-len`` in the context, as MILI's decode
    follows its prompt); llama-bench's plain ``-n`` would generate from an empty context, its attention reading
    no KV."""
    def bench(*flags: str) -> dict:  # (llama.cpp's faster of flash attention off and on)
        out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), *flags, "-fa", "0,1", "-t",
                              str(args.threads), "-r", str(args.repeat), "-o", "json"],
                             check=True, capture_output=True, text=True).stdout
        return max(json.loads(out), key=lambda r: r["avg_ts"])

    prefill = bench("-p", str(args.input_len), "-n", "0")
    decode = bench("-p", "0", "-n", str(args.output_len), "-d", str(args.input_len))
    assert prefill["n_prompt"] == args.input_len and decode["n_gen"] == args.output_len
    return prefill["avg_ts"], decode["avg_ts"]


def load_mili(path: str, quantization: str | None, args) -> LLMEngine:
    if args.cpu_isa != "native":  # (main checked the environment; this covers a caller of compare())
        os.environ["MILI_CPU_ISA"] = args.cpu_isa
    return LLMEngine(EngineConfig(model=path, dtype="bfloat16", quantization=quantization,
                                  max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 30, num_threads=args.threads))


def run_mili(engine: LLMEngine, args) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s): ``mili bench latency``'s measure, the median of ``--repeat`` requests."""
    ttft, decode, _ = _measure_latency(engine, random_prompt(args.input_len, 0), args)
    return args.input_len / ttft, decode


def run_llama_depth(bin_dir: Path, model: Path, depth: int, args) -> tuple[float, str]:
    """(decode tok/s, its configuration): llama-bench's best over ``--llama-caches`` (default its KV cache types f16
    and q8_0, flash attention off and on; a quantized V cache needs it on), decoding ``--output-len`` tokens at depth
    ``depth``."""
    best = (0.0, "")
    for cache, fa in (c.split(":") for c in args.llama_caches):
        # (--no-warmup: llama-bench's warm-up run would prefill the whole depth a second time)
        cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(args.output_len), "-d", str(depth),
               "-ctk", cache, "-ctv", cache, "-fa", fa, "-t", str(args.threads), "-r", str(args.repeat), "--no-warmup",
               "-o", "json"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
            hint = (" (llama.cpp's AMX matmul is known to crash on Sapphire Rapids: its issue 20824)"
                    if "amx" in cpu_flags() and done.returncode < 0 else "")
            raise SystemExit(f"llama-bench died ({why}){hint}: {' '.join(cmd)}\n{done.stderr[-2000:]}\n"
                             "rerun with --skip-llama to measure MILI alone")
        out = done.stdout
        best = max(best, (json.loads(out)[0]["avg_ts"], f"{cache} cache, fa {fa}"))
    return best


def synthetic_batch(depth: int, page_size: int):
    """One sequence's batch-1 decode step at position ``depth``, its context on pages 0.. in order."""
    from mili.model.batch import ForwardBatch

    pages, i32 = -(-(depth + 1) // page_size), dict(dtype=torch.int32)
    return ForwardBatch(input_ids=torch.tensor([11]), positions=torch.tensor([depth]),
                        slot_mapping=torch.tensor([depth]), page_table=torch.arange(pages)[None], query_lens=[1],
                        context_lens=[depth + 1], num_decodes=1, logits_indices=torch.tensor([0]),
                        context_lens_t=torch.tensor([depth + 1], **i32), query_lens_t=torch.tensor([1], **i32),
                        query_start_t=torch.tensor([0], **i32))


def synthetic_decode(engine: LLMEngine, depth: int, steps: int) -> float:
    """Decode tok/s of ``steps`` batch-1 decode steps at ``depth`` tokens, run as the model runner runs one (the C
    decode layers over the pages, the head, the argmax) without the engine around it, over pages holding random K/V
    (filled here: untouched zero pages would all read one shared page)."""
    from mili.kernels.cpu import ops
    from mili.kernels.cpu.ops import Int8Pages

    parts = engine.core.runner.parts
    page_size = parts.kv_caches[0][0].shape[2]
    pages = -(-(depth + 1) // page_size)
    g = torch.Generator().manual_seed(0)
    for layer in parts.kv_caches:
        for cache in layer:
            if isinstance(cache, Int8Pages):
                cache.values[:pages] = torch.randint(-127, 128, cache.values[:pages].shape, dtype=torch.int8,
                                                     generator=g)
                cache.scales[:pages] = torch.rand(cache.scales[:pages].shape, generator=g) / 64
            else:
                cache[:pages] = torch.randn(cache[:pages].shape, generator=g).to(cache.dtype)
    batch = synthetic_batch(depth, page_size)
    assert parts.cpu_decode is not None and parts.cpu_decode.available, "the fused C decode step does not run"

    def step() -> None:
        ops.argmax(parts.model.compute_logits(parts.cpu_decode.run(batch, parts.kv_caches)))

    with torch.inference_mode():
        for _ in range(2):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return steps / (time.perf_counter() - start)


def depth_compare(spec: str, bin_dir: Path | None, args) -> None:
    """Batch-1 decode after each of ``--depths`` tokens: MILI's bf16 and int8 pages (each engine loaded once a depth,
    its prompt prefilled once and kept in its prefix cache), llama.cpp's best cache (unless --skip-llama), in
    ``--rounds`` rounds, the MILI engines' order swapped each round, with a copy measure each."""
    from mili.tools.bench import _run, step_bytes

    name, _, layers = spec.partition(":")
    dense = qwen3_checkpoint(name, layers=int(layers) if layers else None)
    if args.depth_weights != "BF16" and bin_dir is None:
        sys.exit(f"--depth-weights {args.depth_weights} needs llama.cpp (its llama-quantize makes the file)")
    weights = gguf(dense, args.depth_weights, bin_dir) if bin_dir is not None else None
    mili_model = dense if args.depth_weights == "BF16" else str(weights)  # (Q8_0: MILI reads the GGUF file too)
    torch.set_num_threads(args.threads)
    rows = []
    for depth in args.depths:
        prompt = random_prompt(depth, 0)
        # (bw: the mean of copies measured just before and just after each MILI run, that run's roofline: this VM's
        # rate moves over minutes)
        got, step, engines = {"bf16": [], "int8": [], "llama": [], "bw": {"bf16": [], "int8": []}}, {}, {}
        tokens = depth + args.output_len + 32
        for kv in ("bf16", "int8"):
            engines[kv] = LLMEngine(EngineConfig(
                model=mili_model, dtype="bfloat16", max_model_len=tokens, kv_cache_dtype="auto" if kv == "bf16" else kv,
                num_kv_pages=-(-tokens // 16) + 4, num_threads=args.threads))
            if not args.synthetic:
                _run(engines[kv], [prompt], [1])  # the prefill, once: the prompt stays in the prefix cache
            parts = step_bytes(engines[kv].core.runner, depth + args.output_len // 2)  # (the decode's middle step)
            step[kv] = parts["weights"] + parts["kv"]
        for r in range(args.rounds):
            for kv in (("bf16", "int8") if r % 2 == 0 else ("int8", "bf16")):
                before = memory_bandwidth()
                if args.synthetic:
                    got[kv].append(synthetic_decode(engines[kv], depth, args.output_len))
                else:
                    decode = []  # [seconds, tokens] of the steps after the first token
                    _run(engines[kv], [prompt], [args.output_len], decode)
                    got[kv].append(decode[1] / decode[0])
                got["bw"][kv].append((before + memory_bandwidth()) / 2)
            if bin_dir is not None and not args.skip_llama:
                got["llama"].append(run_llama_depth(bin_dir, weights, depth, args))
        del engines
        gc.collect()
        b16, i8, bw = got["bf16"], got["int8"], got["bw"]["bf16"] + got["bw"]["int8"]
        row = [str(depth), spread(b16, "{:.1f}"), spread(i8, "{:.1f}"),
               spread([i / b for i, b in zip(i8, b16)], unit="x"),
               spread([100 * x * step["bf16"] / c for x, c in zip(b16, got["bw"]["bf16"])], "{:.0f}", "%"),
               spread([100 * x * step["int8"] / c for x, c in zip(i8, got["bw"]["int8"])], "{:.0f}", "%"),
               f"{step['bf16'] / 1e9:.3f} / {step['int8'] / 1e9:.3f}"]
        if got["llama"]:
            llama = [t for t, _ in got["llama"]]
            row += [spread(llama, "{:.1f}") + f" ({'; '.join(sorted({c for _, c in got['llama']}))})",
                    spread([i / x for i, x in zip(i8, llama)], unit="x")]
        rows.append(row)
    how = "steps run by hand over random pages (--synthetic)" if args.synthetic else "after a prefilled prompt"
    print(f"\n{spec} (random weights, {'bf16' if args.depth_weights == 'BF16' else 'the same Q8_0 file'}): batch-1 decode of {args.output_len} tokens after each depth ({how}), "
          f"{args.threads} threads, {args.rounds} rounds; copy {spread([b / 1e9 for b in bw], '{:.1f}')} GB/s "
          f"(the last depth's); {machine()}; {cpu_model()}, {cpu_flags()}; "
          f"MILI_CPU_ISA={os.environ.get('MILI_CPU_ISA') or '(unset)'}")
    headers = ["depth", "MILI bf16 pages tok/s", "MILI int8 pages tok/s", "int8 / bf16", "bf16, of roofline",
               "int8, of roofline", "GB a step (bf16 / int8)"]
    if bin_dir is not None and not args.skip_llama:
        headers += ["llama.cpp best tok/s (its cache)", "MILI int8 / llama.cpp"]
    print_table(f"KV cache formats at depth, {spec} (each cell: the rounds' median, and their range)", headers, rows)


def spread(values: list[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """The median of ``values`` and their range: 1.05x (0.98-1.12)."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)}{unit} ({fmt.format(lo)}-{fmt.format(hi)})" if len(values) > 1 else fmt.format(mid) + unit


def compare(spec: str, bin_dir: Path, args) -> None:
    """Per format: MILI's engine loaded once, then ``--rounds`` paired rounds, each one MILI measure and one
    llama-bench run back to back (their order swapped every round) and a copy roofline beside them. A round's
    ratio compares two figures taken within the same half minute, so the machine's slower minutes (its memory
    bandwidth moves by ±20% over minutes) fall on both engines alike; the table gives the rounds' median and range."""
    name, _, layers = spec.partition(":")
    dense = qwen3_checkpoint(name, layers=int(layers) if layers else None)
    pairs = SAME_FILE_PAIRS if args.same_file else PAIRS
    models = {kind: gguf(dense, kind, bin_dir) for _, _, kind in pairs}
    checkpoints = {"dense": dense} if args.same_file else {"dense": dense, "awq": _quantized_copy(dense, "awq")}
    rows, copies = [], []
    torch.set_num_threads(args.threads)
    for label, (ckpt, quantization), kind in pairs:
        engine = load_mili(str(models[kind]) if ckpt == "gguf" else checkpoints[ckpt], quantization, args)
        step, llama_bytes = weight_bytes_per_step(engine.core.runner.parts.model), models[kind].stat().st_size
        got = {"mili": [], "llama": [], "bw": []}  # per round: (prefill, decode); copy B/s
        for r in range(args.rounds):
            got["bw"].append(memory_bandwidth())
            for who in (("mili", "llama") if r % 2 == 0 else ("llama", "mili")):
                got[who].append(run_mili(engine, args) if who == "mili" else run_llama(bin_dir, models[kind], args))
        del engine
        gc.collect()
        copies += got["bw"]
        (mp, md), (lp, ld) = (list(zip(*got[who])) for who in ("mili", "llama"))
        rows.append([label, spread(md, "{:.1f}"), spread(ld, "{:.1f}"),
                     spread([m / x for m, x in zip(md, ld)], unit="x"),
                     spread([100 * m * step / b for m, b in zip(md, got["bw"])], "{:.0f}", "%"),
                     spread([100 * x * llama_bytes / b for x, b in zip(ld, got["bw"])], "{:.0f}", "%"),
                     f"{step / 1e9:.3f} / {llama_bytes / 1e9:.3f}",
                     f"{statistics.median(mp):.0f} / {statistics.median(lp):.0f}",
                     spread([m / x for m, x in zip(mp, lp)], unit="x")])
    print(f"\n{spec} (random weights): prompt {args.input_len}, {args.output_len} tokens, batch 1, "
          f"{args.threads} threads each, {args.rounds} paired rounds of {args.repeat} runs an engine; {machine()}; "
          f"llama.cpp from llama-cpp-python {args.llama_cpp_python}; copy {spread([b / 1e9 for b in copies], '{:.1f}')} GB/s")
    build, isa_flags = LLAMA_ISA[args.cpu_isa]
    print(f"ISA path {args.cpu_isa}: MILI with MILI_CPU_ISA={os.environ.get('MILI_CPU_ISA') or '(unset)'}, "
          f"torch {torch.backends.cpu.get_cpu_capability()}; llama.cpp's {args.cpu_isa} build ({build}/: "
          f"{' '.join(f.removeprefix('-D') for f in isa_flags if not f.endswith('=OFF'))}"
          f"{', GGML_NATIVE and the other ISA options OFF' if any(f.endswith('=OFF') for f in isa_flags) else ''}); "
          f"{cpu_model()}, {cpu_flags()}")
    print_table(f"MILI vs llama.cpp, {spec} (each cell: the rounds' median, and their range)", [
        "MILI / llama.cpp format", "MILI decode tok/s", "llama.cpp decode tok/s", "decode ratio",
        "MILI, of copy roofline", "llama.cpp, of copy roofline", "GB a step (MILI / llama.cpp)",
        "prefill tok/s (MILI / llama.cpp)", "prefill ratio"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["Qwen3-0.6B", "Qwen3-4B:8"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4, help="paired rounds a format (MILI and llama.cpp back to back)")
    p.add_argument("--llama-cpp-python", default="0.3.36", help="the sdist whose vendored llama.cpp is built")
    p.add_argument("--same-file", action="store_true",
                   help="both engines read the same GGUF files (Q8_0, Q4_0, Q4_K_M from llama-quantize), MILI "
                        "through its GGUF loader")
    p.add_argument("--depths", type=int, nargs="+", default=None,
                   help="measure batch-1 decode after each of these many tokens, MILI's bf16 and int8 KV pages (and "
                        "llama.cpp's best cache), instead of the format pairs")
    p.add_argument("--depth-weights", choices=["BF16", "Q8_0"], default="BF16",
                   help="--depths: the weights: MILI's bf16 checkpoint and llama.cpp's BF16 GGUF, or both engines on "
                        "the same Q8_0 GGUF file (MILI through its GGUF loader)")
    p.add_argument("--llama-caches", nargs="+", default=["f16:0", "f16:1", "q8_0:1"],
                   help="--depths: llama.cpp's KV cache type and flash attention (0/1) to try, the best kept")
    p.add_argument("--skip-llama", action="store_true",
                   help="--depths: MILI alone (llama.cpp not run; built only where --depth-weights Q8_0 needs its "
                        "quantizer)")
    p.add_argument("--synthetic", action="store_true",
                   help="--depths: MILI's decode steps run by hand over random pages, no prefill (see above)")
    p.add_argument("--cpu-isa", choices=list(LLAMA_ISA), default="native",
                   help="native: each engine's best path; avx2: both held to AVX2 (run with MILI_CPU_ISA=avx2 "
                        "ATEN_CPU_CAPABILITY=avx2 in the environment)")
    args = p.parse_args()
    if args.depths is None and args.input_len + args.output_len > MAX_MODEL_LEN:
        p.error(f"--input-len + --output-len must be at most {MAX_MODEL_LEN}")
    env_isa = os.environ.get("MILI_CPU_ISA", "")
    how = (f"MILI_CPU_ISA={args.cpu_isa} ATEN_CPU_CAPABILITY={args.cpu_isa} python {' '.join(sys.argv)}"
           if args.cpu_isa != "native" else "with MILI_CPU_ISA unset"
           + (f", or pass --cpu-isa {env_isa}" if env_isa in LLAMA_ISA else ""))
    if env_isa != ("" if args.cpu_isa == "native" else args.cpu_isa):
        sys.exit(f"--cpu-isa {args.cpu_isa} but MILI_CPU_ISA={env_isa or '(unset)'} in the environment: "
                 f"run {how}")
    if args.cpu_isa == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "DEFAULT"):
        sys.exit(f"--cpu-isa avx2 but torch runs {torch.backends.cpu.get_cpu_capability()} kernels (it reads "
                 f"ATEN_CPU_CAPABILITY at import): run {how}")
    if args.depths is not None and args.skip_llama and args.depth_weights == "BF16":
        for spec in args.models:
            depth_compare(spec, None, args)
        return
    if shutil.which("cmake") is None:
        sys.exit("needs cmake and a C++ compiler (apt-get install cmake g++)")
    if importlib.util.find_spec("sentencepiece") is None:  # llama.cpp's converter imports it for Qwen's vocab
        sys.exit("llama.cpp's convert_hf_to_gguf.py needs sentencepiece: pip install sentencepiece")
    bin_dir = llama_cpp(args.llama_cpp_python, args.cpu_isa)
    for spec in args.models:
        if args.depths is not None:
            depth_compare(spec, bin_dir, args)
        else:
            compare(spec, bin_dir, args)


if __name__ == "__main__":
    main()
