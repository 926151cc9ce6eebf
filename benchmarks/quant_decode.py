"""Batch-1 decode on the CPU in every weight format MILI reads, one run: bf16, int8 (``--quantization
int8``), FP8 (a Qwen block-FP8 checkpoint: requantized onto the int8 kernel in bf16) and AWQ int4 (an AWQ
GEMM checkpoint on the int4 kernel; its bf16 lm_head on the int8 kernel, ``--lm-head-dtype auto``, and kept
bf16 for comparison), each with the bytes of weights a decode step reads (the head as it is read) and its
share of the memory-copy roofline over those bytes, the copy taken with the model's thread count.

    python benchmarks/quant_decode.py [--models Qwen3-0.6B Qwen3-4B:8] [--output-len 32] [--repeat 3]
                                      [--num-threads 1 2]

``--num-threads 1 2`` runs the table once per thread count (each with its own copy roofline): one thread
is steady on a machine with other load; two is what users (and llama.cpp's -t 2) see.

``NAME:L`` cuts a shape to L decoder layers. The FP8 and AWQ checkpoints are made from the bf16 random one
(cached beside it) in the exact on-disk layouts (mili/model/quant.py), as a quantizer would write them.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
from pathlib import Path

import torch
from common import machine, print_table, qwen3_checkpoint, random_prompt
from safetensors import safe_open
from safetensors.torch import save_file

from mili.tools.bench import _measure_latency, weight_bytes_per_step
from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.model import quant

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized_copy(dense: str, kind: str) -> str:
    """The bf16 checkpoint in Qwen's block-FP8 layout (fp8) or AutoAWQ's GEMM layout (awq), made once."""
    dest = Path(f"{dense}-{kind}")
    if (dest / "model.safetensors").is_file():
        return str(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(dense, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    out = {}
    files = sorted(Path(dense).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                if not name.endswith(tuple(f"{p}.weight" for p in LINEARS)):
                    out[name] = w
                elif kind == "fp8":
                    out[name], out[name + "_scale_inv"] = quant.quantize_fp8_blocks(w, scale_dtype=torch.bfloat16)
                else:
                    q, zeros, scales = quant.quantize_awq(w, 128)
                    stem = name.removesuffix("weight")
                    out[stem + "qweight"], out[stem + "qzeros"] = quant.pack_awq(q), quant.pack_awq(zeros)
                    out[stem + "scales"] = scales
    save_file(out, str(tmp / "model.safetensors"))
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]} if kind == "fp8" else
                                  {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                                   "zero_point": True})
    (tmp / "config.json").write_text(json.dumps(cfg))
    tmp.rename(dest)
    return str(dest)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["Qwen3-0.6B", "Qwen3-4B:8"])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--num-threads", type=int, nargs="+", default=[None],
                   help="threads for the model and the copy, a table for each (1 is steady on a machine with other "
                        "load); default: torch's")
    args = p.parse_args()
    for threads in args.num_threads:
        if threads:
            torch.set_num_threads(threads)
        run_shapes(argparse.Namespace(**{**vars(args), "num_threads": threads}))


def run_shapes(args) -> None:
    for spec in args.models:
        name, _, layers = spec.partition(":")
        dense = qwen3_checkpoint(name, layers=int(layers) if layers else None)
        awq = _quantized_copy(dense, "awq")
        formats = {"bf16": (dense, None, "auto"), "int8": (dense, "int8", "auto"),
                   "fp8 (Qwen block FP8 checkpoint)": (_quantized_copy(dense, "fp8"), None, "auto"),
                   "awq int4 (AWQ checkpoint)": (awq, None, "auto"),
                   "awq int4, lm_head kept bf16": (awq, None, "bf16")}
        prompt = random_prompt(args.input_len, 0)
        rows = []
        for label, (path, quantization, head) in formats.items():
            engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", quantization=quantization,
                                            lm_head_dtype=head,
                                            max_model_len=1024, kv_cache_memory=1 << 30,
                                            num_threads=args.num_threads))
            ttft, decode, bandwidth = _measure_latency(engine, prompt, args)
            step = weight_bytes_per_step(engine.core.runner.parts.model)
            roofline = bandwidth / step
            rows.append([label, engine.core.runner.parts.plan.weight_format, step / 1e9, decode, roofline,
                         f"{100 * decode / roofline:.0f}%"])
            del engine
            gc.collect()
        base = rows[0][3]
        for row in rows:
            row.append(f"{row[3] / base:.2f}x")
        threads = torch.get_num_threads()
        print(f"\n{spec} (random weights), prompt {args.input_len}, {args.output_len} greedy tokens, batch 1, "
              f"median of {args.repeat}, {threads} threads; {machine()}; roofline = 1 GiB copy bandwidth (read + "
              f"write, {threads} threads, measured before each repeat) / weight bytes per step")
        print_table(f"decode, {spec}, {threads} threads", ["format", "computes as", "GB/step", "decode tok/s",
                                                            "roofline tok/s", "of roofline", "vs bf16"], rows, digits=3)

if __name__ == "__main__":
    main()
