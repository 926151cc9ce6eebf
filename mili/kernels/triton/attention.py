"""Paged attention in Triton: writing K/V through a slot mapping, decode (flash-decoding), prefill.

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


def decode_meta(group: int, page: int, head_dim: int, dtype: torch.dtype) -> dict:
    return dict(GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), PAGE=page, D=head_dim,
                BLOCK_D=triton.next_power_of_2(head_dim), EXACT=exact_dots(dtype))


def decode_reduce_meta(head_dim: int, num_splits: int) -> dict:
    return dict(D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=triton.next_power_of_2(num_splits))


PREFILL_BLOCK_M = 32


def prefill_meta(group: int, page: int, head_dim: int, dtype: torch.dtype, block_m: int = PREFILL_BLOCK_M) -> dict:
    return dict(GROUP=group, BLOCK_M=block_m, PAGE=page, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                EXACT=exact_dots(dtype))


# -- decode ---------------------------------------------------------------------------------------
@triton.jit
def _decode_kernel(Q, KC, VC, PT, CTX, OUT_ACC, OUT_ML, scale, v_scale, pages_per_split,
                   stride_qb, stride_qh, stride_cp, stride_cs, stride_ch, stride_pt,
                   stride_ab, stride_ah, stride_as, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                   PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, EXACT: tl.constexpr):
    """One (sequence, KV head, split): the split's pages, every query head of the group at once."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(CTX + b)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, tl.cdiv(ctx, PAGE))
    rows = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(rows[:, None] < GROUP) & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs = tl.arange(0, PAGE)
    for p in range(first, last):
        page = tl.load(PT + b * stride_pt + p)
        valid = p * PAGE + offs < ctx
        kv_ptrs = page * stride_cp + offs[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kvmask = valid[:, None] & dmask[None, :]
        k = tl.load(KC + kv_ptrs, mask=kvmask, other=0.0).to(q.dtype)  # (FP8 pages: exactly)
        v = tl.load(VC + kv_ptrs, mask=kvmask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), EXACT) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        prob = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + _dot(prob.to(v.dtype), v, EXACT)
        m = m_new
    hmask = rows < GROUP
    base = b * stride_ab + heads * stride_ah + split * stride_as
    tl.store(OUT_ACC + base[:, None] + d[None, :], acc * v_scale, mask=hmask[:, None] & dmask[None, :])
    tl.store(OUT_ML + 2 * (base // D), m, mask=hmask)  # (m, l) pairs share the acc layout / D
    tl.store(OUT_ML + 2 * (base // D) + 1, l, mask=hmask)


@triton.jit
def _decode_reduce_kernel(ACC, ML, OUT, num_splits, stride_ab, stride_ah, stride_as, stride_ob, stride_oh,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    base = b * stride_ab + h * stride_ah + s * stride_as
    m = tl.load(ML + 2 * (base // D), mask=smask, other=float("-inf"))
    l = tl.load(ML + 2 * (base // D) + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - m_max), 0.0)
    acc = tl.load(ACC + base[:, None] + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d < D)


def decode_splits(max_pages: int, target: int = 8, min_pages_per_split: int = 4) -> tuple[int, int]:
    """(number of splits, pages per split) for contexts up to ``max_pages`` pages."""
    pages_per_split = max(min_pages_per_split, triton.cdiv(max_pages, target))
    return triton.cdiv(max_pages, pages_per_split), pages_per_split


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, max_pages: int | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> torch.Tensor:
    """q: [B, Hq, D] (one token per sequence) -> [B, Hq, D], attending to context_lens[b] cached tokens.

    ``max_pages`` bounds the pages any sequence uses (default: the page table's width); the context is
    split into chunks processed in parallel and reduced (flash-decoding). ``k_scale``/``v_scale``: what
    FP8 pages' entries are multiplied by (see store_kv)."""
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    group = hq // hkv
    num_splits, per_split = decode_splits(max_pages or page_table.shape[1])
    acc = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, page_table, context_lens, acc, ml, scale * k_scale, v_scale, per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), **decode_meta(group, page, d, q.dtype))
    out = torch.empty_like(q)
    _decode_reduce_kernel[(b, hq)](acc, ml, out, num_splits, acc.stride(0), acc.stride(1), acc.stride(2),
                                   out.stride(0), out.stride(1), **decode_reduce_meta(d, num_splits))
    return out


# -- prefill --------------------------------------------------------------------------------------
@triton.jit
def _prefill_kernel(Q, KC, VC, OUT, PT, QSTART, QLEN, CTX, scale, v_scale,
                    stride_qt, stride_qh, stride_cp, stride_cs, stride_ch, stride_pt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                    BLOCK_D: tl.constexpr, EXACT: tl.constexpr):
    """A block of BLOCK_M queries of one sequence and one query head, over the cached prefix and the
    chunk itself (already stored in the pages), causally, with an online softmax."""
    b, mblock, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    qlen = tl.load(QLEN + b)
    if mblock * BLOCK_M >= qlen:
        return
    ctx = tl.load(CTX + b)
    qstart = tl.load(QSTART + b)
    kvh = h // GROUP
    rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < qlen
    qpos = ctx - qlen + rows  # absolute positions of these queries
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + (qstart + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs = tl.arange(0, PAGE)
    last_key = tl.minimum(ctx - qlen + (mblock + 1) * BLOCK_M, ctx)  # one past the last key needed
    for p in range(0, tl.cdiv(last_key, PAGE)):
        page = tl.load(PT + b * stride_pt + p)
        kpos = p * PAGE + offs
        kv_ptrs = page * stride_cp + offs[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kvmask = (kpos < ctx)[:, None] & dmask[None, :]
        k = tl.load(KC + kv_ptrs, mask=kvmask, other=0.0).to(q.dtype)  # (FP8 pages: exactly)
        v = tl.load(VC + kv_ptrs, mask=kvmask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), EXACT) * scale
        s = tl.where((kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < ctx), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m - m_safe)
        prob = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + _dot(prob.to(v.dtype), v, EXACT)
        m = m_new
    out = acc * v_scale / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(OUT + (qstart + rows)[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                  query_start: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                  max_query_len: int, scale: float, block_m: int = PREFILL_BLOCK_M, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """q: [T, Hq, D], the chunks of several sequences concatenated (sequence b's at
    query_start[b] .. + query_lens[b], positions context_lens[b] - query_lens[b] ..). Their K/V must
    already be in the pages. Returns [T, Hq, D]."""
    t, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    grid = (page_table.shape[0], triton.cdiv(max_query_len, block_m), hq)
    _prefill_kernel[grid](q, k_cache, v_cache, out, page_table, query_start, query_lens, context_lens,
                          scale * k_scale, v_scale,
                          q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          page_table.stride(0), out.stride(0), out.stride(1),
                          **prefill_meta(hq // hkv, page, d, q.dtype, block_m))
    return out
