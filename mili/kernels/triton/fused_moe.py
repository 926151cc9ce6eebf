"""Fused mixture-of-experts in Triton (the design of vLLM's and SGLang's ``fused_moe``).

The (token, slot) pairs are sorted by expert and each expert's group is padded to ``BLOCK_M`` rows
(``align``: torch ops, no host sync, a static number of blocks, so a CUDA graph can hold it). One
grouped GEMM then computes every pair's gate|up projection (each block of rows belongs to one expert and
multiplies by that expert's weights), SwiGLU runs on the result, and a second grouped GEMM computes the
down projection and multiplies each row by its routing weight; a sum over the k slots gives each token's
output. ``reference.py``'s loop over experts (``FusedExperts`` without ops) is the kernel's reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mili.kernels.triton.attention import _dot, exact_dots
from mili.kernels.triton.swiglu import silu_and_mul

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _grouped_gemm_kernel(A, W, C, PAIRS, BLOCK_EXPERT, WEIGHTS, num_pairs, N, K,
                         stride_am, stride_we, stride_wn, stride_cm,
                         TOP_K: tl.constexpr, ROW_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
    """C[pair] = A[row of pair] @ W[expert]^T (times the pair's routing weight) for one block of pairs
    (all of one expert) and one tile of N. A's row is the pair's token, or the pair itself."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert >= 0:
        pairs = tl.load(PAIRS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = pairs if ROW_PER_PAIR else pairs // TOP_K
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(A + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < K),
                        other=0.0)
            w = tl.load(W + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                        mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
            # bf16/fp16 operands are exact in the GPU's default TF32; float32 ones are not: IEEE dots there
            acc += _dot(a.to(tl.float32), w.to(tl.float32), EXACT)
        if MUL_WEIGHT:
            acc = acc * tl.load(WEIGHTS + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(C + pairs[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
                 mask=valid[:, None] & (cols[None, :] < N))


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """(pair index per padded row, with ``num_pairs`` for padding; the expert of each block, -1 for
    unused blocks). Pairs are ``token * k + slot``; the block count is the static bound for any routing."""
    flat = topk_ids.flatten()
    num_pairs, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    num_blocks = (num_pairs + num_experts * (block_m - 1)) // block_m + 1
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[expert]
    pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.long, device=dev)
    pairs[(ends - padded)[expert] + rank] = order
    block_expert = torch.searchsorted(ends, torch.arange(num_blocks, device=dev) * block_m, right=True)
    return pairs, torch.where(block_expert < num_experts, block_expert, -1)


def _grouped_gemm(a, w, out, pairs, block_expert, weights, num_pairs, top_k, row_per_pair, mul_weight):
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](a, w, out, pairs, block_expert, weights, num_pairs, n, k,
                               a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                               **grouped_gemm_meta(top_k, row_per_pair, mul_weight, a.dtype))


def grouped_gemm_meta(top_k: int, row_per_pair: bool, mul_weight: bool, dtype: torch.dtype) -> dict:
    """The first GEMM (gate|up: a token's row, no weight) or the second (down: the pair's row, weighted)."""
    return dict(TOP_K=top_k, ROW_PER_PAIR=row_per_pair, MUL_WEIGHT=mul_weight, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K, EXACT=exact_dots(dtype))


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum over each token's k experts of weight * w2[e] @ silu_and_mul(w13[e] @ x): [T, H]."""
    assert x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
    t, k = topk_ids.shape
    num_pairs = t * k
    pairs, block_expert = align(topk_ids, w13.shape[0])
    weights = topk_weights.contiguous().view(-1)
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, pairs, block_expert, weights, num_pairs, k, False, False)
    act = silu_and_mul(gate_up)
    out = torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, pairs, block_expert, weights, num_pairs, k, True, True)
    return out.view(t, k, -1).sum(dim=1)
