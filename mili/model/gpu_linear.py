"""Linear layers on the Triton GEMMs (mili/kernels/triton/quant_gemm.py): a quantized checkpoint's, the weights
kept as the checkpoint stores them, and ``--quantization int8``'s: on CUDA, and on the CPU under
TRITON_INTERPRET=1 (the Triton backend's path, for tests).

* ``BlockFp8Linear``: FP8 e4m3 weights with a float32 scale per block (Qwen's 128 x 128, or per output
  channel); W8A8 (activations quantized per token and group of 128) on GPUs with FP8, weight-only elsewhere.
* ``AwqLinear``: AWQ's int4 weights (a zero point and scale per group of input channels), dequantized in
  the GEMM.
* Per-channel FP8 (compressed-tensors) on GPUs with FP8: ``cpu_linear.Fp8Linear`` (torch._scaled_mm).
* ``TritonInt8Linear``: ``--quantization int8`` (and ``fp8`` before SM 89, through FP8 and back first): int8
  weights quantized as they load, one float32 scale per output channel (as ``cpu_linear.Int8Linear``'s), on the
  weight-only int8 GEMM.

``quantized_layer`` picks the layer for one checkpoint layer's parts (``swap_linears`` calls it). A fused
layer (q|k|v, gate|up) is one layer over its shards' parts, each shard's scales kept (``quant.concat_parts``).

* ``SmallBatchLinear``: a bf16 / fp16 layer left plain, its weights as they are: decode batches of up to 8 rows on
  the split-K Triton GEMV (mili/kernels/triton/gemv.py), larger ones on cuBLAS (F.linear). ``use_small_batch_gemv``
  puts every plain layer (and a tied lm_head, over the embedding table) on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mili.kernels.triton import gemv, quant_gemm
from mili.model import quant
from mili.model.checks import WeightQuant
from mili.model.cpu_linear import Fp8Linear, _SwappedLinear
from mili.model.fused import RouterLinear
from mili.model.quant import Fp8Parts, Int4Parts


def _rows(x2d: torch.Tensor) -> torch.Tensor:
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


class BlockFp8Linear(_SwappedLinear):
    def __init__(self, parts: Fp8Parts, bias=None, shard_sizes=None, fp8_activations: bool = True):
        super().__init__(parts.q, bias, shard_sizes)
        self.scale_block, self.fp8_activations = parts.block, fp8_activations
        self.register_buffer("qweight", parts.q.contiguous())
        self.register_buffer("weight_scale", parts.scale.float().contiguous())

    def _matmul(self, x2d):
        out = quant_gemm.fp8_linear(_rows(x2d), self.qweight, self.weight_scale, self.scale_block,
                                    self.fp8_activations)
        return out if self.bias is None else out + self.bias


class AwqLinear(_SwappedLinear):
    def __init__(self, parts: Int4Parts, bias=None, shard_sizes=None):
        super().__init__(parts.q, bias, shard_sizes)
        self.register_buffer("qweight", quant_gemm.pack_int4(parts.q))  # [out, in / 8] int32
        self.register_buffer("zeros", parts.zeros.contiguous())
        self.register_buffer("scales", parts.scales.contiguous())

    def _matmul(self, x2d):
        out = quant_gemm.int4_linear(_rows(x2d), self.qweight, self.zeros, self.scales)
        return out if self.bias is None else out + self.bias


class TritonInt8Linear(_SwappedLinear):
    def __init__(self, weight, bias=None, shard_sizes=None):
        super().__init__(weight, bias, shard_sizes)
        qweight, scales = quant.quantize_int8_per_channel(weight.detach())
        self.register_buffer("qweight", qweight.contiguous())  # [out, in] int8
        self.register_buffer("scales", scales.contiguous())  # [out] float32

    def _matmul(self, x2d):
        out = quant_gemm.int8_linear(_rows(x2d), self.qweight, self.scales)
        return out if self.bias is None else out + self.bias


class SmallBatchLinear(_SwappedLinear):
    """A plain layer (same weight and bias tensors, nothing copied): up to ``gemv.GEMV_MAX_ROWS`` rows on the
    split-K GEMV, more on F.linear. The choice is by the row count, a static shape under a CUDA graph."""

    def __init__(self, weight, bias=None, shard_sizes=None):
        super().__init__(weight, bias, shard_sizes)
        # the layer's own Parameter (a tied head: the table's, registered twice, counted once)
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)

    def _matmul(self, x2d):
        if x2d.shape[0] > gemv.GEMV_MAX_ROWS:
            return F.linear(x2d, self.weight, self.bias)
        return gemv.gemv(_rows(x2d), self.weight, self.bias)


def use_small_batch_gemv(model: nn.Module) -> None:
    """Every plain bf16 / fp16 nn.Linear of ``model`` (FusedLinear too; the MoE router and the layers a format
    swapped aside) becomes a ``SmallBatchLinear`` over its own weights; a tied lm_head one over the embedding
    table (``compute_logits`` then calls it)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (isinstance(child, nn.Linear) and not isinstance(child, RouterLinear)
                    and child.weight.dtype in (torch.bfloat16, torch.float16)):
                setattr(module, name, SmallBatchLinear(child.weight, child.bias, getattr(child, "shard_sizes", None)))
    if hasattr(model, "lm_head") and model.lm_head is None:  # tied: logits from the embedding table
        table = model.model.embed_tokens.weight
        if table.dtype in (torch.bfloat16, torch.float16):
            model.lm_head = SmallBatchLinear(table)


def quantized_layer(parts: Fp8Parts | Int4Parts, bias=None, shard_sizes=None, fp8_activations: bool = True):
    """The layer for a checkpoint layer's quantized parts, or None where the kernels cannot take its shape
    (the layer then keeps its dequantized weights)."""
    out, k = parts.q.shape
    if isinstance(parts, Int4Parts):
        group = k // parts.zeros.shape[1]
        return AwqLinear(parts, bias, shard_sizes) if quant_gemm.int4_block_size(group, k) else None
    if quant_gemm.fp8_block_size(parts.block, k) is None:
        return None
    per_channel = parts.block[0] == 1 and parts.block[1] >= k
    if fp8_activations and per_channel and out % 16 == 0 and k % 16 == 0:  # torch._scaled_mm's shapes
        return Fp8Linear(parts.q, bias, shard_sizes, scales=parts.scale[:, 0])
    return BlockFp8Linear(parts, bias, shard_sizes, fp8_activations)


def describe(quant: WeightQuant, fp8_act: bool, moe: bool, dtype: torch.dtype) -> str:
    """What the weights compute as (/health, the start-up log)."""
    if quant.method == "awq":
        how = "on the Triton int4 GEMM (dequantized in the kernel)"
    elif quant.block is None and fp8_act:
        how = "on torch._scaled_mm (W8A8, activations per token)"
    else:
        how = "on the Triton FP8 GEMM (" + ("W8A8, activations per token and group of 128)" if fp8_act
                                            else "weight-only)")
    experts = f", experts dequantized to {str(dtype).removeprefix('torch.')}" if moe else ""
    return f"{quant.describe()} {how}{experts}"
