"""Fused RMSNorm (optionally adding the residual first) and fused q/k-norm + RoPE, in Triton.

Numerics follow HF transformers: the residual add is rounded to the model dtype, the norm is computed
in float32 and rounded before the weight is applied; RoPE runs in the model dtype (rotate-half). All
arithmetic is float32 with an explicit rounding (``_r``) wherever torch rounds a model-dtype result,
which gives torch's values on the GPU and keeps the interpreter (no native bf16 math) exact too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _qk_norm_rope_kernel(X, W, COS, SIN, OUT, eps, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                         D: tl.constexpr, HALF: tl.constexpr):
    """One (token, head): RMSNorm over head_dim with the per-head weight, then rotate-half RoPE."""
    t, h = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, HALF)
    base = X + t * stride_xt + h * stride_xh
    x1 = tl.load(base + i).to(tl.float32)
    x2 = tl.load(base + HALF + i).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
    dt = OUT.dtype.element_ty
    n1 = _r(tl.load(W + i).to(tl.float32) * _r(x1 * rstd, dt), dt)
    n2 = _r(tl.load(W + HALF + i).to(tl.float32) * _r(x2 * rstd, dt), dt)
    c1, c2 = _r(tl.load(COS + t * stride_c + i), dt), _r(tl.load(COS + t * stride_c + HALF + i), dt)
    s1, s2 = _r(tl.load(SIN + t * stride_c + i), dt), _r(tl.load(SIN + t * stride_c + HALF + i), dt)
    o = OUT + t * stride_ot + h * stride_oh
    tl.store(o + i, (_r(n1 * c1, dt) - _r(n2 * s1, dt)).to(dt))  # q*cos + rotate_half(q)*sin
    tl.store(o + HALF + i, (_r(n2 * c2, dt) + _r(n1 * s2, dt)).to(dt))


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
