"""GEMMs over quantized weights in Triton: ``y = x @ W^T`` with W stored as FP8 e4m3, as AWQ's int4 or as int8.

* FP8 with a float32 scale per ``scale_n x scale_k`` block of W (Qwen's 128 x 128 ``weight_scale_inv``; per
  output channel is the block ``1 x K``). W8A8 (GPUs with FP8, SM 89+): the activations are quantized per
  token in groups of 128 (``per_token_group_quant_fp8``), and each 128-wide K step's FP8 dot product is
  scaled by ``x_scale[m, kb] * w_scale[nb, kb]`` (the design of vLLM's and SGLang's
  ``w8a8_block_fp8_matmul``). Weight-only (a constexpr switch: older GPUs, float32 models): the FP8 bytes
  are decoded in the kernel and multiplied with the activations as they are, then by the block scale.
* AWQ int4, dequantized in the kernel: MILI's layout packs 8 values of a row per int32 along K (word j of
  row n holds K indices 8j .. 8j+7, low nibble first), a uint8 zero point and an fp16 scale per group of
  input channels: ``w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]``.
* int8 weight-only (``--quantization int8`` on CUDA), one float32 scale per output channel:
  ``w[n, k] = q[n, k] * s[n]``; the int8 values are converted (exactly) to the activations' dtype, and the
  scale multiplies each output column's float32 sum once.

The kernels take a split of K as a third grid dimension: small batches (decode, M <= 8) leave most of the
GPU idle with one program per output tile, so K is split and the float32 partial sums are added after
(no atomics: the same result every run, eager or under a CUDA graph). Tiles and stages are fixed by the
rows and the device's shared memory (``launch.gemm_config``; no autotuning: nothing is timed inside a graph
capture). The three share the tile's rows and columns, the K steps of a part and the store (``_tile``,
``_part_steps``, ``_store_part``). Each kernel's torch reference is in ``mili/kernels/reference.py``. Their speed
is unmeasured: they were written and tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mili.kernels.triton.attention import _dot, exact_dots
from mili.kernels.triton.fp8 import fp8_bits_to_float, to_fp8
from mili.kernels.triton.launch import DeviceSpec, GemmConfig, device_spec, gemm_config

FP8_GROUP = 128  # activations: one scale per token and group of 128 input channels
SPLIT_K_MAX_ROWS = 8  # split K for batches of at most this many rows


# -- activations: per token, per group of 128 --------------------------------------------------------------
@triton.jit
def _group_quant_kernel(X, Q, S, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr):
    m, g = tl.program_id(0), tl.program_id(1)
    k = g * GROUP + tl.arange(0, GROUP)
    mask = k < K
    x = tl.load(X + m * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-10), 448.0)  # (an all-zero group: 0s)
    tl.store(Q + m * stride_qm + k, to_fp8(tl.math.div_rn(x, scale)), mask=mask)
    tl.store(S + m * stride_sm + g, scale)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]): each group of a row divided
    by its largest magnitude / 448, rounded to nearest."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _group_quant_kernel[(m, groups)](x, q, scales, k, x.stride(0), q.stride(0), scales.stride(0), GROUP=group)
    return q, scales


# -- the shared shape of both GEMMs: tiles, a split of K, float32 partials ---------------------------------
def split_k_for(m: int, n: int, k_steps: int, block_m: int, block_n: int, target_programs: int = 256) -> int:
    """How many parts K is split into: 1 above ``SPLIT_K_MAX_ROWS`` rows; else enough for about
    ``target_programs`` programs (two per SM), each part at least two K steps."""
    if m > SPLIT_K_MAX_ROWS:
        return 1
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return max(1, min(k_steps // 2, triton.cdiv(target_programs, tiles)))


def gemm_plan(m: int, n: int, k_steps: int, block_k: int, a_dtype: torch.dtype, w_bytes_per_k: float,
              fp32_dots: bool, spec: DeviceSpec, split_k: int | None = None) -> tuple[GemmConfig, int, int]:
    """(tile config, K parts, K steps per part) of an [m, K] x [K, n] GEMM on ``spec``: what ``_launch``
    runs, and what the compile check compiles."""
    cfg = gemm_config(m, block_k, a_dtype.itemsize, w_bytes_per_k, fp32_dots, spec)
    split = split_k or split_k_for(m, n, k_steps, cfg.block_m, cfg.block_n, 2 * spec.num_sms)
    per_split = triton.cdiv(k_steps, split)
    return cfg, triton.cdiv(k_steps, per_split), per_split  # (no empty parts)


def _launch(kernel, x, a_dtype, w_bytes_per_k: float, n: int, k_steps: int, out_dtype, split_k: int | None,
            args: tuple, **meta):
    """Run ``kernel`` over output tiles x K parts; partial sums (float32) are added up after."""
    m = x.shape[0]  # (tiles: by the GPU's dots, float32 ones on the CUDA cores; not the interpreter's EXACT)
    cfg, split, per_split = gemm_plan(m, n, k_steps, meta["BLOCK_K"], a_dtype, w_bytes_per_k,
                                      x.dtype == torch.float32, device_spec(x.device), split_k)
    out = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else out_dtype, device=x.device)
    if m:
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
        kernel[grid](*args, out, m, n, per_split, out.stride(0), out.stride(1), BLOCK_M=cfg.block_m,
                     BLOCK_N=cfg.block_n, EXACT=exact_dots(x.dtype), num_warps=cfg.num_warps,
                     num_stages=cfg.num_stages, **meta)
    return out[0] if split == 1 else out.sum(0).to(out_dtype)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output rows and columns and their masks (grid: N tiles, M tiles, K parts)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def _part_steps(steps_per_split, k_steps):
    """The K steps [first, last) of this program's part of K."""
    first = tl.program_id(2) * steps_per_split
    return first, tl.minimum(first + steps_per_split, k_steps)


@triton.jit
def _byte_tiles(A, W, rows, cols, rmask, cmask, step, K, stride_am, stride_wn, BLOCK_K: tl.constexpr):
    """K step ``step``'s activations [BLOCK_M, BLOCK_K] and weights [BLOCK_K, BLOCK_N], a byte each (W [N, K]),
    zeros past the edges."""
    k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = k < K
    a = tl.load(A + rows[:, None] * stride_am + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    w = tl.load(W + cols[None, :] * stride_wn + k[:, None], mask=cmask[None, :] & kmask[:, None], other=0.0)
    return a, w


@triton.jit
def _store_part(C, acc, rows, cols, rmask, cmask, stride_cs, stride_cm):
    """The tile's sum over this program's part of K: into C[part] (float32 partials), or C itself (one part)."""
    c = C + tl.program_id(2) * stride_cs + rows[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(C.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


# -- FP8 weights -------------------------------------------------------------------------------------------
@triton.jit
def _fp8_gemm_kernel(A, A_SCALE, W, W_SCALE, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_wsk,
                     C, M, N, steps_per_split, stride_cs, stride_cm,
                     SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, FP8_ACT: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of C over one part of K; every K step lies in one weight scale block."""
    rows, cols, rmask, cmask = _tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first, last = _part_steps(steps_per_split, tl.cdiv(K, BLOCK_K))
    for step in range(first, last):
        a, w = _byte_tiles(A, W, rows, cols, rmask, cmask, step, K, stride_am, stride_wn, BLOCK_K)
        w_scale = tl.load(W_SCALE + (cols // SCALE_N) * stride_wsn + (step * BLOCK_K // SCALE_K) * stride_wsk,
                          mask=cmask, other=0.0)
        if FP8_ACT:  # fp8 x fp8, each side's scale applied to the step's float32 product
            a_scale = tl.load(A_SCALE + rows * stride_asm + step, mask=rmask, other=0.0)
            acc += _dot(a, w, EXACT) * a_scale[:, None] * w_scale[None, :]
        else:  # weight-only: the bytes decoded (exactly) to the activations' dtype
            acc += _dot(a, fp8_bits_to_float(w).to(A.dtype.element_ty), EXACT) * w_scale[None, :]
    _store_part(C, acc, rows, cols, rmask, cmask, stride_cs, stride_cm)


def fp8_block_size(scale_block: tuple[int, int], k: int) -> int | None:
    """The K step of the FP8 GEMM for weight scale blocks ``scale_block`` (None: blocks it cannot take):
    the activation group (128), inside one weight block along K."""
    scale_k = scale_block[1]
    if scale_k >= k or scale_k % FP8_GROUP == 0:
        return FP8_GROUP
    return None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scale_block: tuple[int, int],
               fp8_activations: bool, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] float8_e4m3fn x weight_scale [ceil(N / bn), ceil(K / bk)] float32, one per
    ``scale_block`` (bn, bk))^T -> [M, N] in x's dtype. ``fp8_activations``: W8A8 (SM 89+); else weight-only,
    the weights read as bytes (no fp8 type in the kernel)."""
    n, k = weight.shape
    block_k = fp8_block_size(scale_block, k)
    assert block_k is not None and weight_scale.dtype == torch.float32 and x.stride(1) == 1
    if fp8_activations:
        a, a_scale = per_token_group_quant_fp8(x, block_k)
        w = weight
    else:
        a, a_scale, w = x, x, weight.view(torch.uint8)  # (a_scale unused)
    args = (a, a_scale, w, weight_scale, k, a.stride(0), a_scale.stride(0), w.stride(0), weight_scale.stride(0),
            weight_scale.stride(1) if weight_scale.shape[1] > 1 else 0)
    return _launch(_fp8_gemm_kernel, x, a.dtype, 1, n, triton.cdiv(k, block_k), x.dtype, split_k, args,
                   SCALE_N=scale_block[0], SCALE_K=scale_block[1], FP8_ACT=fp8_activations, BLOCK_K=block_k)


# -- AWQ int4 weights --------------------------------------------------------------------------------------
@triton.jit
def _int4_gemm_kernel(A, QW, ZEROS, SCALES, K, stride_am, stride_qn, stride_zn, stride_sn,
                      C, M, N, steps_per_split, stride_cs, stride_cm,
                      GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      EXACT: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of C over one part of K; every K step lies in one group."""
    rows, cols, rmask, cmask = _tile(M, N, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    js = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first, last = _part_steps(steps_per_split, K // BLOCK_K)
    for step in range(first, last):
        k = step * BLOCK_K + ks
        a = tl.load(A + rows[:, None] * stride_am + k[None, :], mask=rmask[:, None], other=0.0)
        words = tl.load(QW + cols[None, :] * stride_qn + (step * BLOCK_K // 8 + js)[:, None], mask=cmask[None, :],
                        other=0)  # [BLOCK_K / 8, BLOCK_N]: each word read once
        # word j's nibble i is K index 8j + i: [BLOCK_K / 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N], values 0..15
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = step * BLOCK_K // GROUP
        zero = tl.load(ZEROS + cols * stride_zn + group, mask=cmask, other=0).to(tl.int32)
        scale = tl.load(SCALES + cols * stride_sn + group, mask=cmask, other=0.0).to(tl.float32)
        # (q - z) is an integer in -15..15, exact in any activation dtype; the scale multiplies the sum (via
        # float32: the interpreter's int -> bf16 cast reinterprets the bits)
        w = (q - zero[None, :]).to(tl.float32).to(A.dtype.element_ty)
        acc += _dot(a, w, EXACT) * scale[None, :]
    _store_part(C, acc, rows, cols, rmask, cmask, stride_cs, stride_cm)


def int4_block_size(group: int, k: int) -> int | None:
    """The K step of the int4 GEMM for groups of ``group`` input channels (None: a shape it cannot take):
    one group or a power-of-two share of it, at least 16 (a tensor-core K)."""
    block = min(group, 128)
    if k % group or group % block or block < 16 or block & (block - 1):
        return None
    return block


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K / 8] int32, 8 consecutive K values a word, the first in the low nibble."""
    v = q.to(torch.int64).reshape(q.shape[0], -1, 8)
    word = sum(v[:, :, i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ W^T with W from ``pack_int4``'s qweight [N, K / 8], zeros [N, K / G] uint8 and scales
    [N, K / G] (fp16) -> [M, N] in x's dtype."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    group = k // zeros.shape[1]
    block_k = int4_block_size(group, k)
    assert block_k is not None and x.shape[1] == k and x.stride(1) == 1
    args = (x, qweight, zeros, scales, k, x.stride(0), qweight.stride(0), zeros.stride(0), scales.stride(0))
    return _launch(_int4_gemm_kernel, x, x.dtype, 0.5, n, k // block_k, x.dtype, split_k, args, GROUP=group,
                   BLOCK_K=block_k)


# -- int8 weights, one scale per output channel ---------------------------------------------------------------
INT8_BLOCK_K = 128  # the int8 GEMM's K step (K need not be a multiple: the last step is masked)


@triton.jit
def _int8_gemm_kernel(A, W, W_SCALE, K, stride_am, stride_wn,
                      C, M, N, steps_per_split, stride_cs, stride_cm,
                      BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of C over one part of K: the int8 values converted (exactly) to the
    activations' dtype, multiplied with them, and each column's float32 sum by its channel's scale."""
    rows, cols, rmask, cmask = _tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first, last = _part_steps(steps_per_split, tl.cdiv(K, BLOCK_K))
    for step in range(first, last):
        a, w = _byte_tiles(A, W, rows, cols, rmask, cmask, step, K, stride_am, stride_wn, BLOCK_K)
        # (via float32: the interpreter's int -> bf16 cast reinterprets the bits)
        acc += _dot(a, w.to(tl.float32).to(A.dtype.element_ty), EXACT)
    scale = tl.load(W_SCALE + cols, mask=cmask, other=0.0)
    _store_part(C, acc * scale[None, :], rows, cols, rmask, cmask, stride_cs, stride_cm)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] int8 x weight_scale [N] float32, one per output channel)^T -> [M, N] in x's
    dtype (weight-only: the activations are multiplied as they are)."""
    n, k = weight.shape
    assert weight.dtype == torch.int8 and weight.stride(1) == 1 and weight_scale.dtype == torch.float32
    assert weight_scale.shape == (n,) and weight_scale.stride(0) == 1 and x.shape[1] == k and x.stride(1) == 1
    args = (x, weight, weight_scale, k, x.stride(0), weight.stride(0))
    return _launch(_int8_gemm_kernel, x, x.dtype, 1, n, triton.cdiv(k, INT8_BLOCK_K), x.dtype, split_k, args,
                   BLOCK_K=INT8_BLOCK_K)


def fp8_activations(device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype) -> bool:
    """Whether FP8 weights multiply FP8 activations (W8A8): on GPUs with FP8 (SM 89+) in a 16-bit model.
    Older GPUs and float32 models run weight-only; the CPU (TRITON_INTERPRET) runs what an H100 runs."""
    if dtype == torch.float32:
        return False
    return device_type == "cpu" or (capability is not None and capability >= (8, 9))
