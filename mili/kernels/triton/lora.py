"""LoRA adapters' products in Triton: each token row's own adapter, in one batched launch (Punica's SGMV, the design
of vLLM's ``lora_shrink`` / ``lora_expand``).

The weights are every slot's stacked (``mili.lora.LoRALinear``): A [columns, in] holds slot s's rows s*W .. (s+1)*W
(W = shards x max_rank: a fused layer's shards' A one after the other), B [out, columns] is block-diagonal per slot
(the output rows of shard j read only its max_rank columns) with the scale folded in.

Once a step (``segments``, on the host from the step's list of slots: no device sync), the rows that run an adapter
are sorted by slot into segments (slot, first index, length). Then, in each layer:

- shrink: u = x A_s^T for every row of a segment, a tile of ``BLOCK_M`` rows of one segment against a tile of its
  slot's W columns (``tl.dot``, float32 accumulation), the in-features split over ``splits`` programs where rows are
  few (decode): each split writes its own float32 partial [splits, T, W], summed by torch (no atomics: deterministic);
- expand: y += u B_s^T in place, u rounded to the model's dtype (as the torch path does) for the dot; each shard's
  output columns are tiled apart, and a tile reads only its shard's max_rank columns of u and B (B is block-diagonal).

The grid is (tiles x row blocks of the longest segment, segments): programs past their segment's end return at once;
rows of the base model (slot -1) are in no segment and keep y as it is. No loop over sequences, no weight merge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mili.kernels.triton.attention import _dot, exact_dots
from mili.kernels.triton.launch import device_spec


@dataclass(frozen=True)
class LoRASegments:
    """A step's adapter rows grouped by slot: ``rows`` [R] int32, the row indices (slot >= 0) sorted by slot (stable);
    ``slot``, ``start``, ``length`` [S] int32, each segment's slot, first index into ``rows`` and row count;
    ``max_rows`` the longest segment (the grid's bound)."""

    rows: torch.Tensor
    slot: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    num_segments: int
    max_rows: int


def segments(token_slots, device: torch.device | str) -> LoRASegments | None:
    """The segments of a step's rows (``token_slots``: each row's slot, -1 the base model; a list, or a tensor, which
    is read on the host), in one copy to ``device``; None when no row runs an adapter."""
    slots = torch.as_tensor(token_slots, dtype=torch.int64, device="cpu").reshape(-1)
    keep = (slots >= 0).nonzero().squeeze(1)
    if keep.numel() == 0:
        return None
    order = keep[torch.argsort(slots[keep], stable=True)]
    ids, counts = torch.unique_consecutive(slots[order], return_counts=True)
    starts = counts.cumsum(0) - counts
    packed = torch.cat([order, ids, starts, counts]).to(torch.int32).to(device)
    r, s = order.numel(), ids.numel()
    return LoRASegments(packed[:r], packed[r:r + s], packed[r + s:r + 2 * s], packed[r + 2 * s:], s,
                        int(counts.max()))


@triton.jit
def _lora_shrink_kernel(X, A, U, ROWS, SEG_SLOT, SEG_START, SEG_LEN, K, W, k_tiles, num_m, num_n,
                        stride_xm, stride_am, stride_us, stride_um,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
    """U[split, row, n] = sum over this split's k of X[row, k] A[slot x W + n, k], for a block of one segment's rows
    and a tile of the slot's W columns; a split is ``k_tiles`` x BLOCK_K in-features (so that the compiler knows
    each tile's start a multiple of BLOCK_K: contiguous, vectorized loads, pipelined)."""
    pid, seg = tl.program_id(0), tl.program_id(1)
    pid_m = pid % num_m
    pid_n = (pid // num_m) % num_n
    split = pid // (num_m * num_n)
    length = tl.load(SEG_LEN + seg)
    if pid_m * BLOCK_M < length:  # (blocks past the segment's end: nothing to do)
        slot = tl.load(SEG_SLOT + seg)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = m < length
        rows = tl.load(ROWS + tl.load(SEG_START + seg) + m, mask=valid, other=0).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < W
        a_rows = (slot * W + n).to(tl.int64)
        k_lo = split * k_tiles * BLOCK_K
        k_hi = tl.minimum(k_lo + k_tiles * BLOCK_K, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=valid[:, None] & (ks[None, :] < K),
                        other=0.0)
            a = tl.load(A + a_rows[None, :] * stride_am + ks[:, None], mask=n_ok[None, :] & (ks[:, None] < K),
                        other=0.0)
            acc += _dot(x, a, EXACT)
        tl.store(U + split * stride_us + rows[:, None] * stride_um + n[None, :], acc,
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _lora_expand_kernel(U, B, Y, ROWS, SEG_SLOT, SEG_START, SEG_LEN, SHARD_ENDS, W, num_m,
                        stride_um, stride_bn, stride_ym,
                        NUM_SHARDS: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
    """Y[row, n] += sum over k < RANK of U[row, j x RANK + k] B[n, slot x W + j x RANK + k] for a block of one
    segment's rows and a tile of shard j's output columns: each shard's columns are tiled apart (``SHARD_ENDS``:
    each shard's end), so a tile reads only its own shard's RANK columns of u and B (B is block-diagonal)."""
    pid, seg = tl.program_id(0), tl.program_id(1)
    pid_m = pid % num_m
    tile = pid // num_m
    length = tl.load(SEG_LEN + seg)
    if pid_m * BLOCK_M < length:
        slot = tl.load(SEG_SLOT + seg)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = m < length
        rows = tl.load(ROWS + tl.load(SEG_START + seg) + m, mask=valid, other=0).to(tl.int64)
        # which shard the tile is in: shard i has cdiv(size_i, BLOCK_N) tiles, after those of the shards before it
        shard = tile * 0
        n0 = tile * 0
        n_end = tile * 0
        first = tile * 0
        shard_start = tile * 0
        for i in tl.static_range(NUM_SHARDS):
            shard_end = tl.load(SHARD_ENDS + i)
            tiles = (shard_end - shard_start + BLOCK_N - 1) // BLOCK_N
            inside = (tile >= first) & (tile < first + tiles)
            shard = tl.where(inside, i, shard)
            n0 = tl.where(inside, shard_start + (tile - first) * BLOCK_N, n0)
            n_end = tl.where(inside, shard_end, n_end)
            first += tiles
            shard_start = shard_end
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < n_end
        u_rows = U + rows[:, None] * stride_um + shard * RANK
        b_cols = B + n[None, :].to(tl.int64) * stride_bn + slot * W + shard * RANK
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, RANK, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < RANK
            u = tl.load(u_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_cols + ks[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc += _dot(u.to(B.dtype.element_ty), b, EXACT)
        y_ptrs = Y + rows[:, None] * stride_ym + n[None, :]
        y_mask = valid[:, None] & n_ok[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=y_mask)


# -- launch configurations: pure functions of the shapes and dtypes (the compile check calls them too) -----
def _block_m(rows: int, dtype: torch.dtype) -> int:
    """Rows a program takes: 16 (tl.dot's least) for decode, more for a long segment (float32's CUDA-core dots keep
    their operands in registers: at most 32)."""
    if rows <= 16:
        return 16
    return 32 if rows <= 32 or dtype == torch.float32 else 64


def shrink_meta(rows: int, width: int, dtype: torch.dtype) -> dict:
    """``rows``: the longest segment; ``width``: W, the columns of one slot."""
    return dict(BLOCK_M=_block_m(rows, dtype), BLOCK_N=min(64, max(16, triton.next_power_of_2(width))),
                BLOCK_K=32 if dtype == torch.float32 else 64, EXACT=exact_dots(dtype))


def expand_meta(rows: int, max_rank: int, num_shards: int, dtype: torch.dtype) -> dict:
    """(K steps of 16: the expand's K is one shard's rank; 128 columns only with 64 rows, on 8 warps: the compile
    check's findings.)"""
    block_m = _block_m(rows, dtype)
    return dict(NUM_SHARDS=num_shards, RANK=max_rank, BLOCK_M=block_m, BLOCK_N=128 if block_m == 64 else 64,
                BLOCK_K=16, EXACT=exact_dots(dtype))


def options(meta: dict) -> dict:
    """The launch options of a ``shrink_meta`` or ``expand_meta``: 8 warps for the expand's 64 x 128 tile (4
    spilled), 4 otherwise."""
    return dict(num_warps=8 if meta["BLOCK_M"] * meta["BLOCK_N"] >= 64 * 128 else 4, num_stages=3)


def shrink_splits(programs: int, k: int, block_k: int, num_sms: int) -> int:
    """How many programs share one row block's in-features: enough for about one wave of the device where the
    rows are few (decode), each with at least four K steps."""
    return max(1, min(-(-num_sms // max(programs, 1)), k // (4 * block_k), 32))


def shard_ends(shard_sizes, device: torch.device | str) -> torch.Tensor:
    """The int32 tensor ``lora_add`` takes for a fused layer: each shard's end (the output columns before it and
    its own)."""
    return torch.tensor(list(shard_sizes), dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots,
             width: int, max_rank: int, shard_sizes=None, ends: torch.Tensor | None = None,
             split_k: int | None = None) -> torch.Tensor:
    """y [T, out] += B_s (A_s x) for each row of x [T, in] with slot s >= 0, in place (rows of slot -1 unchanged); y.

    ``lora_a`` [>= slots x width, in] and ``lora_b`` [out, >= slots x width]: slot s's A rows and B columns are
    s x width .. (s + 1) x width, ``width`` = len(shard_sizes) x ``max_rank`` (``shard_sizes``: a fused layer's
    outputs, default one shard; ``ends``: ``shard_ends(shard_sizes)``, made once by a caller that launches often).
    ``token_slots``: a ``LoRASegments`` (``segments()``, once a step), or each row's slot (list or [T] tensor).
    ``split_k``: force the shrink's split (tests)."""
    seg = token_slots if isinstance(token_slots, LoRASegments) else segments(token_slots, x.device)
    if seg is None:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    t, k = x.shape
    n = y.shape[1]
    assert y.shape[0] == t and lora_a.shape[1] == k and lora_b.shape[0] == n
    assert y.stride(1) == 1 and lora_a.stride(1) == 1 and lora_b.stride(1) == 1
    shard_sizes = list(shard_sizes) if shard_sizes is not None else [n]
    assert width == len(shard_sizes) * max_rank and sum(shard_sizes) == n
    if ends is None:
        ends = shard_ends(shard_sizes, x.device)
    sm = shrink_meta(seg.max_rows, width, x.dtype)
    num_m = triton.cdiv(seg.max_rows, sm["BLOCK_M"])
    num_n = triton.cdiv(width, sm["BLOCK_N"])
    splits = split_k or shrink_splits(num_m * num_n * seg.num_segments, k, sm["BLOCK_K"],
                                      device_spec(x.device).num_sms)
    k_tiles = triton.cdiv(triton.cdiv(k, splits), sm["BLOCK_K"])  # (BLOCK_K tiles a split)
    splits = triton.cdiv(k, k_tiles * sm["BLOCK_K"])  # (none empty)
    u = torch.empty(splits, t, width, dtype=torch.float32, device=x.device)  # (each split's partial)
    _lora_shrink_kernel[(num_m * num_n * splits, seg.num_segments)](
        x, lora_a, u, seg.rows, seg.slot, seg.start, seg.length, k, width, k_tiles, num_m, num_n,
        x.stride(0), lora_a.stride(0), u.stride(0), u.stride(1), **sm, **options(sm))
    u = u[0] if splits == 1 else u.sum(0)  # (the partials' sum: in order, deterministic)
    em = expand_meta(seg.max_rows, max_rank, len(shard_sizes), x.dtype)
    num_m = triton.cdiv(seg.max_rows, em["BLOCK_M"])
    tiles = sum(triton.cdiv(size, em["BLOCK_N"]) for size in shard_sizes)
    _lora_expand_kernel[(num_m * tiles, seg.num_segments)](
        u, lora_b, y, seg.rows, seg.slot, seg.start, seg.length, ends, width, num_m,
        u.stride(0), lora_b.stride(0), y.stride(0), **em, **options(em))
    return y
