"""MILI's CPU kernels (``kernel``: bf16 in a 16-bit model, one rank, where they load): bf16 weights packed for the
bf16 kernel (``cpu_linear.KernelLinear``; a tied lm_head packs the table once and the embedding reads its rows from
it), and a checkpoint's AWQ and GGUF layers kept as stored, each on the kernel form that takes it (``cpu_form``):
AWQ's and GGUF's 4-bit quants on the int4 kernel (W4A8), GGUF's Q5_K and Q6_K on it with their bits above the
nibble, GGUF's Q8_0 (and a fused layer whose parts mix types, where joined) on the int8g kernel (W8A8). The C
decode layer takes these layers whole."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mili.kernels.cpu import ops as cpu_ops
from mili.model import quant
from mili.model.cpu_linear import (Int4Linear, Int8GroupLinear, KernelLinear, SplitLinear, bf16_head, int4_layer,
                                   swap_linears)
from mili.model.formats.base import LinearFormat
from mili.model.formats.plain import packed_layer


def kernel_layer(weight, bias=None, shard_sizes=None, prepack: bool = False):
    """A bf16 layer on MILI's kernel; where it can't take the shape (in_features not a multiple of 32), oneDNN's
    packing where ``prepack`` (the plan's: it runs here), else None (aten's)."""
    if cpu_ops.linear_supported(weight):
        return KernelLinear(weight, bias, shard_sizes)
    return packed_layer(weight, bias, shard_sizes) if prepack else None


@dataclass(frozen=True)
class Kernel(LinearFormat):
    name = "kernel"
    summary = "MILI's CPU kernels: bf16, and a checkpoint's AWQ and GGUF blocks as stored (int4, int8g)"
    prepack: bool = False  # a layer the kernel can't take goes to oneDNN's packing (the plan's: where it runs)

    @property
    def fused_decode(self):
        return True

    def bytes_per_weight(self, dtype):
        """A bf16 layer's. (A checkpoint's layers kept as stored read their form's, cpu_linear.py: about 0.56 for
        Q4_0, 0.58 for Q4_K, 0.69 for Q5_K, 0.82 for Q6_K, 1.07 for Q8_0; a GGUF file's own bytes a weight are its
        block type's, ``gguf_blocks.BlockType.bytes_per_weight``.)"""
        return dtype.itemsize

    def apply(self, model, quantized, skip_head):
        if model.lm_head is None and "lm_head.weight" in quantized and not skip_head:  # a tied head kept as stored
            model.lm_head = quantized_cpu_layer(quantized["lm_head.weight"], None, None)  # (None: the table's)
        swap_linears(model, functools.partial(kernel_layer, prepack=self.prepack), quantized=quantized,
                     make_quantized=quantized_cpu_layer, skip_head=skip_head, make_fused=split_cpu_layer)
        if model.lm_head is None and not skip_head:  # the table, stored once, packed (where the kernel takes it)
            bf16_head(model, kernels=True, prepack=self.prepack)

    def apply_head(self, model):
        bf16_head(model, kernels=True, prepack=self.prepack)


def cpu_form(parts) -> tuple | None:
    """How the CPU's kernels take a layer's parts, as (kernel, high bits, symmetric, group, two-level scales), or
    None where no kernel can (the shape): "int4" with 0, 1 or 2 bits above the nibble (AWQ; GGUF's Q4_0 and Q4_K; its
    Q5_K and Q6_K), "int8g" (GGUF's Q8_0, and the parts of a fused layer that mix forms)."""
    if not isinstance(parts, quant.GroupParts):
        return ("awq", 0, False, 0, False) if isinstance(parts, quant.Int4Parts) else None
    out, k = parts.q.shape
    group = k // parts.scales.shape[1]
    symmetric = not parts.offsets.any()
    # the K-quants' scales and offsets in their two levels, as the file stores them; the others' float values
    two_level = parts.scales_k is not None and (symmetric or parts.offsets_k is not None)
    q_min, q_max = int(parts.q.min()), int(parts.q.max())
    high_bits = max(0, parts.bits - 4)
    if high_bits < 3 and cpu_ops.int4_supported(out, k, group) and (not high_bits or k % 32 == 0):
        zero = 8 << high_bits  # (without offsets w = s (q - zero): q held as q + zero)
        if symmetric and -zero <= q_min and q_max < zero:  # Q4_0: d (q - 8); Q6_K: d sc (q - 32)
            return "int4", high_bits, True, group, two_level
        if not symmetric and q_min >= 0 and q_max < 16 << high_bits:  # Q4_K, Q5_K: (d sc) q - dmin m
            return "int4", high_bits, False, group, two_level
    if not cpu_ops.int8g_supported(out, k, group):
        return None
    return "int8g", 0, symmetric, group, two_level


def quantized_cpu_layer(parts, bias, shard_sizes):
    """A layer kept as stored on the CPU's kernels (``cpu_form``): AWQ's and GGUF's 4-bit quants on the int4 kernel,
    GGUF's Q5_K and Q6_K on it with their bits above the nibble, GGUF's 8-bit ones (and a fused layer whose parts mix
    types, where joined) on the int8g kernel; None (the dequantized weights on the bf16 kernel) where the kernel
    can't take the shape."""
    form = cpu_form(parts)
    if form is None or form[0] == "awq":
        return int4_layer(parts, bias, shard_sizes) if form else None
    kernel, high_bits, symmetric, _, two_level = form
    scales = parts.scales_k if two_level else parts.scales
    offsets = None if symmetric else parts.offsets_k if two_level else parts.offsets
    if kernel == "int4":
        q = parts.q.to(torch.int16) + (8 << high_bits) if symmetric else parts.q
        return Int4Linear(q.to(torch.uint8), scales, offsets, bias, shard_sizes, high_bits=high_bits)
    if symmetric:  # Q8_0: w = s q, stored as u = q + 128 with no offsets
        return Int8GroupLinear((parts.q.to(torch.int16) + 128).to(torch.uint8), scales, None, bias, shard_sizes)
    if parts.q.min() >= 0:  # w = s q + b, u = q
        return Int8GroupLinear(parts.q.to(torch.uint8), scales, offsets, bias, shard_sizes)
    # both (a fused layer's joined parts: Q4_K beside Q6_K): w = s (u - 128) + b, every part's exact form
    return Int8GroupLinear((parts.q.to(torch.int16) + 128).to(torch.uint8), scales, offsets, bias,
                           shard_sizes, signed=True)


def split_cpu_layer(shards: list, bias, shard_sizes):
    """A fused layer whose shards take different kernel forms (GGUF's Q4_K_M: Q4_K q and k beside a Q6_K v) as one
    layer per run of shards of one form (``SplitLinear``), each read at its own bytes, where joined they would all
    take the widest form (int8g: 1.07 bytes a weight). None where the shards share a form (joined as before), or a
    run's rows are not whole blocks of 16."""
    forms = [cpu_form(p) for p in shards]
    if None in forms or len(set(forms)) == 1:
        return None
    runs: list[list] = []
    for form, parts in zip(forms, shards):
        if runs and runs[-1][0] == form:
            runs[-1][1].append(parts)
        else:
            runs.append([form, [parts]])
    joined = [quant.concat_parts(ps) if len(ps) > 1 else ps[0] for _, ps in runs]
    if any(p.q.shape[0] % 16 for p in joined):
        return None
    layers = [quantized_cpu_layer(p, None, None) for p in joined]
    return None if None in layers else SplitLinear(layers, bias, shard_sizes)
