"""One paged attention kernel over a whole mixed step: decodes and prefill chunks alike, in a launch whose grid
depends on no sequence's length, so a CUDA graph captured for a number of tokens replays any step of that size.

The step's T query tokens are sequence after sequence (``query_start``, ``query_lens``). Programs are numbered
along the tokens in blocks of BLOCK_Q, each sequence's first block starting a fresh program: sequence b's blocks
begin at program ``query_start[b] // BLOCK_Q + b``, so ``cdiv(T, BLOCK_Q) + S`` programs (per KV head) cover any
step of T tokens and S sequences, and a program finds its sequence by a binary search over those starts.
Programs past a sequence's last block, and sequences with no query token (padding), write nothing.

A program takes BLOCK_Q tokens times the GROUP query heads of its KV head as the rows of one tile (GQA: K/V read
once for the group), and walks the keys its rows may see (the cached prefix and, causally, the chunk), BLOCK_N
keys an iteration across pages, with an online softmax. K/V must already be in the pages (``store_kv``); FP8
pages are read into the query's dtype exactly and scaled as ``attention.py``'s kernels do. The torch reference is
``mili.kernels.reference.paged_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mili.kernels.triton.attention import _dot, exact_dots

BLOCK_N = 64  # keys an iteration


@triton.jit
def _sequence_of(QSTART, program, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose blocks hold ``program``: the last b with QSTART[b] // BLOCK_Q + b <= program."""
    lo, hi = 0, num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(QSTART + mid) // BLOCK_Q + mid <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _varlen_kernel(Q, KC, VC, OUT, PT, QSTART, QLEN, CTX, scale, v_scale, num_seqs,
                   stride_qt, stride_qh, stride_cp, stride_cs, stride_ch, stride_pt, stride_ot, stride_oh,
                   GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    program, kvh = tl.program_id(0), tl.program_id(1)
    b = _sequence_of(QSTART, program, num_seqs, BLOCK_Q)
    qstart = tl.load(QSTART + b)
    qlen = tl.load(QLEN + b)
    block = program - (qstart // BLOCK_Q + b)
    if block * BLOCK_Q >= qlen:
        return
    ctx = tl.load(CTX + b)
    rows = tl.arange(0, BLOCK_M)  # row r: token r // GROUP of the block, query head r % GROUP of the group
    tok = block * BLOCK_Q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    rmask = (rows < BLOCK_Q * GROUP) & (tok < qlen)
    qpos = ctx - qlen + tok  # the tokens' positions
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + (qstart + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    keys = tl.arange(0, BLOCK_N)
    last_key = tl.minimum(ctx - qlen + (block + 1) * BLOCK_Q, ctx)  # one past the last key a row of it sees
    for start in range(0, last_key, BLOCK_N):
        kpos = start + keys
        kvalid = kpos < last_key
        page = tl.load(PT + b * stride_pt + kpos // PAGE, mask=kvalid, other=0)
        kv_ptrs = page[:, None] * stride_cp + (kpos % PAGE)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kvmask = kvalid[:, None] & dmask[None, :]
        k = tl.load(KC + kv_ptrs, mask=kvmask, other=0.0).to(q.dtype)  # (FP8 pages: exactly)
        v = tl.load(VC + kv_ptrs, mask=kvmask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), EXACT) * scale
        s = tl.where((kpos[None, :] <= qpos[:, None]) & kvalid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m - m_safe)
        prob = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + _dot(prob.to(v.dtype), v, EXACT)
        m = m_new
    out = acc * v_scale / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(OUT + (qstart + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def varlen_meta(group: int, page: int, head_dim: int, dtype: torch.dtype) -> dict:
    """The launch's constants: a tile of at least 16 rows (tl.dot's least), BLOCK_Q tokens of GROUP heads each."""
    block_m = max(16, triton.next_power_of_2(group))
    return dict(GROUP=group, BLOCK_Q=block_m // triton.next_power_of_2(group), BLOCK_M=block_m, PAGE=page,
                D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=BLOCK_N, EXACT=exact_dots(dtype))


def varlen_grid(num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int) -> tuple[int, int]:
    """Programs for any step of ``num_tokens`` tokens over ``num_seqs`` sequences: a pure function of the two."""
    return triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads


def paged_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           query_start: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D], the step's tokens (sequence b's ``query_lens[b]`` at ``query_start[b]``, ascending, at the
    last positions of its ``context_lens[b]``; a sequence of no token is padding). Returns [T, Hq, D]; rows of no
    sequence (padding tokens) keep ``out``'s values (zeros by default)."""
    t, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    meta = varlen_meta(hq // hkv, page, d, q.dtype)
    out = torch.zeros_like(q) if out is None else out
    num_seqs = page_table.shape[0]
    _varlen_kernel[varlen_grid(t, num_seqs, hkv, meta["BLOCK_Q"])](
        q, k_cache, v_cache, out, page_table, query_start, query_lens, context_lens, scale * k_scale, v_scale,
        num_seqs, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), out.stride(0), out.stride(1), **meta)
    return out
