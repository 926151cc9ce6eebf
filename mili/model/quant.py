"""The quantized weight formats MILI reads, as plain tensor functions (the loader and the linears use them).

* FP8 e4m3 with a scale per 128 x 128 block (Qwen's ``weight_scale_inv``), per output channel or per tensor
  (compressed-tensors' ``weight_scale``): ``w = q * scale``.
* AWQ GEMM int4: ``qweight`` [in, out / 8] and ``qzeros`` [in / group, out / 8] int32, each word holding 8
  output columns' 4-bit values in AWQ's interleaved order, and fp16 ``scales`` [in / group, out]:
  ``w[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]`` (transposed to MILI's [out, in]).

A layer the linears compute with as it is stored is kept (by the loader) as its parts: ``Fp8Parts``, ``Int4Parts``
or ``GroupParts`` (GGUF's blocks; the K-quants' scales in two levels, ``TwoLevel``, as the file stores them); a fused
layer (q|k|v, gate|up) joins its shards' parts with ``concat_parts``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_MAX = 448.0  # the largest float8_e4m3fn
# Word nibble i holds column AWQ_ORDER[i] of its 8 (AutoAWQ's pack); reading nibbles in AWQ_REVERSE_ORDER
# gives columns 0..7 back.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


class Fp8Parts(NamedTuple):
    """An FP8 layer as stored: ``q`` [out, in] float8_e4m3fn, ``scale`` float32, one per ``block`` (rows,
    columns) of q: [ceil(out / rows), ceil(in / cols)]; per channel (and per tensor) is the block (1, in)."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]


class Int4Parts(NamedTuple):
    """An AWQ layer in MILI's orientation: ``q`` [out, in] uint8 (0..15), ``zeros`` [out, in / group] uint8,
    ``scales`` [out, in / group] float16."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor


class TwoLevel(NamedTuple):
    """Values per group of input channels in two levels, as GGUF's K-quants store their scales: ``d`` [out,
    super-blocks] float32 (fp16 values), one per super-block of groups, and ``sc`` [out, groups] int8, one per group.
    A group's value is d sc, exact in float32 (an 11-bit mantissa times at most 8 bits): Q4_K's and Q5_K's scales
    (d, sc) and offsets (-dmin, m), Q6_K's scales (d, sc), sc signed there."""

    d: torch.Tensor
    sc: torch.Tensor

    def values(self) -> torch.Tensor:
        """[out, groups] float32: d sc, as gguf-py forms it (d * sc.astype(float32), exact)."""
        return self.d.float().repeat_interleave(self.sc.shape[1] // self.d.shape[1], 1) * self.sc.float()

    def regroup(self, times: int) -> TwoLevel:
        """The same values at groups ``times`` smaller (each sub-scale repeated)."""
        return TwoLevel(self.d, self.sc.repeat_interleave(times, 1))


class GroupParts(NamedTuple):
    """Quants with a scale and an offset per group of input channels, w = scale q + offset (GGUF's block types,
    ``gguf_blocks``): ``q`` [out, in] int8, ``scales`` and ``offsets`` [out, in / group] float32; ``bits`` 4
    (q in 0..15 with offsets, or -8..7 without: the int4 kernel), 5 or 6 (0..31, -32..31: the int4 kernel with bits
    above the nibble) or 8 (any int8 q). ``scales_k`` and ``offsets_k``:
    the same scales and offsets as the K-quants store them (``TwoLevel``; offsets_k None: none, zeros), which the
    kernels read as they are; None for the other types."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    scales_k: TwoLevel | None = None
    offsets_k: TwoLevel | None = None

    def dequantize(self) -> torch.Tensor:
        """float32 scale q + offset, in that order: the values of gguf.quants.dequantize of the same blocks, exactly
        (a zero's sign aside: Q4_0's d 8 - 8 d is +0 where gguf-py's d (8 - 8) is -0 for a negative d)."""
        group = self.q.shape[1] // self.scales.shape[1]
        return (self.q.float() * self.scales.repeat_interleave(group, 1)).add_(self.offsets.repeat_interleave(group, 1))

    def take_rows(self, index: torch.Tensor) -> "GroupParts":
        """These output rows, in ``index``'s order (a row's groups, and its super-blocks' d, move with it)."""
        def rows(two: TwoLevel | None) -> TwoLevel | None:
            return None if two is None else TwoLevel(two.d[index], two.sc[index])

        return GroupParts(self.q[index], self.scales[index], self.offsets[index], self.bits, rows(self.scales_k),
                          rows(self.offsets_k))


def fp8_parts(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> Fp8Parts:
    """A checkpoint's FP8 weight and scale: per 128 x 128 block (``block``), else per channel or per tensor
    (both as one float32 scale per output channel)."""
    if block is None:
        return Fp8Parts(q, scale.float().reshape(-1, 1).expand(q.shape[0], 1).contiguous(), (1, q.shape[1]))
    return Fp8Parts(q, scale.float().contiguous(), block)


def concat_parts(parts: list) -> Fp8Parts | Int4Parts | GroupParts:
    """One layer from its shards' parts, stacked along the output rows. FP8 blocks that would straddle two
    shards (a shard not a whole number of blocks tall) become one scale row per output row."""
    if isinstance(parts[0], Int4Parts):
        return Int4Parts(*(torch.cat(ts) for ts in zip(*parts)))
    if isinstance(parts[0], GroupParts):  # (the smallest group and the widest quants: every shard exactly)
        group = min(p.q.shape[1] // p.scales.shape[1] for p in parts)

        def regroup(t, p):
            return t.repeat_interleave(p.q.shape[1] // p.scales.shape[1] // group, 1)

        return GroupParts(torch.cat([p.q for p in parts]), torch.cat([regroup(p.scales, p) for p in parts]),
                          torch.cat([regroup(p.offsets, p) for p in parts]), max(p.bits for p in parts),
                          *_concat_two_level(parts, group))
    rows, cols = parts[0].block
    assert all(p.block[1] == cols for p in parts)
    if len({p.block for p in parts}) == 1 and all(p.q.shape[0] % rows == 0 for p in parts[:-1]):
        return Fp8Parts(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), (rows, cols))
    scale = torch.cat([p.scale.repeat_interleave(p.block[0], 0)[:p.q.shape[0]] for p in parts])
    return Fp8Parts(torch.cat([p.q for p in parts]), scale, (1, cols))


def _concat_two_level(parts: list[GroupParts], group: int) -> tuple[TwoLevel | None, TwoLevel | None]:
    """The joined layer's ``scales_k`` and ``offsets_k``, at groups of ``group``: where every shard has two-level
    scales over the same super-blocks (a shard without offsets gets -0 ones where another has them), else None."""
    if any(p.scales_k is None for p in parts) or len({p.scales_k.d.shape[1] for p in parts}) > 1:
        return None, None

    def times(p):
        return p.q.shape[1] // p.scales.shape[1] // group

    scales = [p.scales_k.regroup(times(p)) for p in parts]
    joined = TwoLevel(torch.cat([t.d for t in scales]), torch.cat([t.sc for t in scales]))
    if all(p.offsets_k is None for p in parts):
        return joined, None
    offsets = [p.offsets_k.regroup(times(p)) if p.offsets_k is not None else  # (-0 d: s q + b keeps s q's bits)
               TwoLevel(torch.full_like(t.d, -0.0), torch.zeros_like(t.sc)) for p, t in zip(parts, scales)]
    return joined, TwoLevel(torch.cat([t.d for t in offsets]), torch.cat([t.sc for t in offsets]))


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 weights from FP8 ``q`` [out, in]: one scale per block (the last row/column of blocks may be
    partial), else per output channel ([out, 1]) or per tensor (one value)."""
    w, scale = q.float(), scale.float()
    if block is not None:
        rows, cols = w.shape
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w * scale


def fp8_block_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weights, float32 scales [out]) with one scale per output channel: round to nearest."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights in -127..127, float32 scales [out]) with one scale per output channel (symmetric): round to
    nearest."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                        scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's block FP8, as its quantizer writes it: (float8_e4m3fn [out, in], ``weight_scale_inv``
    [ceil(out / b0), ceil(in / b1)] in ``scale_dtype``); the last row/column of blocks may be partial."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -cols % block[1], 0, -rows % block[0]))
    blocks = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).to(scale_dtype)
    q = (blocks / scale.float()[:, None, :, None]).reshape(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def quantize_awq(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ's asymmetric 4-bit per group of input channels (round to nearest, no activation-aware search),
    in AWQ's [in, out] orientation before packing: (q [in, out], zeros [in / group, out], fp16 scales
    [in / group, out]); q and zeros are int32 values in 0..15."""
    wt = w.float().t()
    k, n = wt.shape
    g = wt.reshape(k // group, group, n)
    lo, hi = g.amin(dim=1), g.amax(dim=1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(g / scales.float()[:, None] + zeros[:, None]).clamp(0, 15).reshape(k, n)
    return q.to(torch.int32), zeros.to(torch.int32), scales


def quantize_fp8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: (float8_e4m3fn rows, float32 scales [rows, 1])."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """``w`` through per-channel FP8 and back (what an FP8 weight computes with), in ``w``'s dtype."""
    q, scale = quantize_fp8_per_channel(w)
    return (q.float() * scale[:, None]).to(w.dtype)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] int32 words -> [rows, cols] uint8 values in 0..15, columns in their natural order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed[:, :, None] >> shifts[list(AWQ_REVERSE_ORDER)]) & 0xF
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``unpack_awq``: [rows, cols] in 0..15 -> [rows, cols / 8] int32 (AutoAWQ's order)."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    word = sum(v[:, :, col] << (4 * i) for i, col in enumerate(AWQ_ORDER))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def awq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> Int4Parts:
    """An AWQ layer in MILI's orientation (``Int4Parts``), its tensors checked against each other's shapes."""
    q, z = unpack_awq(qweight), unpack_awq(qzeros)
    k, n = q.shape
    if k % group or z.shape != (k // group, n) or tuple(scales.shape) != (k // group, n):
        raise ValueError(f"qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not make an AWQ layer with groups of {group}")
    return Int4Parts(q.t().contiguous(), z.t().contiguous(), scales.t().to(torch.float16).contiguous())


def dequantize_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] from ``awq_int4``'s parts."""
    group = q.shape[1] // zeros.shape[1]
    z = zeros.float().repeat_interleave(group, 1)
    return (q.float() - z) * scales.float().repeat_interleave(group, 1)
