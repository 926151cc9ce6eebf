"""A short benchmark: batch-1 decode, a prefill, a batched decode, the device's copy roofline (read + write
bytes a second of a large copy) and each decode figure's share of it (the bytes a step reads, the weights,
times steps a second). ``quick``: the tiny checkpoint, a few tokens; else a Qwen3-0.6B-shaped random model in
bf16, a 512-token prefill, batch 1 and 64 decode."""

from __future__ import annotations

import time
from pathlib import Path

import torch

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes moved a second (read + write, as STREAM counts) by copying ``mib`` MiB on ``device``."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * 4 * n / (time.perf_counter() - start)


def build_06b(path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mili.model.demo import build_demo_tokenizer

    cfg = Qwen3Config(max_position_embeddings=4096, rope_theta=1000000.0, **QWEN3_06B)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    build_demo_tokenizer().save_pretrained(path)
    return path


def formats(quick: bool) -> list[tuple[str, dict]]:
    """(label, engine arguments) of the weight formats measured: bf16; and, but for ``quick``, the
    checkpoint quantized as it loads (FP8 per channel: torch._scaled_mm on SM 89+; int8: the Triton int8 GEMM on
    CUDA)."""
    found = [("bf16", {})]
    return found if quick else found + [("fp8", {"quantization": "fp8"}), ("int8", {"quantization": "int8"})]


def measure(path: Path, device: str, quick: bool) -> list[tuple[str, str]]:
    """(figure, value) rows: the copy roofline once, then each format's prefill and decode figures."""
    import gc

    rows = []
    bandwidth = None
    for label, extra in formats(quick):
        found, bandwidth = _measure_one(path, device, quick, label, extra, bandwidth)
        rows += found
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _measure_one(path: Path, device: str, quick: bool, label: str, extra: dict, bandwidth: float | None):
    from mili import LLM
    from mili.tools.bench import _run, weight_bytes_per_step

    prefill_len, decode_tokens, batch = (64, 16, 8) if quick else (512, 64, 64)
    llm = LLM(str(path), dtype="bfloat16", device=device, max_num_seqs=max(batch, 8),
              kv_cache_memory=(64 if quick else 1024) * 2**20, enable_prefix_caching=False, **extra)
    engine = llm.engine
    rows = []
    if bandwidth is None:
        bandwidth = copy_bandwidth(engine.core.runner.parts.device, 64 if quick else 1024)
        rows.append(("copy roofline", f"{bandwidth / 1e9:.1f} GB/s"))
    step_bytes = weight_bytes_per_step(engine.core.runner.parts.model)
    rows.append((f"{label}: weights read a decode step",
                 f"{step_bytes / 2**20:.1f} MiB ({engine.core.runner.parts.plan.weight_format})"))
    vocab = engine.core.runner.parts.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    for length in (8, prefill_len):  # warm-up: the kernels a decode and the prefill launch compile first
        _run(engine, [torch.randint(0, min(vocab, 256), (length,), generator=g).tolist()], [4])
    prompt = torch.randint(0, min(vocab, 256), (prefill_len,), generator=g).tolist()
    _, seconds = _run(engine, [prompt], [1])
    rows.append((f"{label}: prefill {prefill_len} tokens", f"{prefill_len / seconds:.0f} tok/s"))
    for b in (1, batch) if label == "bf16" else (1,):
        stats: list = []
        prompts = [torch.randint(0, min(vocab, 256), (8,), generator=g).tolist() for _ in range(b)]
        _run(engine, prompts, [decode_tokens] * b, stats)
        secs, tokens = stats
        steps = tokens / b / secs if secs else 0.0
        share = step_bytes * steps / bandwidth
        rows.append((f"{label}: decode batch {b}", f"{tokens / secs:.0f} tok/s ({steps:.0f} steps/s, "
                                                    f"{100 * share:.1f}% of the copy roofline)"))
    return rows, bandwidth
