"""The mixed-step attention kernel (``mili/kernels/triton/varlen_attention.py``: decodes and prefill chunks in one
launch of a length-independent grid, which CUDA graphs of mixed steps capture) against the torch reference, under
TRITON_INTERPRET=1 on the CPU (or compiled on a GPU with MILI_TEST_GPU=1)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from support.devices import TRITON_DEVICE as DEVICE  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from mili.kernels import reference as ref  # noqa: E402
from mili.kernels.triton.varlen_attention import paged_attention_varlen, varlen_grid, varlen_meta  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
i32 = dict(dtype=torch.int32, device=DEVICE)


def _case(query_lens, context_lens, hq, hkv, d, page, dtype, seed, pad_seqs=0, pad_tokens=0):
    """Pages, a page table (pages out of order), queries; ``pad_*``: padding sequences (no token) and tokens (of no
    sequence) after the real ones, as a CUDA graph's static buffers hold them."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-c // page) for c in context_lens) + 2
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    perm = torch.randperm(num_pages, generator=g).tolist()
    width = max(-(-c // page) for c in context_lens)
    rows, used = [], 0
    for c in context_lens:
        n = -(-c // page)
        rows.append(perm[used:used + n] + [0] * (width - n))
        used += n
    rows += [[0] * width] * pad_seqs
    t = sum(query_lens)
    q = torch.randn(t + pad_tokens, hq, d, generator=g).to(dtype).to(DEVICE)
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)
    starts += [t] * pad_seqs
    lens = list(query_lens) + [0] * pad_seqs
    ctx = list(context_lens) + [0] * pad_seqs
    return (q, k_cache, v_cache, torch.tensor(rows, **i32), torch.tensor(starts, **i32), torch.tensor(lens, **i32),
            torch.tensor(ctx, **i32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,page", [(4, 2, 64, 16), (6, 2, 32, 32), (2, 2, 128, 16), (8, 1, 32, 128)])
def test_mixed_step_equals_the_reference(dtype, hq, hkv, d, page):
    """Decodes (one token, short and long contexts) and prefill chunks (no prefix, a cached prefix, a one-token
    chunk, a chunk longer than a block) in one launch."""
    query_lens = [1, 1, 1, 37, 5, 1, 70]
    context_lens = [1, 300, 17, 60, 5, 64, 70]
    q, kc, vc, table, starts, lens, ctx = _case(query_lens, context_lens, hq, hkv, d, page, dtype, seed=1)
    got = paged_attention_varlen(q, kc, vc, table, starts, lens, ctx, d ** -0.5)
    want = ref.paged_attention(q, kc, vc, table, query_lens, context_lens, d ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_padding_sequences_and_tokens_write_nothing():
    """A graph's static buffers: sequences of no token after the real ones, and tokens of no sequence, which keep
    what ``out`` held (the real rows are exactly those of the launch without padding)."""
    query_lens, context_lens = [1, 9, 1], [40, 30, 3]
    args = _case(query_lens, context_lens, 4, 2, 32, 16, torch.float32, seed=2, pad_seqs=5, pad_tokens=13)
    q = args[0]
    sentinel = torch.full_like(q, 7.0)
    got = paged_attention_varlen(*args, 32 ** -0.5, out=sentinel.clone())
    plain = _case(query_lens, context_lens, 4, 2, 32, 16, torch.float32, seed=2)
    want = paged_attention_varlen(q[:11], *plain[1:], 32 ** -0.5)
    assert torch.equal(got[:11], want) and torch.equal(got[11:], sentinel[11:])


def test_the_grid_depends_on_sizes_alone():
    meta = varlen_meta(2, 16, 128, torch.bfloat16)
    assert meta["BLOCK_Q"] * 2 == meta["BLOCK_M"] == 16
    # the most blocks any split of T tokens over S sequences needs: cdiv(T, BLOCK_Q) + S
    for lens in ([1] * 64, [64], [7, 1, 1, 55], [9] * 7 + [1]):
        blocks = sum(-(-n // meta["BLOCK_Q"]) for n in lens)
        assert blocks <= varlen_grid(sum(lens), len(lens), 8, meta["BLOCK_Q"])[0]


def test_fp8_pages():
    query_lens, context_lens = [1, 12, 1], [33, 20, 2]
    q, kc, vc, table, starts, lens, ctx = _case(query_lens, context_lens, 4, 2, 64, 16, torch.bfloat16, seed=3)
    k_scale, v_scale = 0.5, 2.0
    k8, v8 = ref.to_fp8(kc.float(), k_scale), ref.to_fp8(vc.float(), v_scale)
    got = paged_attention_varlen(q, k8, v8, table, starts, lens, ctx, 64 ** -0.5, k_scale, v_scale)
    want = ref.paged_attention(q, (k8.float() * k_scale).to(q.dtype), (v8.float() * v_scale).to(q.dtype), table,
                               query_lens, context_lens, 64 ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])
