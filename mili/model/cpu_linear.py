"""Linear layers for the CPU, swapped in after loading (the model code does not branch on them).

* ``PackedLinear``: bf16 weights reordered once into oneDNN's blocked layout (what torch.compile's
  freezing pass does), ~1.4x faster matrix-vector products than aten's linear on plain weights.
* ``Int8Linear``: weight-only int8 with one scale per output channel (symmetric, round to nearest),
  through aten's ``_weight_int8pack_mm``: half the bytes of bf16 per decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mili.errors import InvalidRequest


class _SwappedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, shard_sizes: list[int] | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.shard_sizes = shard_sizes  # kept for fused projections (qkv, gate_up)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x.reshape(-1, self.in_features))
        return out.reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PackedLinear(_SwappedLinear):
    def __init__(self, weight, bias=None, shard_sizes=None):
        super().__init__(weight, bias, shard_sizes)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def _matmul(self, x2d):
        return torch.ops.mkldnn._linear_pointwise(x2d, self.packed, self.bias, "none", [], "")


class Int8Linear(_SwappedLinear):
    def __init__(self, weight, bias=None, shard_sizes=None):
        super().__init__(weight, bias, shard_sizes)
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(weight.dtype))

    def _matmul(self, x2d):
        x2d = x2d.to(self.scales.dtype)
        if x2d.shape[0] > 8:  # prefill: the int8 kernel is slow on many rows; dequantize once instead
            return F.linear(x2d, self.qweight.to(x2d.dtype) * self.scales[:, None], self.bias)
        out = torch.ops.aten._weight_int8pack_mm(x2d, self.qweight, self.scales)
        return out if self.bias is None else out + self.bias


def prepack_available(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def swap_linears(model: nn.Module, kind: str) -> None:
    """Replace every nn.Linear of ``model`` (and its lm_head, tied or not) with ``kind``: packed | int8."""
    cls = {"packed": PackedLinear, "int8": Int8Linear}.get(kind)
    if cls is None:
        raise InvalidRequest(f"unknown linear kind {kind!r}", param="quantization")
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):  # FusedLinear too (its shard sizes are kept)
                setattr(module, child_name, cls(child.weight, child.bias, getattr(child, "shard_sizes", None)))
    # A tied head stays on the embedding table (plain layout): a packed copy would cost another
    # vocab x hidden matrix of memory (311 MB for Qwen3-0.6B) for ~4 ms per decode step. int8 halves
    # the bytes the head reads, so it gets its own (smaller) copy.
    if model.lm_head is None and kind == "int8":
        model.lm_head = cls(model.model.embed_tokens.weight)
