"""Quantized checkpoints in their exact on-disk layouts (Qwen's block FP8, AutoAWQ's GEMM packing), made from a
dense checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch


def write_quantized_checkpoint(dense: Path, dest: Path, tensors: dict, qconfig: dict) -> Path:
    """A copy of checkpoint ``dense`` holding ``tensors`` and declaring ``qconfig`` in its config.json."""
    import json
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(dense, dest)
    save_file(tensors, dest / "model.safetensors")
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


QUANT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def autoawq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM packing, as it is written there: [rows, cols] 4-bit -> [rows, cols / 8] int32,
    word nibble i holding column order_map[i] of its 8."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    return packed


def awq_layout(weights: dict, group: int) -> tuple[dict, dict]:
    """(AutoAWQ's GEMM layout, the dequantized weights): asymmetric 4-bit per group of input channels."""
    from mili.model.quant import quantize_awq

    out, dequantized = {}, {}
    for name, w in weights.items():
        if not name.endswith(tuple(f"{p}.weight" for p in QUANT_LINEARS)):
            out[name] = dequantized[name] = w
            continue
        q, zeros, scales = quantize_awq(w, group)  # AWQ stores [in, out]
        k, n = q.shape
        stem = name.removesuffix("weight")
        out[stem + "qweight"] = autoawq_pack(q)
        out[stem + "qzeros"] = autoawq_pack(zeros)
        out[stem + "scales"] = scales
        deq = (q.reshape(k // group, group, n) - zeros[:, None]).float() * scales.float()[:, None]
        dequantized[name] = deq.reshape(k, n).t().contiguous()
    return out, dequantized
