"""A split-K GEMV for decode batches: ``y = x W^T (+ bias)`` with x [M <= 8, K] and W [N, K] in bf16 / fp16 (float32
for tests), W streamed once.

At a handful of rows a linear layer is a read of W: cuBLAS's small-M kernels reach well under the GPU's bandwidth
on the shapes of a small model (a 1024 x 4096 matrix is 8 MB, under 3 us of an H100's HBM). Here each program
takes a tile of ``BLOCK_N`` output columns and one part of K, so that about ``GEMV_PROGRAMS_PER_SM`` programs an SM
each have a large tile of W in flight:

* ``_gemv_kernel`` multiplies the rows (padded to tl.dot's 16; the padding is masked, never read) by its W tile,
  ``BLOCK_K`` columns a step, accumulating in float32 (bf16 products are exact in float32; float32 models' dots in
  IEEE float32, ``attention.exact_dots``). With one part of K it adds the bias and writes the output itself.
* With several parts each writes its float32 partial sums to ``[parts, M, N]`` and ``_gemv_reduce_kernel`` adds
  them in part order, then the bias, and rounds once to the model dtype (the bias joins the float32 sum, as in a
  GEMM's epilogue).

No atomics: the same bits every run, eagerly or in a CUDA graph (no host sync, nothing data-dependent on the host).
The tiles and the split are a pure function of (N, K, dtype, device), not of M, so a row's sum is the same at any
batch of 1 to 8 rows. Unmeasured here: written and tested without a GPU (benchmarks/gemv_ab.py times it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mili.kernels.triton.attention import _dot, exact_dots
from mili.kernels.triton.launch import DeviceSpec, device_spec, gemm_smem_bound

GEMV_MAX_ROWS = 8  # rows the GEMV takes; more go to cuBLAS (F.linear)
GEMV_BLOCK_M = 16  # tl.dot's smallest M: the rows, padded
GEMV_PROGRAMS_PER_SM = 4  # programs the split of K aims at, per SM
GEMV_REDUCE_BLOCK = 256  # columns a reduce program adds up


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split: int  # parts of K (1: no reduce pass)
    steps_per_split: int  # BLOCK_K steps a part takes
    num_warps: int
    num_stages: int


def gemv_config(n: int, k: int, dtype: torch.dtype, spec: DeviceSpec) -> GemvConfig:
    """The launch for W [n, k] on ``spec``. BLOCK_K 256 (128 in float32; halved while two stages of the tiles would
    not fit the device's shared memory); BLOCK_N by ``gemv_block_n``; K then split into enough parts for about
    ``GEMV_PROGRAMS_PER_SM`` programs an SM. Three stages where a part has three K steps to pipeline (and they
    fit), else two: shared memory a program does not use leaves room for more programs an SM."""
    size = dtype.itemsize
    target = GEMV_PROGRAMS_PER_SM * spec.num_sms
    block_k = min(256 if size <= 2 else 128, max(16, triton.next_power_of_2(k)))
    block_n = gemv_block_n(n, triton.cdiv(k, block_k), target)
    while block_k > 16 and gemm_smem_bound(GEMV_BLOCK_M, block_n, block_k, size, size, 2) > spec.smem_per_block:
        block_k //= 2
    k_steps = triton.cdiv(k, block_k)
    split = max(1, min(k_steps, triton.cdiv(target, triton.cdiv(n, block_n))))
    per_split = triton.cdiv(k_steps, split)
    three = gemm_smem_bound(GEMV_BLOCK_M, block_n, block_k, size, size, 3) <= spec.smem_per_block
    return GemvConfig(block_n, block_k, triton.cdiv(k_steps, per_split), per_split, 4,
                      3 if per_split >= 3 and three else 2)


def gemv_block_n(n: int, k_steps: int, target: int) -> int:
    """Output columns a program: 64 where the columns alone give ``target`` programs (an lm_head: fewer, larger
    programs, x read fewer times), else 32, or 16 where even 32-wide tiles times every K step would leave SMs
    idle (the split of K can only multiply the column tiles by the K steps)."""
    if triton.cdiv(n, 64) >= target:
        return 64
    return 32 if triton.cdiv(n, 32) * k_steps >= target else 16


@triton.jit
def _gemv_kernel(X, W, BIAS, OUT, M, N, K, steps_per_split, stride_xm, stride_wn, stride_os, stride_om,
                 HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
    """Program (column tile, K part): for every row m and the tile's columns n, the sum over the part's K of
    x[m, k] w[n, k] in float32. One part: + bias, rounded to OUT's dtype; several (PARTIAL): the float32 sum into
    OUT[part]."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + cols[None, :] * stride_wn + k[:, None], mask=cmask[None, :] & kmask[:, None], other=0.0)
        acc += _dot(x, w, EXACT)
    out = OUT + tl.program_id(1) * stride_os + rows[:, None] * stride_om + cols[None, :]
    if not PARTIAL and HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gemv_reduce_kernel(PARTS, BIAS, OUT, N, splits, stride_ps, stride_pm, stride_om, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (column tile, row): the parts' float32 sums added in part order, + bias, rounded once."""
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(PARTS + s * stride_ps + m * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + m * stride_om + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def gemv_meta(cfg: GemvConfig, dtype: torch.dtype, has_bias: bool) -> dict:
    """The GEMV kernel's constexprs and launch options for ``cfg`` (the compile check calls it too)."""
    return dict(HAS_BIAS=has_bias, PARTIAL=cfg.split > 1, BLOCK_M=GEMV_BLOCK_M, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, EXACT=exact_dots(dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gemv_reduce_meta(has_bias: bool) -> dict:
    return dict(HAS_BIAS=has_bias, BLOCK=GEMV_REDUCE_BLOCK)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= ``GEMV_MAX_ROWS``, rows may be strided) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= GEMV_MAX_ROWS and weight.shape[1] == k and x.dtype == weight.dtype
    assert x.stride(1) == 1 and weight.stride(1) == 1 and (bias is None or bias.stride(0) == 1)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = gemv_config(n, k, x.dtype, device_spec(x.device))
    has_bias = bias is not None
    partial = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device) if cfg.split > 1 else out
    b = bias if has_bias else weight  # (unread without a bias)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split)](
        x, weight, b, partial, m, n, k, cfg.steps_per_split, x.stride(0), weight.stride(0),
        partial.stride(0) if cfg.split > 1 else 0, partial.stride(-2), **gemv_meta(cfg, x.dtype, has_bias))
    if cfg.split > 1:
        _gemv_reduce_kernel[(triton.cdiv(n, GEMV_REDUCE_BLOCK), m)](
            partial, b, out, n, cfg.split, partial.stride(0), partial.stride(1), out.stride(0),
            **gemv_reduce_meta(has_bias))
    return out
