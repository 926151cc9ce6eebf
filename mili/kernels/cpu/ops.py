"""Torch-facing wrappers of the CPU kernels (bf16): the ops set the model takes (same interface as
TorchOps and TritonOps), the packed linear layer's matmul, and paged decode attention. Inputs a kernel
does not cover (another dtype, an odd layout) go to the torch reference, so callers need not check."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass

import torch

from mili import host_memory
from mili.kernels import reference
from mili.kernels.cpu import abi, load

BF16 = torch.bfloat16


# library(): this thread's stack of libraries the ops run on (an engine's step: its plan's; the checks at load: the
# library being checked); empty: MILI_CPU_ISA's choice (load())
_pinned = threading.local()


def _lib():
    stack = getattr(_pinned, "stack", None)
    if stack:
        return stack[-1]
    lib, why = load()
    if lib is None:
        raise RuntimeError(f"MILI's CPU kernels are not available: {why}")
    return lib


@contextlib.contextmanager
def library(lib):
    """Within the block, this thread's ops run on ``lib`` (None: MILI_CPU_ISA's choice)."""
    if lib is None:
        yield lib
        return
    stack = _pinned.__dict__.setdefault("stack", [])
    stack.append(lib)
    try:
        yield lib
    finally:
        stack.pop()


def _threads() -> int:
    return torch.get_num_threads()


# -- linear layers -------------------------------------------------------------------------------
def linear_supported(weight: torch.Tensor) -> bool:
    return weight.dtype == BF16 and weight.dim() == 2 and weight.shape[1] % 32 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> AMX's B tile layout (also what the AVX-512 kernel reads), rows zero padded to a multiple
    of 16 (see kernels.c): bf16
    [ceil(N/16), K/2, 16, 2], int8 [ceil(N/16), K/4, 16, 4] (each row of 16 columns is 64 bytes)."""
    n, k = weight.shape
    per = 4 // weight.element_size()
    if n % 16:
        weight = torch.cat([weight, weight.new_zeros(-n % 16, k)])
    return weight.view(-1, 16, k // per, per).transpose(1, 2).contiguous()


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the original [N, K] matrix (an embedding lookup on a packed tied head): [len(rows), K]."""
    return packed[rows // 16, :, rows % 16, :].reshape(rows.shape[0], -1)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, out_features: int, kernel,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (as bf16) times packed weights by ``kernel(x, y, m, n, k)`` into y [M, padded N]:
    [M, out_features]. ``out``: y given, [M, padded N] bf16 with unit column stride (a column range of a wider
    output: the kernels that take one read its row stride from y)."""
    x = x.to(BF16).contiguous()
    m, k = x.shape
    n = packed.shape[0] * 16
    if out is not None:
        assert out.dtype == BF16 and out.shape == (m, n) and (out.stride(1) == 1 or n == 1), (out.shape, out.stride())
    y = torch.empty(m, n, dtype=BF16) if out is None else out
    if m:
        kernel(x, y, m, n, k)
    return y if n == out_features else y[:, :out_features]


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] @ W^T for W packed by pack_weight: [M, out_features]."""
    return _packed_product(x, packed, out_features, lambda x, y, m, n, k: _lib().mili_linear(
        packed.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, _threads()))


# mili_lora_desc (mili_kernels.h): a layer's LoRA adapter slots, packed (mili.lora.LoRALinear builds it)
LoRADesc = abi.STRUCTS["mili_lora_desc"]


def lora_add(desc: LoRADesc, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [M, N] (bf16, unit column stride) += each row's adapter's product (kernels.c, mili_lora_add), in place;
    ``slots`` [M] int64: each row's slot (< 0: none)."""
    x = x.to(BF16).contiguous()
    assert y.dtype == BF16 and y.stride(1) == 1 and slots.dtype == torch.int64 and slots.is_contiguous()
    _lib().mili_lora_add(ctypes.byref(desc), x.data_ptr(), x.shape[1], y.data_ptr(), y.stride(0), x.shape[0],
                         slots.data_ptr(), _threads())
    return y


def int8_column_sums(packed: torch.Tensor) -> torch.Tensor:
    """Each output column's sum of int8 weights (int32, padded like ``packed``), for the AVX-512 kernel."""
    return packed.sum(dim=(1, 3), dtype=torch.int32).reshape(-1).contiguous()


# mili_linear_desc (mili_kernels.h): one linear layer's packed weights, the int8, int4 and int8g kernels' operand (and
# each linear of the fused decode step: mili/runtime/cpu_decode.py)
LinearDesc = abi.STRUCTS["mili_linear_desc"]


def int8_desc(packed: torch.Tensor, scales: torch.Tensor, column_sums: torch.Tensor) -> LinearDesc:
    """The int8 kernel's view of int8 weights ``packed`` (:func:`pack_weight`; N: its padded rows), their ``scales``
    and ``column_sums``. The tensors must outlive its use."""
    return LinearDesc(packed.data_ptr(), scales.data_ptr(), column_sums.data_ptr(), packed.shape[0] * 16,
                      packed.shape[1] * 4)


def linear_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, column_sums: torch.Tensor,
                out_features: int) -> torch.Tensor:
    """x [M, K] @ (int8 W * scales)^T, x quantized per row to int8 inside the kernel: [M, out_features].
    ``scales`` (float32) and ``column_sums`` (int32, :func:`int8_column_sums`) padded like ``packed``."""
    desc = int8_desc(packed, scales, column_sums)
    return _packed_product(x, packed, out_features, lambda x, y, m, n, k: _lib().mili_linear_int8(
        ctypes.byref(desc), x.data_ptr(), y.data_ptr(), m, _threads()))


# The int4 and int8g kernels' forms of scales and offsets (kernels.c, scale_form), told apart by the packed tensor's
# dtype: float16 or float32 [N/16, groups, 16] (SCALES_F16, SCALES_F32), or uint8 [N/16, super-blocks, 32 + 16 sub]
# (SCALES_K: per block of 16 rows and super-block of ``sub`` groups, the rows' fp16 d, then each group's int8 sc).
SCALES_F16, SCALES_F32, SCALES_K = (abi.CONSTANTS[name] for name in ("SCALES_F16", "SCALES_F32", "SCALES_K"))


def pack_scales(values, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Scales or offsets per output row and group, [N, groups] (N % 16 == 0), in the kernels' layout: in
    ``scale_dtype`` (float32, or float16 where that holds them exactly), or (``values`` a ``quant.TwoLevel``: d
    [N, super-blocks] of fp16 values, sc [N, groups] int8) in two levels as they are (SCALES_K)."""
    if not isinstance(values, tuple):
        return values.to(scale_dtype).reshape(values.shape[0] // 16, 16, -1).transpose(1, 2).contiguous()
    d, sc = values
    n, supers = d.shape
    sub = sc.shape[1] // supers
    assert sub * supers == sc.shape[1] and n % 16 == 0 and sc.dtype == torch.int8, (d.shape, sc.shape, sc.dtype)
    half = d.to(torch.float16)
    assert torch.equal(half.float(), d.float()), "two-level scales: d must be fp16 values"
    d_bytes = half.reshape(n // 16, 16, supers).transpose(1, 2).contiguous().view(torch.uint8)  # [N/16, S, 32]
    sc_bytes = sc.reshape(n // 16, 16, supers, sub).permute(0, 2, 3, 1).reshape(n // 16, supers, 16 * sub)
    return torch.cat([d_bytes, sc_bytes.view(torch.uint8)], dim=2).contiguous()


def scale_form(packed: torch.Tensor) -> tuple[int, int, int]:
    """(the kernels' scale_mode, groups a super-block (SCALES_K; else 1), groups) of packed scales."""
    if packed.dtype == torch.uint8:
        sub = (packed.shape[2] - 32) // 16
        return SCALES_K, sub, packed.shape[1] * sub
    assert packed.dtype in (torch.float16, torch.float32), packed.dtype
    return (SCALES_F32 if packed.dtype == torch.float32 else SCALES_F16), 1, packed.shape[1]


def group_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed scales or offsets back to [N, groups] float32: the values the kernels read (SCALES_K: d sc, formed in
    float32 as the kernels form them; exact)."""
    if packed.dtype != torch.uint8:
        return unblock(packed).float()
    blocks, supers, _ = packed.shape
    sub = scale_form(packed)[1]
    d = packed[:, :, :32].contiguous().view(torch.float16).float()  # [N/16, S, 16]
    sc = packed[:, :, 32:].contiguous().view(torch.int8).reshape(blocks, supers, sub, 16).float()
    return unblock((d[:, :, None, :] * sc).reshape(blocks, supers * sub, 16))


def pack_int4(q: torch.Tensor, scales, offsets, scale_dtype: torch.dtype = torch.float32, high_bits: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int4 weights w = scale * q + offset: q [N, K] (uint8 values 0..15; N % 16 == 0, K % 8 == 0) with a scale
    and an offset per output row and group of K, [N, groups] -> the int4 kernel's layout (kernels.c): q
    [N/16, K/8, 64] bytes (byte 4c + j: column c at k0 + j low, k0 + 4 + j high), scales and offsets as
    :func:`pack_scales` packs them (in ``scale_dtype``, or two-level ones as they are). ``offsets`` None:
    w = scale * (q - 8), none stored (GGUF's Q4_0).

    ``high_bits`` 1 or 2 (q in 0..31 or 0..63: GGUF's Q5_K, Q6_K; K % 32 == 0; without offsets w = scale * (q - 16)
    or (q - 32)): each row of 64 bytes of nibbles is followed by its values' bits above the nibble, 16 high_bits
    bytes: the row's 64 bytes of low nibbles (``lo``) and of high ones (``hi``) in lanes of 16 high_bits bytes, byte b
    of lane L holding lo's value at bit high_bits L and hi's at 4 + high_bits L (kernels.c, isa_avx512.h w_int4_high).
    A block is [K/8][64 + 16 high_bits] bytes; the tensor is [N/16, K/8 + K high_bits / 32, 64]."""
    n, k = q.shape
    assert q.dtype == torch.uint8 and (not q.numel() or int(q.max()) < 16 << high_bits), (q.dtype, high_bits)
    cols = q.view(n // 16, 16, k // 8, 2, 4).permute(0, 2, 3, 1, 4)  # [N/16, K/8, lo|hi, 16, 4]
    nibbles = cols & 0x0F
    packed = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(n // 16, k // 8, 64)
    if high_bits:
        assert k % 32 == 0, k
        lanes = 4 // high_bits
        top = (cols >> 4).reshape(n // 16, k // 8, 2, lanes, 16 * high_bits).to(torch.int32)  # [.., lo|hi, L, byte]
        shift = (4 * torch.arange(2).view(2, 1, 1) + high_bits * torch.arange(lanes).view(1, lanes, 1)).to(torch.int32)
        plane = (top << shift).sum(dim=(2, 3)).to(torch.uint8)  # [N/16, K/8, 16 high_bits]
        packed = torch.cat([packed, plane], dim=2).reshape(n // 16, -1, 64)
    return packed.contiguous(), pack_scales(scales, scale_dtype), None if offsets is None else pack_scales(offsets, scale_dtype)


def awq_scales_offsets(zeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's (q - z) s as s q + b: (s, b = -z s), float32 (exact: an fp16 scale times a 4-bit zero)."""
    s = scales.float()
    return s, -zeros.float() * s


def exact_in_fp16(*tensors: torch.Tensor) -> bool:
    return all(torch.equal(t.to(torch.float16).float(), t.float()) for t in tensors)


def int4_supported(out_features: int, in_features: int, group: int) -> bool:
    return out_features % 16 == 0 and in_features % group == 0 and group % 8 == 0


def _scale_args(scales: torch.Tensor, offsets: torch.Tensor | None, k: int) -> tuple[int, int, int]:
    """(group, scale_mode, sub) of a layer's packed scales and offsets (the same form), K inputs."""
    mode, sub, groups = scale_form(scales)
    assert offsets is None or (offsets.dtype, offsets.shape) == (scales.dtype, scales.shape)
    return k // groups, mode, sub


def int4_in_features(packed: torch.Tensor, high_bits: int = 0) -> int:
    """K of an int4 weight packed with ``high_bits`` (its rows of 64 bytes: K/8 of nibbles, K high_bits / 32 more)."""
    return packed.shape[1] * 256 // (32 + 8 * high_bits)


def grouped_desc(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, k: int, int8g: int = 0,
                 high_bits: int = 0) -> LinearDesc:
    """The int4 or int8g kernel's view of a layer of K inputs: int4 (``int8g`` 0, :func:`pack_int4` with
    ``high_bits``) or int8g (1; 2: signed with offsets, :func:`pack_int8g`) weights ``packed`` (N: its padded rows),
    ``scales`` and ``offsets`` (None: symmetric). The tensors must outlive its use."""
    group, mode, sub = _scale_args(scales, offsets, k)
    return LinearDesc(packed.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                      packed.shape[0] * 16, k, group, mode, sub, int8g, high_bits)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                high_bits: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T for int4 W (:func:`pack_int4`, with ``high_bits``; ``offsets`` None: symmetric), x quantized to
    int8 per row and group in the kernel: [M, padded N] (into ``out`` where given, see _packed_product)."""
    desc = grouped_desc(packed, scales, offsets, int4_in_features(packed, high_bits), high_bits=high_bits)
    return _packed_product(x, packed, packed.shape[0] * 16, lambda x, y, m, n, k: _lib().mili_linear_int4(
        ctypes.byref(desc), x.data_ptr(), y.data_ptr(), m, y.stride(0), _threads()), out)


def unpack_int4(packed: torch.Tensor, high_bits: int = 0) -> torch.Tensor:
    """:func:`pack_int4`'s q back: [N, K] uint8 (0..15, with high bits up to 31 or 63)."""
    nb, k = packed.shape[0], int4_in_features(packed, high_bits)
    k8 = k // 8
    rows = packed.reshape(nb, k8, 64 + 16 * high_bits)
    cols = rows[:, :, :64].reshape(nb, k8, 16, 4)
    q = torch.stack([cols & 0x0F, cols >> 4], dim=2)  # [N/16, K/8, lo|hi, 16, 4]
    if high_bits:
        lanes = 4 // high_bits
        plane = rows[:, :, 64:].reshape(nb, k8, 1, 1, 16 * high_bits).to(torch.int32)
        shift = (4 * torch.arange(2).view(2, 1, 1) + high_bits * torch.arange(lanes).view(1, lanes, 1)).to(torch.int32)
        top = ((plane >> shift) & ((1 << high_bits) - 1)).to(torch.uint8)  # [N/16, K/8, lo|hi, L, byte]
        q = q | (top.reshape(nb, k8, 2, 16, 4) << 4)
    return q.permute(0, 3, 1, 2, 4).reshape(nb * 16, k)


def unblock(t: torch.Tensor) -> torch.Tensor:
    """Scales or offsets [N/16, groups, 16] (one level: :func:`pack_scales`) back to [N, groups]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def pack_int8g(q: torch.Tensor, scales, offsets, scale_dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """8-bit weights w = scale * q + offset (int8g, kernels.c): q [N, K] (uint8 values 0..255; N % 16 == 0) with a
    scale and an offset per output row and group of K, [N, groups]; ``offsets`` None: w = scale * (q - 128) (GGUF's
    Q8_0 and Q6_K, none stored) -> the kernel's layout: q [N/16, K/4, 16, 4] (the int8 kernel's), scales and
    offsets as :func:`pack_scales` packs them (in ``scale_dtype``, or two-level ones as they are)."""
    assert q.dtype == torch.uint8 and q.shape[0] % 16 == 0, (q.dtype, q.shape)
    return pack_weight(q), pack_scales(scales, scale_dtype), None if offsets is None else pack_scales(offsets, scale_dtype)


def int8g_supported(out_features: int, in_features: int, group: int) -> bool:
    return out_features % 16 == 0 and group > 0 and in_features % group == 0 and group % 8 == 0


def linear_int8g(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 signed: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T for int8g W (:func:`pack_int8g`), x quantized to int8 per row and group in the kernel:
    [M, padded N] (into ``out`` where given). ``signed`` (with offsets): w = scale * (q - 128) + offset."""
    desc = grouped_desc(packed, scales, offsets, packed.shape[1] * 4, 2 if signed and offsets is not None else 1)
    return _packed_product(x, packed, packed.shape[0] * 16, lambda x, y, m, n, k: _lib().mili_linear_int8g(
        ctypes.byref(desc), x.data_ptr(), y.data_ptr(), m, y.stride(0), _threads()), out)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value (torch.argmax(dim=-1)), read straight from bf16."""
    if logits.dtype != BF16 or logits.dim() != 2 or logits.stride(-1) != 1 or not logits.shape[1]:
        return logits.float().argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _lib().mili_argmax_rows(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                            _threads())
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """In place: -inf in ``logits`` (float32 [B, >= vocab_size]) wherever row ``rows[j]`` of an xgrammar token
    bitmask (int32 [B, ceil(V / 32)]) has a 0 bit; xgrammar's own CPU path is ~10x slower on 152k-wide rows."""
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1 and bitmask.dtype == torch.int32
    assert bitmask.is_contiguous() and bitmask.shape[1] * 32 >= vocab_size and max(rows) < bitmask.shape[0]
    index = torch.tensor(rows, dtype=torch.int64)
    _lib().mili_apply_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                              index.data_ptr(), len(rows), vocab_size, _threads())


# -- the ops set ---------------------------------------------------------------------------------
NormRows = abi.STRUCTS["mili_norm_rows"]  # RMSNorm's rows (and a residual), mili_kernels.h
QKHeads = abi.STRUCTS["mili_qk_heads"]  # the q and k heads of a fused qkv output's rows, for q/k-norm + RoPE


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if (x.dtype != BF16 or x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 16
            or (residual is not None and residual.dtype != BF16)):
        return reference.rms_norm(x, weight, eps, residual)
    t, d = x.shape
    out = torch.empty(t, d, dtype=BF16)
    res_out = None if residual is None else torch.empty(t, d, dtype=BF16)
    residual = None if residual is None else residual.contiguous()
    rows = NormRows(x=x.data_ptr(), ldx=x.stride(0), residual=None if residual is None else residual.data_ptr(),
                    res_out=None if res_out is None else res_out.data_ptr(), out=out.data_ptr(), T=t, D=d)
    _lib().mili_rms_norm(ctypes.byref(rows), weight.contiguous().data_ptr(), eps, _threads())
    return out if residual is None else (out, res_out)


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
    """In place when q and k are the adjacent head ranges of one fused qkv output (the model's case)."""
    t, hq, d = q.shape
    adjacent = (q.dtype == k.dtype == BF16 and q.stride()[1:] == k.stride()[1:] == (d, 1)
                and (t == 1 or q.stride(0) == k.stride(0))  # (a size-1 dim's stride is arbitrary)
                and k.data_ptr() == q.data_ptr() + hq * d * q.element_size())
    if not adjacent or d % 32 or d > 1024 or cos.dtype != torch.float32:
        return reference.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    heads = QKHeads(qkv=q.data_ptr(), ld=q.stride(0), T=t, q_heads=hq, kv_heads=k.shape[1], head_dim=d,
                    cos=cos.data_ptr(), sin=sin.data_ptr())
    _lib().mili_qk_norm_rope(ctypes.byref(heads), q_weight.contiguous().data_ptr(), k_weight.contiguous().data_ptr(),
                             eps, _threads())
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dtype != BF16 or gate_up.dim() != 2 or gate_up.shape[1] % 32:
        return reference.silu_and_mul(gate_up)
    gate_up = gate_up.contiguous()
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=BF16)
    _lib().mili_silu_and_mul(gate_up.data_ptr(), out.data_ptr(), t, i, _threads())
    return out


class CpuOps:
    rms_norm = staticmethod(rms_norm)
    qk_norm_rope = staticmethod(qk_norm_rope)
    silu_and_mul = staticmethod(silu_and_mul)


# -- attention (the pool's pages head-major: [pages, Hkv, page_size, D], see kernels.c) ----------------
@dataclass(frozen=True)
class Int8Pages:
    """One layer's K (or V: ``v``) pages as ``--kv-cache-dtype int8`` holds them: ``values`` int8, [pages, Hkv,
    page_size, D] bytes (head-major, as the bf16 pages; within each page and kv head, the decode kernel's layout:
    K's rows in blocks of 16 stored value pair by value pair, V's rows interleaved two by two, kernels.c "int8 pages";
    :meth:`rows` undoes it) beside ``scales`` float32 [pages, Hkv, page_size], one symmetric scale per (token, kv
    head) row: amax / 127, the row's values round(x / scale) (:func:`quantize_kv_rows` is its torch form). The store,
    the decode attention (its fused layer's too) and the gather of a prefill chunk's context take them in place of a
    bf16 page tensor."""

    values: torch.Tensor
    scales: torch.Tensor
    v: bool = False
    dtype = torch.int8

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str = "cpu", v: bool = False) -> Int8Pages:
        return cls(host_memory.zeros(shape, torch.int8, device), host_memory.zeros(shape[:-1], torch.float32, device),
                   v)

    @staticmethod
    def row_bytes(head_dim: int) -> int:
        """The bytes of one token's one kv head: its values and its float32 scale."""
        return head_dim + 4

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.values, self.scales

    def rows(self) -> torch.Tensor:
        """The values as rows, [pages, Hkv, page_size, D] with each row's D values in order: the layout undone. K: a
        block of m <= 16 rows is [D / 2][m][2]; V: rows 2i and 2i + 1 are [D][2], an odd page's last row [D]."""
        p, hkv, ps, d = self.values.shape
        run = self.values.reshape(p, hkv, ps * d)
        if self.v:
            n = ps // 2 * 2
            out = run[..., :n * d].reshape(p, hkv, ps // 2, d, 2).transpose(-1, -2).reshape(p, hkv, n, d)
            return torch.cat([out, run[..., n * d:].reshape(p, hkv, ps - n, d)], 2)
        blocks = [(b, min(16, ps - b)) for b in range(0, ps, 16)]
        return torch.cat([run[..., b * d:(b + m) * d].reshape(p, hkv, d // 2, m, 2).transpose(2, 3)
                          .reshape(p, hkv, m, d) for b, m in blocks], 2)


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 pages' quantization in torch (the kernels' reference): x [..., D] -> (int8 values [..., D], float32
    scales [...]), scale = amax / 127 per row, values x times 1 / scale rounded to nearest even (0 for a zero row)."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round(x * inv[..., None]).to(torch.int8), scale


KVPages = abi.STRUCTS["mili_kv_pages"]  # one layer's K/V pages, bf16 or int8 (mili_kernels.h)
SeqPages = abi.STRUCTS["mili_seq_pages"]  # the pages each of a batch's sequences holds


def kv_pages(k_cache: torch.Tensor | Int8Pages, v_cache: torch.Tensor | Int8Pages) -> KVPages:
    """The kernels' view of one layer's pages (int8: values and scales)."""
    _, hkv, page_size, d = k_cache.shape
    if isinstance(k_cache, Int8Pages):
        return KVPages(k_cache.values.data_ptr(), v_cache.values.data_ptr(), k_cache.scales.data_ptr(),
                       v_cache.scales.data_ptr(), hkv, d, page_size)
    return KVPages(k_cache.data_ptr(), v_cache.data_ptr(), None, None, hkv, d, page_size)


def seq_pages(page_table: torch.Tensor, context_lens: torch.Tensor) -> SeqPages:
    """page_table [B, ldp] and context_lens [B] (both int64, contiguous rows: :func:`decode_metadata`)."""
    assert page_table.dtype == context_lens.dtype == torch.int64 and page_table.stride(1) == 1
    return SeqPages(page_table.data_ptr(), page_table.stride(0), context_lens.data_ptr(), context_lens.shape[0])


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | Int8Pages, v_cache: torch.Tensor | Int8Pages,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (bf16, rows of D contiguous) written at flat slots; slot < 0 is skipped. Int8 pages:
    each (token, kv head) row quantized with its own scale."""
    slots = slot_mapping.to(torch.int64).contiguous()
    if isinstance(k_cache, Int8Pages):
        assert k.dtype == v.dtype == BF16 and k.stride()[1:] == v.stride()[1:] == (k.shape[2], 1), (k.dtype, k.stride())
    _lib().mili_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), k.shape[0],
                         ctypes.byref(kv_pages(k_cache, v_cache)), _threads())


def gather_pages(cache: torch.Tensor | Int8Pages, page_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` cached entries of each row of ``page_table``: [B, num_tokens, Hkv, D] (int8 pages:
    dequantized, bf16(value x scale))."""
    if isinstance(cache, Int8Pages):
        _, hkv, page_size, d = cache.shape
        table = page_table.to(torch.int64).contiguous()
        out = torch.empty(table.shape[0], num_tokens, hkv, d, dtype=BF16)
        seqs = SeqPages(table.data_ptr(), table.stride(0), None, table.shape[0])  # (the gather reads no lengths)
        _lib().mili_gather_kv_int8(ctypes.byref(kv_pages(cache, cache)), int(cache.v), ctypes.byref(seqs),
                                   num_tokens, out.data_ptr(), _threads())
        return out
    num_pages = -(-num_tokens // cache.shape[2])
    pages = cache.index_select(0, page_table[:, :num_pages].reshape(-1))  # [B * n, Hkv, page, D]
    b, hkv, d = page_table.shape[0], cache.shape[1], cache.shape[3]
    pages = pages.view(b, num_pages, hkv, cache.shape[2], d).permute(0, 1, 3, 2, 4)
    return pages.reshape(b, num_pages * cache.shape[2], hkv, d)[:, :num_tokens]


def decode_metadata(page_table: torch.Tensor, context_lens: list[int], b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``b`` sequences' page table and lengths as the kernels read them (int64, contiguous)."""
    return page_table[:b].to(torch.int64).contiguous(), torch.tensor(context_lens[:b], dtype=torch.int64)


def decode_attention_supported(q: torch.Tensor, k_cache: torch.Tensor | Int8Pages) -> bool:
    d = q.shape[-1]
    if isinstance(k_cache, Int8Pages):  # (D <= 512: q . k's int32 sums)
        return q.dtype == BF16 and d % 32 == 0 and d <= 512 and q.stride()[1:] == (d, 1)
    return (q.dtype == k_cache.dtype == BF16 and d % 32 == 0 and q.stride()[1:] == (d, 1)
            and k_cache.is_contiguous())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor | Int8Pages, v_cache: torch.Tensor | Int8Pages,
                     page_table: torch.Tensor, context_lens: list[int], scale: float) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], over each sequence's pages in place: [B, Hq, D]."""
    b, hq, d = q.shape
    page_table, lens = decode_metadata(page_table, context_lens, b)
    out = torch.empty(b, hq, d, dtype=BF16)
    _lib().mili_decode_attention(q.data_ptr(), q.stride(0), hq, scale, ctypes.byref(kv_pages(k_cache, v_cache)),
                                 ctypes.byref(seq_pages(page_table, lens)), out.data_ptr(), _threads())
    return out


PrefillChunk = abi.STRUCTS["mili_prefill_chunk"]  # one sequence's prefill chunk: its q, k, v (mili_kernels.h)


def prefill_attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    d = q.shape[-1]
    return (q.dtype == k.dtype == v.dtype == BF16 and d % 32 == 0
            and all(t.stride()[1:] == (d, 1) for t in (q, k, v)))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prefill chunk: q [Lq, Hq, D] are the last Lq of the Lk positions of k, v
    [Lk, Hkv, D]: [Lq, Hq, D], written into ``out`` where given (bf16, its rows of Hq x D contiguous)."""
    lq, hq, d = q.shape
    if out is None:
        out = torch.empty(lq, hq, d, dtype=BF16)
    chunk = PrefillChunk(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), ldq=q.stride(0), ldk=k.stride(0),
                         ldv=v.stride(0), Lq=lq, Lk=k.shape[0], q_heads=hq, kv_heads=k.shape[1], head_dim=d)
    _lib().mili_prefill_attention(ctypes.byref(chunk), scale, out.data_ptr(), out.stride(0), _threads())
    return out


# -- Gated DeltaNet (the hybrid models' linear attention) ----------------------------------------------------
GDNLayer = abi.STRUCTS["mili_gdn_layer"]  # a layer's conv and decay weights, shape and state slots (mili_kernels.h)
GDNStep = abi.STRUCTS["mili_gdn_step"]  # a decode step's B sequences into it


def gdn_decode_supported(qkv: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                         head_k_dim: int, head_v_dim: int) -> bool:
    return (qkv.dtype in (BF16, torch.float32) and conv_states.dtype == qkv.dtype and conv_states.is_contiguous()
            and ssm_states.dtype == torch.float32 and ssm_states.is_contiguous() and head_v_dim % 16 == 0
            and head_k_dim <= 1024 and qkv.stride(-1) == 1)


def gdn_decode(qkv: torch.Tensor, ba: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
               slots: torch.Tensor, fresh: torch.Tensor | None, conv_weight: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """One decode step of B sequences (kernels.c, mili_gdn_decode): qkv [B, conv_dim] before the conv, ba
    [B, 2 Hv] (b | a), their slots [B] (int64) and which start a sequence (``fresh``, bool, or None); the
    conv states [rows, conv_dim, K - 1] (qkv's dtype) and float32 SSM states [rows, Hv, Dk, Dv] are updated in
    place. ``conv_weight`` [conv_dim, K], ``A_log``, ``dt_bias`` [Hv]: float32. Returns out [B, Hv, Dv] float32."""
    b, hv = qkv.shape[0], ba.shape[1] // 2
    out = torch.empty(b, hv, head_v_dim, dtype=torch.float32)
    if b == 0:
        return out
    ba = ba if ba.stride(-1) == 1 else ba.contiguous()
    slots = slots.to(torch.int64).contiguous()
    fresh = None if fresh is None else fresh.to(torch.uint8).contiguous()
    layer = GDNLayer(conv_w=conv_weight.data_ptr(), A_log=A_log.data_ptr(), dt_bias=dt_bias.data_ptr(),
                     conv_states=conv_states.data_ptr(), ssm_states=ssm_states.data_ptr(), k_heads=num_k_heads,
                     v_heads=hv, k_dim=head_k_dim, v_dim=head_v_dim, conv_width=conv_weight.shape[1],
                     bf16_io=int(qkv.dtype == BF16))
    step = GDNStep(qkv=qkv.data_ptr(), ba=ba.data_ptr(), ldq=qkv.stride(0), ldba=ba.stride(0), slots=slots.data_ptr(),
                   fresh=None if fresh is None else fresh.data_ptr(), B=b)
    _lib().mili_gdn_decode(ctypes.byref(layer), ctypes.byref(step), out.data_ptr(), _threads())
    return out
