"""Fused RMSNorm (optionally adding the residual first) and fused q/k-norm + RoPE, in Triton; the latter also
with the K/V store (``qk_norm_rope_store``: q, k and v of a layer in one launch, k and v into the paged cache).

Numerics follow HF transformers: the residual add is rounded to the model dtype, the norm is computed
in float32 and rounded before the weight is applied; RoPE runs in the model dtype (rotate-half). All
arithmetic is float32 with an explicit rounding (``_r``) wherever torch rounds a model-dtype result,
which gives torch's values on the GPU and keeps the interpreter (no native bf16 math) exact too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mili.kernels.triton.fp8 import to_fp8


@triton.jit
def _r(x, dt: tl.constexpr):
    """Round float32 to the model dtype and back: what one model-dtype operation in torch yields."""
    return x.to(dt).to(tl.float32)


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, R_OUT, eps, stride_x, stride_r, stride_o, stride_ro,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = OUT.dtype.element_ty
    xf = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        xf = _r(xf + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32), dt)
        tl.store(R_OUT + row * stride_ro + cols, xf.to(dt), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * _r(xf * rstd, dt)).to(dt), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim; with ``residual``: (norm(x + residual), x + residual)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    r_out = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, r_out, eps, x2.stride(0), r2.stride(0), out.stride(0),
                                     r_out.stride(0), **rms_norm_meta(n, residual is not None))
    if residual is None:
        return out.view_as(x)
    return out.view_as(x), r_out.view_as(x)


def rms_norm_meta(n: int, has_residual: bool) -> dict:
    return dict(N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=has_residual)


def qk_norm_rope_meta(head_dim: int) -> dict:
    return dict(D=head_dim, HALF=head_dim // 2)


@triton.jit
def _head_norm_rope(X, W, COS, SIN, eps, D: tl.constexpr, HALF: tl.constexpr, dt: tl.constexpr):
    """One head at X: RMSNorm over head_dim with the per-head weight W, then rotate-half RoPE with the token's
    cos/sin rows. Returns the two halves as float32 values one rounding to ``dt`` short of torch's result."""
    i = tl.arange(0, HALF)
    x1 = tl.load(X + i).to(tl.float32)
    x2 = tl.load(X + HALF + i).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
    n1 = _r(tl.load(W + i).to(tl.float32) * _r(x1 * rstd, dt), dt)
    n2 = _r(tl.load(W + HALF + i).to(tl.float32) * _r(x2 * rstd, dt), dt)
    c1, c2 = _r(tl.load(COS + i), dt), _r(tl.load(COS + HALF + i), dt)
    s1, s2 = _r(tl.load(SIN + i), dt), _r(tl.load(SIN + HALF + i), dt)
    return _r(n1 * c1, dt) - _r(n2 * s1, dt), _r(n2 * c2, dt) + _r(n1 * s2, dt)  # q*cos + rotate_half(q)*sin


@triton.jit
def _qk_norm_rope_kernel(X, W, COS, SIN, OUT, eps, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                         D: tl.constexpr, HALF: tl.constexpr):
    """One (token, head): RMSNorm over head_dim with the per-head weight, then rotate-half RoPE."""
    t, h = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, HALF)
    dt = OUT.dtype.element_ty
    o1, o2 = _head_norm_rope(X + t * stride_xt + h * stride_xh, W, COS + t * stride_c, SIN + t * stride_c, eps,
                             D, HALF, dt)
    o = OUT + t * stride_ot + h * stride_oh
    tl.store(o + i, o1.to(dt))
    tl.store(o + HALF + i, o2.to(dt))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D] (views are fine); cos/sin: [T, D]. Returns new contiguous q, k."""
    d = q.shape[-1]
    assert d % 2 == 0 and triton.next_power_of_2(d // 2) == d // 2, "head_dim must be 2 x a power of two"
    outs = []
    for x, w in ((q, q_weight), (k, k_weight)):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _qk_norm_rope_kernel[(x.shape[0], x.shape[1])](x, w, cos, sin, out, eps, x.stride(0), x.stride(1),
                                                       out.stride(0), out.stride(1), cos.stride(0),
                                                       **qk_norm_rope_meta(d))
        outs.append(out)
    return outs[0], outs[1]


# -- q/k-norm + RoPE with the K/V store: one launch for a layer's q, k and v ------------------------------------
@triton.jit
def _page_value(x, scale, page_dt: tl.constexpr, FP8: tl.constexpr):
    """A K/V value (float32 holding a model-dtype value) as a page of ``page_dt`` stores it: itself, or FP8 of
    x / scale (as attention._store_kv_kernel: a correctly rounded division, then e4m3's round to nearest even)."""
    if FP8:
        x = to_fp8(tl.math.div_rn(x, scale))
    return x.to(page_dt)


@triton.jit
def _qk_norm_rope_store_kernel(Q, K, V, QW, KW, COS, SIN, Q_OUT, KC, VC, SLOTS, eps, k_scale, v_scale, num_q_heads,
                               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                               stride_c, stride_cs, stride_ch, D: tl.constexpr, HALF: tl.constexpr,
                               FP8: tl.constexpr):
    """Program (token, head): heads below ``num_q_heads`` are q's (normed, rotated, written to Q_OUT); the
    others are KV head h - num_q_heads: k normed and rotated, then k and v written into the pages at the
    token's slot (slot < 0, a CUDA graph's padding row: nothing written). Each value is what
    ``_qk_norm_rope_kernel`` followed by ``attention._store_kv_kernel`` writes, bit for bit."""
    t, h = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, HALF)
    dt = Q_OUT.dtype.element_ty
    cos, sin = COS + t * stride_c, SIN + t * stride_c
    if h < num_q_heads:
        o1, o2 = _head_norm_rope(Q + t * stride_qt + h * stride_qh, QW, cos, sin, eps, D, HALF, dt)
        o = Q_OUT + t * stride_ot + h * stride_oh
        tl.store(o + i, o1.to(dt))
        tl.store(o + HALF + i, o2.to(dt))
    else:
        slot = tl.load(SLOTS + t)
        if slot >= 0:
            hk = h - num_q_heads
            k1, k2 = _head_norm_rope(K + t * stride_kt + hk * stride_kh, KW, cos, sin, eps, D, HALF, dt)
            v = V + t * stride_vt + hk * stride_vh
            v1, v2 = tl.load(v + i).to(tl.float32), tl.load(v + HALF + i).to(tl.float32)
            kc, vc = KC + slot * stride_cs + hk * stride_ch, VC + slot * stride_cs + hk * stride_ch
            page_dt = KC.dtype.element_ty
            tl.store(kc + i, _page_value(_r(k1, dt), k_scale, page_dt, FP8))  # (k rounded as q's output is)
            tl.store(kc + HALF + i, _page_value(_r(k2, dt), k_scale, page_dt, FP8))
            tl.store(vc + i, _page_value(v1, v_scale, page_dt, FP8))
            tl.store(vc + HALF + i, _page_value(v2, v_scale, page_dt, FP8))


def qk_norm_rope_store_meta(head_dim: int, cache_dtype: torch.dtype) -> dict:
    return dict(D=head_dim, HALF=head_dim // 2, FP8=cache_dtype == torch.float8_e4m3fn)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """``qk_norm_rope`` and ``attention.store_kv`` in one launch: q [T, Hq, D], k / v [T, Hkv, D] (views are fine),
    cos/sin [T, D]; the pages [pages, page_size, Hkv, D] (the Triton backend's layout; FP8 pages hold k / k_scale
    and v / v_scale). Returns the new contiguous q; k (normed and rotated) and v are written at ``slot_mapping``
    (slot < 0 skipped)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert d % 2 == 0 and triton.next_power_of_2(d // 2) == d // 2, "head_dim must be 2 x a power of two"
    assert k.stride(-1) == v.stride(-1) == q.stride(-1) == 1 and cos.stride(-1) == sin.stride(-1) == 1
    kc, vc = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t:
        _qk_norm_rope_store_kernel[(t, hq + hkv)](
            q, k, v, q_weight, k_weight, cos, sin, q_out, kc, vc, slot_mapping, eps, k_scale, v_scale, hq,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
            q_out.stride(1), cos.stride(0), kc.stride(0), kc.stride(1), **qk_norm_rope_store_meta(d, k_cache.dtype))
    return q_out
