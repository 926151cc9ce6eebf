"""The model builder: a model as the execution plan says. It is the one place that applies the plan's kernel
choices to a model: the attention back-end and its ops table (given to the model's constructors), the Gated
DeltaNet implementation (set on each such layer), and the linear layers swapped for their format's kernels
once the weights are in."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from mili.config import ModelConfig
from mili.kernels import gated_delta_fla
from mili.kernels.cpu import ops as cpu_ops
from mili.kernels.reference import TorchOps
from mili.model import quant
from mili.model.cpu_linear import (Int4Linear, Int8GroupLinear, SplitLinear, fp8_round_trip_linears, int4_layer,
                                   swap_linears, swap_lm_head)
from mili.model.loader import load_weights
from mili.model.qwen3 import Qwen3ForCausalLM
from mili.model.qwen3_5 import GatedDeltaNet, Qwen3_5ForCausalLM
from mili.model.qwen3_vl import Qwen3VLForConditionalGeneration
from mili.runtime.attention.torch_backend import TorchAttentionBackend
from mili.runtime.plan import ExecutionPlan

log = logging.getLogger("mili")


def attention_and_ops(plan: ExecutionPlan, max_pages_per_seq: int):
    """The plan's attention back-end (an instance) and ops table (a class of static kernels)."""
    if plan.attention == "triton":
        from mili.kernels.triton.ops import TritonOps
        from mili.runtime.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(max_pages_per_seq), TritonOps
    if plan.attention == "cpu":
        from mili.kernels.cpu.ops import CpuOps
        from mili.runtime.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(), CpuOps
    return TorchAttentionBackend(), TorchOps


def build_model(plan: ExecutionPlan, model_config: ModelConfig, path: str, device: torch.device, attention, ops):
    """The model on ``device`` with its weights from ``path``, its kernels as ``plan`` says."""
    mtp = plan.speculative == "mtp"
    with torch.device("meta"):
        if model_config.is_hybrid:
            model = Qwen3_5ForCausalLM(model_config, attention, plan.dtype, ops, mtp=mtp, vision=plan.vision)
        elif model_config.vision_config is not None:  # Qwen3-VL
            model = Qwen3VLForConditionalGeneration(model_config, attention, plan.dtype, ops, plan.vision)
        else:
            model = Qwen3ForCausalLM(model_config, attention, plan.dtype, ops)
    model = model.to_empty(device=device)
    quantized = load_weights(model, path, keep_quantized=plan.keep_quantized)
    model.eval()
    _swap_linears(model, plan, quantized)
    if plan.gated_delta is not None:  # (the C decode step takes the loaded weights)
        _use_gated_delta(model, plan.gated_delta)
    log.info("weights: %s", plan.weight_format)
    _release_freed_memory()  # the plain weights a swap replaced go back to the OS (host memory)
    return model


def _use_gated_delta(model: torch.nn.Module, how: str) -> None:
    """Each Gated DeltaNet layer on the plan's implementation: fla (flash-linear-attention's kernels, CUDA),
    torch+cpu (the model's torch code, each decode step in one call of MILI's C kernel), torch."""
    fla = gated_delta_fla.FlaGatedDelta() if how == "fla" else None
    for layer in model.modules():
        if isinstance(layer, GatedDeltaNet):
            layer.kernels = fla
            if how == "torch+cpu":
                layer.use_cpu_kernel()
    log.info("gated delta rule: %s", {"fla": "flash-linear-attention's Triton kernels",
                                      "torch+cpu": "torch (decode steps: MILI's CPU kernel)"}.get(how, "torch"))


def _swap_linears(model, plan: ExecutionPlan, quantized: dict) -> None:
    """The linear layers on their format's kernels (``plan.linears``), then the lm_head as ``plan.lm_head``, then
    what stayed plain on the small-batch GEMV where the plan says. ``quantized``: the checkpoint's layers the loader
    kept as stored."""
    skip_head = plan.lm_head is not None
    if plan.fp8_round_trip:
        fp8_round_trip_linears(model)
    if plan.linears == "triton":
        from mili.model import gpu_linear

        swap_linears(model, "plain", quantized=quantized,
                     make_quantized=functools.partial(gpu_linear.quantized_layer, fp8_activations=plan.fp8_activations))
    elif plan.linears == "fp8":
        swap_linears(model, "fp8")
    elif plan.linears == "int8":
        swap_linears(model, "int8", kernels=plan.int8_kernels, skip_head=skip_head)
    elif plan.linears == "triton-int8":
        from mili.model.gpu_linear import TritonInt8Linear  # (triton's import: only where its GEMMs run)

        swap_linears(model, "triton-int8", skip_head=skip_head, make_layer=TritonInt8Linear)
    elif plan.linears == "kernel":
        if model.lm_head is None and "lm_head.weight" in quantized and not skip_head:  # a tied head kept as stored
            model.lm_head = _quantized_cpu_layer(quantized["lm_head.weight"], None, None)  # (None: the table's)
        swap_linears(model, "kernel", quantized=quantized, make_quantized=_quantized_cpu_layer, skip_head=skip_head,
                     make_fused=_split_cpu_layer)
    elif plan.linears == "packed":
        swap_linears(model, "packed", skip_head=skip_head)
    if skip_head:
        swap_lm_head(model, plan.lm_head, kernels=plan.int8_kernels if plan.lm_head == "int8" else plan.cpu_kernels)
    if plan.small_batch_gemv:  # (what the format left plain: decode batches on the split-K GEMV)
        from mili.model.gpu_linear import use_small_batch_gemv

        use_small_batch_gemv(model)


def _cpu_form(parts) -> tuple | None:
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


def _quantized_cpu_layer(parts, bias, shard_sizes):
    """A layer kept as stored on the CPU's kernels (``_cpu_form``): AWQ's and GGUF's 4-bit quants on the int4 kernel,
    GGUF's Q5_K and Q6_K on it with their bits above the nibble, GGUF's 8-bit ones (and a fused layer whose parts mix
    types, where joined) on the int8g kernel; None (the dequantized weights on the bf16 kernel) where the kernel
    can't take the shape."""
    form = _cpu_form(parts)
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


def _split_cpu_layer(shards: list, bias, shard_sizes):
    """A fused layer whose shards take different kernel forms (GGUF's Q4_K_M: Q4_K q and k beside a Q6_K v) as one
    layer per run of shards of one form (``SplitLinear``), each read at its own bytes, where joined they would all
    take the widest form (int8g: 1.07 bytes a weight). None where the shards share a form (joined as before), or a
    run's rows are not whole blocks of 16."""
    forms = [_cpu_form(p) for p in shards]
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
    layers = [_quantized_cpu_layer(p, None, None) for p in joined]
    return None if None in layers else SplitLinear(layers, bias, shard_sizes)


def _release_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse; give it back (a no-op where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
