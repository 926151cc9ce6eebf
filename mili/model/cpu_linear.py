"""Linear layers swapped in after loading (the model code does not branch on them); all but Fp8Linear are
the CPU's (the Triton GEMMs' layers are in gpu_linear.py).

* ``PackedLinear``: bf16 weights reordered once into oneDNN's blocked layout (what torch.compile's
  freezing pass does), ~1.4x faster matrix-vector products than aten's linear on plain weights. oneDNN's bf16
  packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: elsewhere (and with the kernels held below AVX-512) the
  layers stay aten's (the plan's choice, from ``DeviceInfo.onednn_bf16``: ``kernels/cpu/checks.py`` probes it).
* ``KernelLinear``: bf16 weights packed for MILI's own kernel (``kernels/cpu``: AMX, or AVX-512 BF16),
  which streams them near read speed where oneDNN falls well short (benchmarks/NOTES.md). A tied lm_head
  gets the packed table and the embedding reads its rows from it (``PackedEmbedding``), so the table is
  stored once.
* ``Int8Linear``: int8 weights with one scale per output channel (symmetric, round to nearest): MILI's
  kernel (activations quantized per row too: AMX-INT8 or AVX-512 VNNI), or aten's weight-only
  ``_weight_int8pack_mm``: half the bytes of bf16 per decode step. (CUDA runs the same weights on the Triton
  int8 GEMM, ``gpu_linear.TritonInt8Linear``; this layer only where that cannot run: no triton, before SM 8.0.)
* ``Fp8Linear``: FP8 e4m3 weights with one scale per output channel and activations quantized per token,
  through ``torch._scaled_mm`` (GPUs with FP8, SM 89+; the CPU has it too, but ~100x slower than the int8
  kernel, so the CPU maps FP8 weights onto Int8Linear instead).
* ``Int4Linear``: int4 weights w = s q + b with a scale and an offset per group of input channels (an AWQ
  checkpoint's (q - z) s as stored, b = -z s), on MILI's int4 kernel: a quarter of bf16's bytes. With 1 or 2 bits
  above the nibble (``high_bits``), GGUF's Q5_K and Q6_K at about the file's bytes.
* ``Int8GroupLinear``: 8-bit weights w = s q + b (q 0..255) with a scale and an offset per group of input channels,
  or w = s (q - 128) without offsets, on MILI's int8g kernel: GGUF's Q8_0 blocks as they are (and Q6_K's and Q5_K's
  exactly too, at 1.07 bytes a weight: what they ran on before the int4 kernel's high bits).
* ``SplitLinear``: a fused layer whose shards take different forms (GGUF's Q4_K_M q|k|v), one layer per run.

Both take scales and offsets as float values [out, groups] (kept in float16 where that holds them exactly, else
float32) or, GGUF's K-quants, in the two levels the file stores (``quant.TwoLevel``: fp16 d per super-block times an
int8 sc per group), which the kernels read as they are: Q4_K at ~0.58 bytes a weight where float32 took 0.75.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mili.kernels.cpu import ops as cpu_ops
from mili.model import quant
from mili.model.fused import STACKED_PARAMS, FusedExperts, RouterLinear


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


class KernelLinear(_SwappedLinear):
    def __init__(self, weight, bias=None, shard_sizes=None):
        super().__init__(weight, bias, shard_sizes)
        self.register_buffer("packed", cpu_ops.pack_weight(weight.detach()))

    def _matmul(self, x2d):
        out = cpu_ops.linear(x2d, self.packed, self.out_features)
        return out if self.bias is None else out + self.bias


class PackedEmbedding(nn.Module):
    """The embedding of a tied model whose table lives, packed, in the lm_head (a KernelLinear)."""

    def __init__(self, head: KernelLinear):
        super().__init__()
        self.head = [head]  # a list: not a submodule, so the table is not registered twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_ops.unpack_rows(self.head[0].packed, ids)


class Int8Linear(_SwappedLinear):
    def __init__(self, weight, bias=None, shard_sizes=None, kernels: bool = False):
        super().__init__(weight, bias, shard_sizes)
        qweight, scales = quant.quantize_int8_per_channel(weight.detach())
        # MILI's int8 kernel (activations quantized per row too), or aten's weight-only kernel
        self.kernel = kernels and self.in_features % 64 == 0
        if self.kernel:
            self.register_buffer("qweight", cpu_ops.pack_weight(qweight))
            self.register_buffer("scales", F.pad(scales, (0, -len(scales) % 16)).contiguous())
            self.register_buffer("column_sums", cpu_ops.int8_column_sums(self.qweight))
        else:
            self.register_buffer("qweight", qweight)
            self.register_buffer("scales", scales.to(weight.dtype))

    def _matmul(self, x2d):
        if self.kernel:
            out = cpu_ops.linear_int8(x2d, self.qweight, self.scales, self.column_sums, self.out_features)
            return out if self.bias is None else out + self.bias
        x2d = x2d.to(self.scales.dtype)
        if x2d.shape[0] > 8:  # prefill: the int8 kernel is slow on many rows; dequantize once instead
            return F.linear(x2d, self.qweight.to(x2d.dtype) * self.scales[:, None], self.bias)
        out = torch.ops.aten._weight_int8pack_mm(x2d, self.qweight, self.scales)
        return out if self.bias is None else out + self.bias


class Fp8Linear(_SwappedLinear):
    def __init__(self, weight, bias=None, shard_sizes=None, scales=None):
        """``weight``: quantized here, per channel; or (``scales`` given, one per output channel) a
        checkpoint's float8_e4m3fn weights as they are."""
        super().__init__(weight, bias, shard_sizes)
        if scales is None:
            weight, scales = quant.quantize_fp8_per_channel(weight.detach())
        self.register_buffer("qweight", weight)
        self.register_buffer("scales", scales.float().reshape(1, -1).contiguous())  # [1, out] float32

    def _matmul(self, x2d):
        xq, sx = quant.quantize_fp8_per_row(x2d)
        return torch._scaled_mm(xq, self.qweight.t(), scale_a=sx, scale_b=self.scales, bias=self.bias,
                                out_dtype=x2d.dtype)


def _groups(values) -> int:
    return (values.sc if isinstance(values, quant.TwoLevel) else values).shape[1]


def _pack_grouped(pack, q: torch.Tensor, scales, offsets):
    """q [out, in], scales and offsets [out, groups] (float values, or both ``quant.TwoLevel``) padded to whole
    blocks of 16 rows (padded rows have zero scales: their outputs are cut off) and packed by ``pack``
    (``pack_int4`` / ``pack_int8g``): float values in float16 where that holds them exactly, else float32."""
    pad = -q.shape[0] % 16

    def padded(t):
        if isinstance(t, quant.TwoLevel):
            return quant.TwoLevel(*(F.pad(u, (0, 0, 0, pad)) for u in t))
        return None if t is None else F.pad(t, (0, 0, 0, pad))

    two_level = isinstance(scales, quant.TwoLevel)
    if offsets is not None and isinstance(offsets, quant.TwoLevel) != two_level:
        raise ValueError("scales and offsets must take the same form (both float values, or both two-level)")
    q, scales, offsets = padded(q), padded(scales), padded(offsets)
    exact = not two_level and cpu_ops.exact_in_fp16(scales, *(() if offsets is None else (offsets,)))
    return pack(q, scales, offsets, torch.float16 if exact else torch.float32)


class Int4Linear(_SwappedLinear):
    def __init__(self, q, scales, offsets, bias=None, shard_sizes=None, high_bits: int = 0):
        """``q`` [out, in] (values 0..15), ``scales`` and ``offsets`` [out, in / group]: w = scale q + offset;
        ``offsets`` None: w = scale (q - 8), none stored (GGUF's Q4_0). Float values are kept in float16 where that
        holds them exactly, else float32; two-level ones (``quant.TwoLevel``, GGUF's Q4_K) as they are.
        ``high_bits`` 1 or 2: q up to 31 or 63 (GGUF's Q5_K, and without offsets w = scale (q - 32) its Q6_K), the
        bits above the nibble in a plane of their own (``ops.pack_int4``): ~0.69 and ~0.82 bytes a weight."""
        super().__init__(q, bias, shard_sizes)
        self.group = q.shape[1] // _groups(scales)
        self.high_bits = high_bits
        if high_bits and q.shape[1] % 32:
            raise ValueError(f"the int4 kernel takes high bits where in_features is a multiple of 32: not {q.shape[1]}")

        def pack(*args):
            return cpu_ops.pack_int4(*args, high_bits=high_bits)

        packed, scales, offsets = _pack_grouped(pack, q, scales, offsets)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)

    @classmethod
    def from_awq(cls, parts: quant.Int4Parts, bias=None, shard_sizes=None) -> Int4Linear:
        return cls(parts.q, *cpu_ops.awq_scales_offsets(parts.zeros, parts.scales), bias, shard_sizes)

    def _matmul(self, x2d, out=None):
        y = cpu_ops.linear_int4(x2d, self.qweight, self.scales, self.offsets, self.high_bits, out)[:, :self.out_features]
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weights the kernel multiplies by, [out, in] float32: scale * q + offset (two roundings, as gguf's
        dequantize of Q4_K and Q5_K: each product is exact there), or scale * (q - 8) (gguf's Q4_0, bit for bit; with
        high bits q - 16 or q - 32: Q6_K's)."""
        q = cpu_ops.unpack_int4(self.qweight, self.high_bits)[:self.out_features].float()
        if self.offsets is None:
            return _per_group(self.scales, q) * (q - (8 << self.high_bits))
        return _per_group(self.scales, q) * q + _per_group(self.offsets, q)


class Int8GroupLinear(_SwappedLinear):
    def __init__(self, q, scales, offsets=None, bias=None, shard_sizes=None, signed: bool = False):
        """8-bit weights per group (kernels.c, int8g): ``q`` [out, in] (uint8 0..255), ``scales`` and ``offsets``
        [out, in / group]: w = scale q + offset; ``offsets`` None: w = scale (q - 128), none stored (GGUF's Q8_0 as
        q + 128 with scale d, Q6_K as q + 96 with scale d sc; Q5_K is q, d sc and -dmin m); ``signed`` with offsets:
        w = scale (q - 128) + offset (a fused layer whose parts mix those forms). Float scales and offsets are kept in
        float16 where that holds them exactly, else float32; two-level ones (``quant.TwoLevel``, GGUF's Q6_K and
        Q5_K) as they are."""
        super().__init__(q, bias, shard_sizes)
        self.signed = signed and offsets is not None
        groups = _groups(scales)
        self.group = q.shape[1] // groups
        if self.group * groups != q.shape[1] or not cpu_ops.int8g_supported(16, q.shape[1], self.group):
            raise ValueError(f"the int8g kernel takes groups of a multiple of 8 input features: not {q.shape[1]} "
                             f"in {groups} groups")
        packed, scales, offsets = _pack_grouped(cpu_ops.pack_int8g, q, scales, offsets)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)  # (None: symmetric)

    def _matmul(self, x2d, out=None):
        y = cpu_ops.linear_int8g(x2d, self.qweight, self.scales, self.offsets, self.signed, out)[:, :self.out_features]
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weights the kernel multiplies by, [out, in] float32: scale * q + offset, or scale * (q - 128), in
        gguf's dequantize's order (d q - dm, d q): equal to it bit for bit on Q8_0, Q6_K and Q5_K blocks."""
        q = cpu_ops.unpack_rows(self.qweight, torch.arange(self.out_features)).float()
        if self.offsets is None:
            return _per_group(self.scales, q) * (q - 128)
        if self.signed:
            return _per_group(self.scales, q) * (q - 128) + _per_group(self.offsets, q)
        return _per_group(self.scales, q) * q + _per_group(self.offsets, q)


class SplitLinear(_SwappedLinear):
    def __init__(self, parts: list[_SwappedLinear], bias=None, shard_sizes=None):
        """One fused layer (q|k|v, gate|up) as consecutive runs of its output rows, each its own layer
        (``Int4Linear`` / ``Int8GroupLinear``, no bias, out_features a multiple of 16) writing its columns of the one
        output: a GGUF file's shards of different types (Q4_K_M's Q4_K q and k beside a Q6_K v) each read as stored,
        where one layer would take the widest form for all of its rows."""
        rows = sum(p.out_features for p in parts)
        super().__init__(torch.empty(rows, parts[0].in_features, device="meta"), bias, shard_sizes)
        assert all(p.bias is None and p.out_features % 16 == 0 and p.in_features == self.in_features for p in parts)
        self.parts = nn.ModuleList(parts)

    def _matmul(self, x2d):
        y = torch.empty(x2d.shape[0], self.out_features, dtype=torch.bfloat16)
        at = 0
        for part in self.parts:
            part._matmul(x2d, y[:, at:at + part.out_features])
            at += part.out_features
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def _per_group(blocked: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Scales or offsets as packed (any form) to q's shape [out, in], float32: the values the kernels form."""
    t = cpu_ops.group_values(blocked)[:q.shape[0]]
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


@torch.no_grad()
def fp8_round_trip_linears(model: nn.Module) -> None:
    """``--quantization fp8`` where the weights then compute in another form: every linear weight (and each
    expert's) in place through per-channel FP8 and back, the lm_head and router aside."""
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            for w in (module.w13, module.w2):
                w.copy_(torch.stack([quant.fp8_round_trip(e) for e in w]))
        elif isinstance(module, nn.Linear) and not isinstance(module, RouterLinear) and name != "lm_head":
            module.weight.copy_(quant.fp8_round_trip(module.weight))


def int4_layer(parts: quant.Int4Parts, bias, shard_sizes) -> Int4Linear | None:
    """An AWQ layer on the CPU's int4 kernel, or None where the kernel cannot take its shape."""
    if not isinstance(parts, quant.Int4Parts):
        return None
    out, k = parts.q.shape
    if not cpu_ops.int4_supported(out, k, k // parts.zeros.shape[1]):
        return None
    return Int4Linear.from_awq(parts, bias, shard_sizes)


def int8_head(model: nn.Module, kernels: bool) -> None:
    """The lm_head as ``Int8Linear`` per output channel (on MILI's int8 kernel when ``kernels``; a tied embedding
    keeps its table for the lookup and the head gets its own int8 copy: int8 halves the bytes the head reads)."""
    tied = model.lm_head is None
    model.lm_head = Int8Linear(model.model.embed_tokens.weight if tied else model.lm_head.weight, kernels=kernels)


def bf16_head(model: nn.Module, kernels: bool, prepack: bool) -> None:
    """The lm_head in the model's dtype: on MILI's bf16 kernel when ``kernels`` and it can take it, a tied table
    packed once and shared (``PackedEmbedding``); else oneDNN-packed, a tied head left on the plain table (a packed
    copy would cost another vocab x hidden matrix of memory, 311 MB for Qwen3-0.6B, for ~4 ms per decode step)."""
    embed, tied = model.model.embed_tokens, model.lm_head is None
    weight = embed.weight if tied else model.lm_head.weight
    if kernels and cpu_ops.linear_supported(weight):
        model.lm_head = KernelLinear(weight)
        if tied:  # the table stored once, packed
            model.model.embed_tokens = PackedEmbedding(model.lm_head)
    elif not tied and prepack and weight.dtype == torch.bfloat16:
        model.lm_head = PackedLinear(weight)


def swap_linears(model: nn.Module, make=None, quantized: dict | None = None, make_quantized=None,
                 skip_head: bool = False, make_fused=None) -> None:
    """Replace every nn.Linear of ``model`` (the MoE router aside; an untied lm_head too unless ``skip_head``) and
    each stacked expert's slices with ``make(weight, bias, shard_sizes)``, a weight format's layer (None from it:
    the layer stays as it is; ``make`` None: every layer, and the stacked experts, stay as they are).
    ``quantized``: a checkpoint's layers kept quantized by the loader (weight name -> parts); a layer whose shards
    all have parts becomes ``make_quantized(parts, bias, shard_sizes)`` (a fused layer's joined by
    ``quant.concat_parts``), unless that returns None. ``make_fused(shards' parts, bias, shard_sizes)``, where given,
    makes a fused layer from its shards' parts unjoined first (the CPU's: shards of different GGUF types, each on
    its own kernel form); None from it: joined. A tied lm_head (None) is left to the format (``formats``)."""

    def make_from_parts(name, child):
        stacked = getattr(model, "stacked_params", STACKED_PARAMS)  # (the hybrids': the linear attention's too)
        shards = [f"{name.rsplit('.', 1)[0]}.{ckpt}.weight" for ckpt, (fused, _) in
                  sorted(stacked.items(), key=lambda kv: kv[1][1]) if name.endswith(f".{fused}")]
        parts = [quantized.get(n) for n in shards or [f"{name}.weight"]]
        if None in parts:
            return None
        device, shard_sizes = child.weight.device, getattr(child, "shard_sizes", None)
        parts = [type(p)(*(t.to(device) if torch.is_tensor(t) else t for t in p)) for p in parts]
        if len(parts) > 1 and make_fused is not None:
            layer = make_fused(parts, child.bias, shard_sizes)
            if layer is not None:
                return layer
        return make_quantized(quant.concat_parts(parts) if len(parts) > 1 else parts[0], child.bias, shard_sizes)

    def expert_parts(module_name, e, projections):
        parts = [(quantized or {}).get(f"{module_name}.{e}.{p}.weight") for p in projections]
        if None in parts:
            return None
        parts = [p() if callable(p) else p for p in parts]  # (GGUF's experts: made here, one expert at a time)
        return quant.concat_parts(parts) if len(parts) > 1 else parts[0]

    def expert_layer(module_name, e, projections, weight, shard_sizes):
        """Expert ``e``'s layer: from its parts where the loader kept them (it then left the stacked weight
        unwritten; parts a kernel can't take, dequantized), else from its slice of the stacked weight."""
        parts = expert_parts(module_name, e, projections)
        if parts is None:
            return make(weight, None, shard_sizes)
        layer = make_quantized(parts, None, shard_sizes)
        return layer if layer is not None else make(parts.dequantize().to(weight.dtype), None, shard_sizes)

    for module_name, module in list(model.named_modules()):
        if isinstance(module, FusedExperts) and make is None:
            continue
        if isinstance(module, FusedExperts):  # each expert's slices of the stacked weights, then drop those
            inter = module.inter
            linears = [linear for e in range(module.num_experts)
                       for linear in (expert_layer(module_name, e, ("gate_proj", "up_proj"), module.w13[e],
                                                   [inter, inter]),
                                      expert_layer(module_name, e, ("down_proj",), module.w2[e], None))]
            if None not in linears:
                module.linears = nn.ModuleList(linears)
                module.w13 = module.w2 = None
            else:  # the experts stay stacked, on torch's path: every slice the loader left to the parts, filled
                for e in range(module.num_experts):
                    for projections, weight in ((("gate_proj", "up_proj"), module.w13[e]),
                                                (("down_proj",), module.w2[e])):
                        parts = expert_parts(module_name, e, projections)
                        if parts is not None:
                            weight.copy_(parts.dequantize())
            continue
        for child_name, child in list(module.named_children()):
            name = f"{module_name}.{child_name}" if module_name else child_name
            if skip_head and name == "lm_head":
                continue
            if isinstance(child, nn.Linear) and not isinstance(child, RouterLinear):  # FusedLinear too
                layer = make_from_parts(name, child) if quantized else None
                if layer is None and make is not None:
                    layer = make(child.weight, child.bias, getattr(child, "shard_sizes", None))
                if layer is not None:
                    setattr(module, child_name, layer)
