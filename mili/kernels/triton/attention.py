"""Paged attention in Triton: writing K/V through a slot mapping, and decode (flash-decoding). A step with prefill
chunks attends by the one kernel over its decodes and chunks in ``varlen_attention.py``.

The KV pool of a layer is ``[num_pages, page_size, num_kv_heads, head_dim]`` (K and V apart); a
sequence's tokens live in the pages its page-table row names, in order. GQA is handled by giving one
program all the query heads of a KV head (packed into the rows of one tile), so K/V are read once and
never repeated. Each kernel has a torch reference in ``mili/kernels/reference.py``.

FP8 KV cache (pages of float8_e4m3fn): the store divides K and V by their layer's scales and rounds to
e4m3; attention reads the e4m3 values into the query's dtype (exactly) and applies the scales where they
are cheapest and exact alike: K's folded into the softmax scale, V's on the output.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mili.kernels.triton.fp8 import to_fp8
from mili.kernels.triton.launch import device_spec


def exact_dots(dtype: torch.dtype) -> bool:
    """Whether tl.dot should run in float32 (IEEE): for float32 models (the GPU's default TF32 would
    lose float32 parity), and under TRITON_INTERPRET, whose dot mishandles bf16 operands (products of
    bf16 values are exact in float32, so this computes what the GPU's bf16 MMA accumulates)."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


# -- K/V store ------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(K, V, KC, VC, SLOTS, k_scale, v_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_ch, D: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(SLOTS + t)
    if slot < 0:  # padding rows (CUDA graphs) write nothing
        return
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:
        k = to_fp8(tl.math.div_rn(k.to(tl.float32), k_scale))
        v = to_fp8(tl.math.div_rn(v.to(tl.float32), v_scale))
    tl.store(KC + slot * stride_cs + h * stride_ch + d, k, mask=mask)
    tl.store(VC + slot * stride_cs + h * stride_ch + d, v, mask=mask)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, Hkv, D] written at flat slots (page * page_size + offset); slot < 0 is skipped. FP8 pages
    hold k / k_scale and v / v_scale."""
    t, h, d = k.shape
    kc, vc = k_cache.view(-1, h, d), v_cache.view(-1, h, d)
    _store_kv_kernel[(t, h)](k, v, kc, vc, slot_mapping, k_scale, v_scale, k.stride(0), k.stride(1), v.stride(0),
                             v.stride(1), kc.stride(0), kc.stride(1), **store_kv_meta(d, k_cache.dtype))


# -- launch configurations: pure functions of the shapes and dtypes (the compile check calls them too) -----
def store_kv_meta(head_dim: int, cache_dtype: torch.dtype) -> dict:
    return dict(D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), FP8=cache_dtype == torch.float8_e4m3fn)


# The decode grid: (sequence, KV head, split). The split count is a function of static things only (batch size,
# KV heads, the page table's width, the SM count), so a CUDA graph captured for a batch size holds for every
# context; each program divides its own sequence's live context (read on the device) among the splits.
DECODE_MIN_KEYS = 128  # keys a split takes at least: short contexts use few splits, the rest exit at once
DECODE_MAX_SPLITS = 64
DECODE_PROGRAMS_PER_SM = 4


def decode_splits(batch: int, kv_heads: int, max_pages: int, page: int, num_sms: int) -> int:
    """The decode launch's split count: about ``DECODE_PROGRAMS_PER_SM`` programs an SM over batch x KV heads
    x splits, at most ``DECODE_MAX_SPLITS``, and no more than the longest context (``max_pages`` pages) can
    fill at ``DECODE_MIN_KEYS`` keys a split."""
    longest = triton.cdiv(max_pages * page, DECODE_MIN_KEYS)
    want = triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, batch * kv_heads)
    return max(1, min(want, DECODE_MAX_SPLITS, longest))


def decode_meta(group: int, page: int, head_dim: int, dtype: torch.dtype, single: bool = False) -> dict:
    """``single``: the launch has one split, so the kernel normalizes and writes the output itself (no reduce)."""
    block_n = decode_block_n(head_dim, dtype)
    return dict(GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), PAGE=page, D=head_dim,
                BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n, MIN_BLOCKS=DECODE_MIN_KEYS // block_n,
                SINGLE=single, EXACT=exact_dots(dtype))


def decode_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys a decode iteration: 64 at head_dim 128 (32 in float32, 128 at 64), whatever the page size. The K and
    V tiles (BLOCK_N x head_dim, pipelined) keep to about 40 KiB of shared memory (compile check: 43 KiB at
    head_dim 128 in float32, 42 KiB at 256 in bf16; twice the keys would need 78 / 76 KiB and spill more)."""
    wide = triton.next_power_of_2(head_dim) * (2 if dtype == torch.float32 else 1)
    return min(128, max(16, 8192 // wide))


def decode_reduce_meta(head_dim: int, num_splits: int) -> dict:
    return dict(D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=triton.next_power_of_2(num_splits))


def decode_reduce_splits() -> list[int]:
    """Every BLOCK_S the reduce can be launched with (split counts 2 .. DECODE_MAX_SPLITS), for the compile check."""
    return [1 << i for i in range(1, DECODE_MAX_SPLITS.bit_length()) if 1 << i <= DECODE_MAX_SPLITS]


# -- decode ---------------------------------------------------------------------------------------
@triton.jit
def _decode_kernel(Q, KC, VC, PT, CTX, OUT, OUT_ACC, OUT_ML, scale, v_scale,
                   stride_qb, stride_qh, stride_cp, stride_cs, stride_ch, stride_pt, stride_ob, stride_oh,
                   stride_ab, stride_ah, stride_as, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                   PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   MIN_BLOCKS: tl.constexpr, SINGLE: tl.constexpr, EXACT: tl.constexpr):
    """One (sequence, KV head, split), every query head of the group at once. The sequence's live context, in
    blocks of BLOCK_N keys, is divided among the launch's splits (at least MIN_BLOCKS blocks each): a split
    past the context's end records an empty part (m = -inf) and exits. SINGLE (one split): the output itself."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(CTX + b)
    blocks = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(blocks, tl.num_programs(2)), MIN_BLOCKS)
    first = split * per_split
    last = tl.minimum(first + per_split, blocks)
    rows = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + rows
    hmask = rows < GROUP
    base = b * stride_ab + heads * stride_ah + split * stride_as  # (SINGLE: unused)
    if not SINGLE:
        if first >= last:
            tl.store(OUT_ML + 2 * (base // D), tl.full([BLOCK_H], float("-inf"), tl.float32), mask=hmask)
            return
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for blk in range(first, last):
        kpos = blk * BLOCK_N + offs
        valid = kpos < ctx
        page = tl.load(PT + b * stride_pt + kpos // PAGE, mask=valid, other=0)  # each key's page
        kv_ptrs = page[:, None] * stride_cp + (kpos % PAGE)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kvmask = valid[:, None] & dmask[None, :]
        k = tl.load(KC + kv_ptrs, mask=kvmask, other=0.0).to(q.dtype)  # (FP8 pages: exactly)
        v = tl.load(VC + kv_ptrs, mask=kvmask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), EXACT) * scale
        s = tl.where(valid[None, :], s, float("-inf"))  # (every block has a valid key: m stays finite)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        prob = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + _dot(prob.to(v.dtype), v, EXACT)
        m = m_new
    omask = hmask[:, None] & dmask[None, :]
    if SINGLE:
        out = acc * v_scale / tl.where(l == 0.0, 1.0, l)[:, None]  # (l = 0: an empty context, a padding row)
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=omask)
    else:
        tl.store(OUT_ACC + base[:, None] + d[None, :], acc * v_scale, mask=omask)
        tl.store(OUT_ML + 2 * (base // D), m, mask=hmask)  # (m, l) pairs share the acc layout / D
        tl.store(OUT_ML + 2 * (base // D) + 1, l, mask=hmask)


@triton.jit
def _decode_reduce_kernel(ACC, ML, OUT, num_splits, stride_ab, stride_ah, stride_as, stride_ob, stride_oh,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One (sequence, query head): the splits' parts merged. An empty split (m = -inf) wrote nothing else."""
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = b * stride_ab + h * stride_ah + s * stride_as
    m = tl.load(ML + 2 * (base // D), mask=s < num_splits, other=float("-inf"))
    used = m > float("-inf")
    l = tl.load(ML + 2 * (base // D) + 1, mask=used, other=0.0)
    w = tl.where(used, tl.exp(m - tl.max(m, 0)), 0.0)
    acc = tl.load(ACC + base[:, None] + d[None, :], mask=used[:, None] & (d[None, :] < D), other=0.0)
    total = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d < D)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, max_pages: int | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0, split_batch: int | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (one token per sequence) -> [B, Hq, D], attending to context_lens[b] cached tokens.

    ``max_pages`` bounds the pages any sequence uses (default: the page table's width); with the batch size,
    the KV heads and the SM count it fixes the split count (``decode_splits``); each sequence's context is
    divided among the splits, processed in parallel and reduced (flash-decoding), or with one split written
    directly. ``k_scale``/``v_scale``: what FP8 pages' entries are multiplied by (see store_kv). ``split_batch``: the
    batch size the split count is chosen for (default B): an eager batch names the size its CUDA graph would be
    padded to, so both split alike and compute the same values."""
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    group = hq // hkv
    num_splits = decode_splits(split_batch or b, hkv, max_pages or page_table.shape[1], page, device_spec(q.device).num_sms)
    single = num_splits == 1
    out = torch.empty_like(q)
    parts = (1, 1) if single else (b, hq, num_splits)  # (one split: nothing to reduce, a stand-in buffer)
    acc = torch.empty(*parts, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(*parts, 2, dtype=torch.float32, device=q.device)
    stride_acc = (0, 0, 0) if single else acc.stride()[:3]
    _decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, page_table, context_lens, out, acc, ml, scale * k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        out.stride(0), out.stride(1), *stride_acc, **decode_meta(group, page, d, q.dtype, single))
    if not single:
        _decode_reduce_kernel[(b, hq)](acc, ml, out, num_splits, acc.stride(0), acc.stride(1), acc.stride(2),
                                       out.stride(0), out.stride(1), **decode_reduce_meta(d, num_splits))
    return out
