"""Where a step's time goes, on the GPU session's checkpoint (Qwen3-0.6B shape, random bf16; see gpu_session.py):

  1. batch-1 decode after a 512-token prompt, 128 greedy tokens: the wall time a token, the GPU's busy time a
     token (torch.profiler's CUDA kernel time summed), the kernels a token, and the top kernels;
  2. the same run under cProfile: the host functions by own time (what the Python of a step costs);
  3. nano-vllm's workload cut to 128 sequences under cProfile (the batch case's host time).

    python benchmarks/profile_step.py [--device cuda] [--top 25] [--out DIR]

A GPU busy well under the wall time says the step is bound by the host (Python, launches); near it, by the
kernels. Prints tables; with --out also writes the whole pstats listings there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _stats(prof: cProfile.Profile, top: int, out: Path | None, name: str) -> None:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime")
    st.print_stats(top)
    text = buf.getvalue()
    print("\n".join(line for line in text.splitlines() if line.strip())[-6000:])
    if out is not None:
        full = io.StringIO()
        pstats.Stats(prof, stream=full).sort_stats("cumulative").print_stats(120)
        (out / f"{name}.txt").write_text(text + "\n\n" + full.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out) if args.out else None
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gpu_session import build_checkpoint

    from mili import LLM, SamplingParams

    tiny = args.device == "cpu"
    path, _ = build_checkpoint(tiny, args.device)
    llm = LLM(path, dtype="float32" if tiny else "bfloat16", device=args.device, max_model_len=4096, seed=0)
    g = torch.Generator().manual_seed(0)
    prompt = {"prompt_token_ids": torch.randint(0, 151643, (512,), generator=g).tolist()}
    n_out = 128
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n_out)
    llm.generate([prompt], params, use_tqdm=False)  # warm
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - start
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        llm.generate([prompt], params, use_tqdm=False)
    if args.device.startswith("cuda"):
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in events) / 1e6
        print(f"batch-1, 512-token prompt, {n_out} out: wall {wall / n_out * 1e3:.3f} ms a token; GPU busy "
              f"{busy / n_out * 1e3:.3f} ms a token ({busy / wall:.0%} of the wall, under the profiler); "
              f"{len(events) / n_out:.1f} kernels a token")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    else:
        print(f"batch-1: wall {wall / n_out * 1e3:.3f} ms a token")
    prof1 = cProfile.Profile()
    prof1.enable()
    llm.generate([prompt], params, use_tqdm=False)
    prof1.disable()
    print("== batch-1 decode, host functions by own time ==")
    _stats(prof1, args.top, out, "batch1")
    rng = random.Random(0)
    n = 16 if tiny else 128
    prompts = [{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]} for _ in range(n)]
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024)) for _ in range(n)]
    start = time.perf_counter()
    prof2 = cProfile.Profile()
    prof2.enable()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    prof2.disable()
    took = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"== nano-vllm's workload, {n} sequences: {tokens} output tokens in {took:.1f} s under cProfile "
          f"({tokens / took:.0f} tok/s), host functions by own time ==")
    _stats(prof2, args.top, out, "batch")


if __name__ == "__main__":
    main()
