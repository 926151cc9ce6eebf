"""The layers as loaded: aten's linear on the model's dtype (``plain``; a quantized checkpoint's weights dequantized
as they load), or bf16 weights reordered once into oneDNN's blocked layout (``packed``: where MILI's kernels don't
load and oneDNN's bf16 packing runs, ``cpu_linear.PackedLinear``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mili.model.cpu_linear import PackedLinear, bf16_head, swap_linears
from mili.model.formats.base import LinearFormat


@dataclass(frozen=True)
class Plain(LinearFormat):
    name = "plain"
    summary = "the layers as loaded, on aten's linear (a quantized checkpoint's weights dequantized)"

    def bytes_per_weight(self, dtype):
        return dtype.itemsize

    def apply(self, model, quantized, skip_head):
        pass  # (nothing to swap: a tied head stays on the plain table)

    def apply_head(self, model):
        pass  # (the head as loaded: the model's dtype)


def packed_layer(weight, bias=None, shard_sizes=None):
    """oneDNN's blocked bf16 (the plan chose it where it runs) for a bf16 layer; None (the layer stays aten's) for
    another dtype."""
    return PackedLinear(weight, bias, shard_sizes) if weight.dtype == torch.bfloat16 else None


@dataclass(frozen=True)
class Packed(LinearFormat):
    name = "packed"
    summary = "bf16 weights packed once in oneDNN's blocked layout (aten's linear elsewhere)"

    def bytes_per_weight(self, dtype):
        return dtype.itemsize

    def apply(self, model, quantized, skip_head):
        # (a tied head stays on the plain table: a packed copy would cost another vocab x hidden matrix)
        swap_linears(model, packed_layer, skip_head=skip_head)

    def apply_head(self, model):
        bf16_head(model, kernels=False, prepack=True)
