"""Where a batch-1 decode step after a long context goes, on the CPU: the whole step (the C decode layers, the head,
the argmax, as llamacpp_compare.py --synthetic runs it), the layers alone, the head and argmax alone, the attention
alone (``mili_decode_attention`` over each layer's own pages of the same engine), and the same step at depth 0 (the
weights' part: the linears, norms and head). The same Q8_0 GGUF file of the Qwen3-0.6B shape as llamacpp_compare.py's
``--depth-weights Q8_0`` (built with llama.cpp's quantizer on first use), random K/V in the pages, a copy measured
before each round; the roofline is the bytes a step reads over the copy rate.

    python benchmarks/step_parts.py [--depth 16384] [--kv int8|bf16] [--rounds 4] [--threads 2] [--cycles 25]

Each part: 8 calls a round after one warm call, the rounds' median and range in ms. Then the whole step against
the copy in the same moments (this VM's bandwidth moves from one minute to the next): ``--cycles`` cycles of two
whole steps and one copy (1 GiB, read + write, as ``mili bench``'s roofline), the steps' total rate over the
copies', three times.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from common import machine, print_table, qwen3_checkpoint
from llamacpp_compare import cpu_flags, gguf, llama_cpp, synthetic_batch, synthetic_decode

from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.kernels.cpu import ops
from mili.tools.bench import memory_bandwidth, step_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=16384)
    p.add_argument("--kv", choices=["int8", "bf16"], default="int8")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cycles", type=int, default=25, help="interleaved cycles of two steps and one copy")
    p.add_argument("--llama-cpp-python", default="0.3.36", help="the sdist whose llama-quantize makes the Q8_0 file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    weights = gguf(qwen3_checkpoint("Qwen3-0.6B"), "Q8_0", llama_cpp(args.llama_cpp_python))
    tokens = args.depth + 64
    engine = LLMEngine(EngineConfig(model=str(weights), dtype="bfloat16", max_model_len=tokens,
                                    kv_cache_dtype="auto" if args.kv == "bf16" else args.kv,
                                    num_kv_pages=-(-tokens // 16) + 4, num_threads=args.threads))
    parts = engine.core.runner.parts
    size = step_bytes(engine.core.runner, args.depth)
    synthetic_decode(engine, args.depth, 1)  # (fills the pages with random K/V)
    fused, kv = parts.cpu_decode, parts.kv_caches
    page_size = kv[0][0].shape[2]
    deep, shallow = synthetic_batch(args.depth, page_size), synthetic_batch(0, page_size)
    cfg = parts.model_config
    hq, d = cfg.num_attention_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, cfg.hidden_size, generator=g).to(torch.bfloat16)
    q = torch.randn(1, hq * d, generator=g).to(torch.bfloat16)
    out = torch.empty(1, hq * d, dtype=torch.bfloat16)
    table, lens = ops.decode_metadata(deep.page_table, deep.context_lens, 1)
    seqs = ops.seq_pages(table, lens)

    def attention() -> None:
        pages = fused._pages(kv)
        for i in range(len(kv)):
            fused.lib.mili_decode_attention(q.data_ptr(), hq * d, hq, d ** -0.5, ctypes.byref(pages[i]),
                                            ctypes.byref(seqs), out.data_ptr(), args.threads)

    calls = {
        "whole step": lambda: ops.argmax(parts.model.compute_logits(fused.run(deep, kv))),
        "decode layers": lambda: fused.run(deep, kv),
        "head + argmax": lambda: ops.argmax(parts.model.compute_logits(hidden)),
        "attention alone": attention,
        "whole step at depth 0": lambda: ops.argmax(parts.model.compute_logits(fused.run(shallow, kv))),
    }
    ms, copies = {name: [] for name in calls}, []
    with torch.inference_mode():
        for _ in range(args.rounds):
            copies.append(memory_bandwidth())
            for name, call in calls.items():
                call()
                start = time.perf_counter()
                for _ in range(8):
                    call()
                ms[name].append((time.perf_counter() - start) / 8 * 1e3)
    copy = statistics.median(copies)
    gb = {"whole step": size["weights"] + size["kv"], "decode layers": None, "head + argmax": None,
          "attention alone": size["kv"], "whole step at depth 0": size["weights"]}
    rows = []
    for name, got in ms.items():
        mid = statistics.median(got)
        share = f"{100 * gb[name] / copy / (mid / 1e3):.0f}%" if gb[name] else ""
        rows.append([name, f"{mid:.1f} ({min(got):.1f}-{max(got):.1f})", f"{gb[name] / 1e9:.3f}" if gb[name] else "",
                     share])
    print(f"\nQwen3-0.6B shape, the Q8_0 file, {args.kv} KV pages, batch 1 at depth {args.depth}, {args.threads} "
          f"threads, {args.rounds} rounds; copy {copy / 1e9:.1f} GB/s ({min(copies) / 1e9:.1f}-"
          f"{max(copies) / 1e9:.1f}); {machine()}; {cpu_flags()}")
    print_table("a decode step's parts", ["part", "ms (median, range)", "GB read", "of the copy roofline"], rows)
    src = torch.ones(1 << 28)  # (1 GiB of float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rows = []
    with torch.inference_mode():
        for rep in range(3):
            step_s = copy_s = 0.0  # (the cycles' seconds in the steps and in the copies)
            for _ in range(args.cycles):
                start = time.perf_counter()
                calls["whole step"]()
                calls["whole step"]()
                middle = time.perf_counter()
                dst.copy_(src)
                step_s, copy_s = step_s + middle - start, copy_s + time.perf_counter() - middle
            step_rate, copy_rate = 2 * args.cycles * gb["whole step"] / step_s, args.cycles * 2 * (1 << 30) / copy_s
            rows.append([str(rep + 1), f"{step_s / (2 * args.cycles) * 1e3:.1f}", f"{step_rate / 1e9:.1f}",
                         f"{copy_rate / 1e9:.1f}", f"{100 * step_rate / copy_rate:.0f}%"])
    print_table(f"the whole step and the copy interleaved ({args.cycles} cycles of two steps and one 1 GiB copy)",
                ["run", "step ms (mean)", "step GB/s", "copy GB/s", "of the copy roofline"], rows)


if __name__ == "__main__":
    main()
