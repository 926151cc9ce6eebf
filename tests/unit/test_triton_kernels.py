"""The Triton kernels against their torch references: on the CPU under TRITON_INTERPRET=1 (set by
tests/conftest.py), or compiled on a GPU with MILI_TEST_GPU=1.

Shapes are small so the interpreter stays fast; they cover several head dims (128 included), GQA
ratios, page sizes, ragged lengths and a cached prefix plus a chunk.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from support.devices import TRITON_DEVICE as DEVICE  # noqa: E402
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from mili.kernels import reference as ref  # noqa: E402
from mili.kernels.triton import attention as tk  # noqa: E402
from mili.kernels.triton import norm_rope as tn  # noqa: E402
from mili.kernels.triton.fp8 import fp8_bits_to_float, to_fp8  # noqa: E402
from mili.kernels.triton.launch import DeviceSpec  # noqa: E402
from mili.kernels.triton.varlen_attention import paged_attention_varlen  # noqa: E402

tl = triton.language

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _pool(num_pages, page, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    return k, v


def _tables(context_lens, page, num_pages, seed=1):
    """Random, non-overlapping page tables (pages deliberately out of order)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g).tolist()
    width = max(-(-c // page) for c in context_lens)
    rows, k = [], 0
    for c in context_lens:
        n = -(-c // page)
        rows.append(perm[k:k + n] + [0] * (width - n))
        k += n
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv,page", [(128, 4, 2, 16), (64, 8, 1, 32), (32, 4, 4, 16), (128, 2, 2, 16)])
def test_paged_decode(dtype, d, hq, hkv, page):
    torch.manual_seed(0)
    ctx = [1, 17, 40, 150]  # ragged, some in one page, one across many (several splits)
    k_cache, v_cache = _pool(64, page, hkv, d, dtype)
    table = _tables(ctx, page, 64)
    q = torch.randn(len(ctx), hq, d).to(dtype).to(DEVICE)
    scale = d ** -0.5
    got = tk.paged_decode(q, k_cache, v_cache, table, torch.tensor(ctx, dtype=torch.int32, device=DEVICE), scale)
    want = ref.paged_attention(q, k_cache, v_cache, table, [1] * len(ctx), ctx, scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _decode_case(ctx, page, hq, hkv, d, dtype=torch.float32, fp8=False, max_pages=None, seed=0):
    """paged_decode against the reference for contexts ``ctx`` (pages out of order, K/V and q seeded)."""
    num_pages = sum(-(-c // page) for c in ctx) + 1
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    if fp8:
        (k_cache, v_cache), (k_ref, v_ref) = _fp8_pool(num_pages, page, hkv, d, scales, seed)
    else:
        k_cache, v_cache = k_ref, v_ref = _pool(num_pages, page, hkv, d, dtype, seed)
    table = _tables(ctx, page, num_pages, seed + 1)
    q = torch.randn(len(ctx), hq, d, generator=torch.Generator().manual_seed(seed + 2)).to(dtype).to(DEVICE)
    got = tk.paged_decode(q, k_cache, v_cache, table, torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
                          d ** -0.5, max_pages, k_scale=scales[0], v_scale=scales[1])
    want = ref.paged_attention(q, k_ref, v_ref, table, [1] * len(ctx), ctx, d ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("ctx", [1, 15, 16, 17, 100, 1000, 4097, 32768])
def test_paged_decode_divides_the_live_context(ctx, page):
    """One sequence in a launch sized for a 40,960-token model (64 splits): its context, from one token to
    32k, divided among as many splits as it fills; 64 keys an iteration over pages of 16 (four a block) and
    of 128 (half of one); 128 keys at 32k (head_dim 16: fewer iterations under the interpreter)."""
    max_pages, d = 40960 // page, 16 if ctx > 5000 else 64
    assert tk.decode_splits(1, 1, max_pages, page, 132) == tk.DECODE_MAX_SPLITS
    assert tk.decode_meta(2, page, d, torch.float32)["BLOCK_N"] == (128 if d == 16 else 64)
    _decode_case([ctx], page, hq=2, hkv=1, d=d, max_pages=max_pages)


@pytest.mark.parametrize("page,fp8", [(16, False), (128, False), (16, True)])
def test_paged_decode_mixed_contexts_one_launch(page, fp8):
    """A batch whose longest sequence fills all 64 splits while the others fill a few or one (the rest of
    their programs exit at once), GQA, FP8 pages."""
    ctx = [3, tk.DECODE_MAX_SPLITS * tk.DECODE_MIN_KEYS, 700]
    assert tk.decode_splits(len(ctx), 1, -(-max(ctx) // page), page, 132) == tk.DECODE_MAX_SPLITS
    _decode_case(ctx, page, hq=4, hkv=1, d=16, fp8=fp8, dtype=torch.bfloat16 if fp8 else torch.float32)


class _Launches:
    """A kernel whose launches are counted."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch,splits", [(2, 4), (8, 1)])
def test_paged_decode_splits_follow_the_batch(monkeypatch, batch, splits, fp8):
    """On a GPU of 4 SMs (16 programs wanted): 2 sequences x 2 KV heads take 4 splits and the reduce; 8 fill it
    with one split, and the kernel writes the output itself (no reduce launched)."""
    monkeypatch.setattr(tk, "device_spec", lambda device: DeviceSpec("4 SMs", (9, 0), 227 * 1024, 4))
    reduce = _Launches(tk._decode_reduce_kernel)  # reach-in: whether the reduce kernel launches (none on one split)
    monkeypatch.setattr(tk, "_decode_reduce_kernel", reduce)
    ctx = torch.randint(1, 500, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    ctx[0] = 500
    assert tk.decode_splits(batch, 2, 32, 16, 4) == splits
    _decode_case(ctx, 16, hq=4, hkv=2, d=16, fp8=fp8, max_pages=32)
    assert reduce.count == (splits > 1)


def test_decode_splits_are_static_and_fill_the_gpu():
    h100, l4 = 132, 58
    assert tk.decode_splits(1, 8, 40960 // 16, 16, h100) == 64  # batch 1: capped
    assert tk.decode_splits(1, 8, 40960 // 16, 16, l4) == 29  # 4 programs an SM: 232 / 8 KV heads
    assert tk.decode_splits(4, 8, 40960 // 16, 16, h100) == 17
    assert tk.decode_splits(64, 8, 40960 // 16, 16, h100) == 2
    assert tk.decode_splits(66, 8, 40960 // 16, 16, h100) == 1
    assert tk.decode_splits(1, 8, 8, 16, h100) == 1  # 128 tokens at most: one split (DECODE_MIN_KEYS)
    assert tk.decode_splits(1, 8, 256 // 16, 16, h100) == 2
    assert tk.decode_splits(1, 1, 1, 128, h100) == 1
    assert tk.decode_splits(1, 1, 1, 256, h100) == 2
    splits = [tk.decode_splits(b, 4, 2560, 16, h100) for b in range(1, 600)]
    assert all(1 <= s <= tk.DECODE_MAX_SPLITS for s in splits) and splits == sorted(splits, reverse=True)
    assert tk.decode_reduce_splits() == [2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv,page", [(128, 4, 2, 16), (64, 6, 2, 32), (32, 2, 2, 16)])
def test_paged_chunks_prefix_plus_chunk(dtype, d, hq, hkv, page):
    torch.manual_seed(1)
    query_lens = [5, 33, 1, 70]
    context_lens = [5, 60, 19, 70]  # no prefix; 27 cached + 33; a one-token chunk; a whole prompt
    k_cache, v_cache = _pool(48, page, hkv, d, dtype, seed=3)
    table = _tables(context_lens, page, 48, seed=4)
    t = sum(query_lens)
    q = torch.randn(t, hq, d).to(dtype).to(DEVICE)
    starts = torch.tensor([0] + list(torch.cumsum(torch.tensor(query_lens), 0)[:-1]), dtype=torch.int32,
                          device=DEVICE)
    scale = d ** -0.5
    got = paged_attention_varlen(q, k_cache, v_cache, table, starts,
                                 torch.tensor(query_lens, dtype=torch.int32, device=DEVICE),
                                 torch.tensor(context_lens, dtype=torch.int32, device=DEVICE), scale)
    want = ref.paged_attention(q, k_cache, v_cache, table, query_lens, context_lens, scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_skips_padding(dtype):
    torch.manual_seed(2)
    k_cache, v_cache = (torch.zeros(6, 16, 2, 64, dtype=dtype, device=DEVICE) for _ in range(2))
    k = torch.randn(5, 2, 64).to(dtype).to(DEVICE)
    v = torch.randn(5, 2, 64).to(dtype).to(DEVICE)
    slots = torch.tensor([3, 17, 95, -1, 40], device=DEVICE)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = (torch.zeros_like(k_cache) for _ in range(2))
    ref.store_kv(k, v, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert want_k.view(-1, 2, 64)[3].abs().sum() > 0 and k_cache.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 128, 96])
def test_rms_norm_with_and_without_residual(dtype, n):
    torch.manual_seed(3)
    x = torch.randn(7, n).to(dtype).to(DEVICE)
    r = torch.randn(7, n).to(dtype).to(DEVICE)
    w = (torch.rand(n) + 0.5).to(dtype).to(DEVICE)
    torch.testing.assert_close(tn.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL[dtype])
    got, got_r = tn.rms_norm(x, w, 1e-6, r)
    want, want_r = ref.rms_norm(x, w, 1e-6, r)
    # the residual add rounds like torch's: exactly in float32, within one bf16 ulp (the interpreter's
    # float32 -> bf16 conversion does not round to nearest even)
    torch.testing.assert_close(got_r, want_r, atol=0, rtol=0 if dtype == torch.float32 else 2 ** -7)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(128, 4, 2), (64, 2, 2), (32, 8, 1)])
def test_qk_norm_rope(dtype, d, hq, hkv):
    torch.manual_seed(4)
    t = 9
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views, as in the model
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    qw, kw = (torch.rand(d) + 0.5).to(dtype).to(DEVICE), (torch.rand(d) + 0.5).to(dtype).to(DEVICE)
    pos = torch.arange(100, 100 + t, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    got_q, got_k = tn.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    want_q, want_k = ref.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    # bf16: four roundings deep, the interpreter's rounding can leave one ulp (1/16 at |x| ~ 8)
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=1 / 16, rtol=2e-2)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)


# -- FP8 KV pages -----------------------------------------------------------------------------------------------
@triton.jit
def _convert(X, Q, B, F, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Q + i, to_fp8(tl.load(X + i)))
    tl.store(F + i, fp8_bits_to_float(tl.load(B + i)))


def test_fp8_rounding_matches_torch():
    """The kernels' float32 -> e4m3 rounding (fp8.to_fp8) against torch's cast, over every binade, subnormals,
    halfway cases and saturation, and the byte decoder (fp8_bits_to_float) over all 254 finite bytes."""
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    halfway = (grid[:-1] + grid[1:]) / 2  # ties (within a binade and across binade tops): nearest even
    x = torch.cat([torch.randn(2048, generator=g) * 30, torch.randn(1024, generator=g) * 1e-2,
                   torch.tensor([500.0, -1e4, 448.0, 464.0, 1.98, -1.98, 0.0]), halfway[halfway.abs() < 448]])
    n = triton.next_power_of_2(x.numel())
    x = torch.nn.functional.pad(x, (0, n - x.numel())).to(DEVICE)
    q = torch.empty(n, dtype=torch.float8_e4m3fn, device=DEVICE)
    finite = torch.arange(256, dtype=torch.uint8)
    finite = finite[(finite & 0x7F) != 0x7F]
    b = torch.nn.functional.pad(finite, (0, n - finite.numel())).to(DEVICE)
    f = torch.empty(n, device=DEVICE)
    _convert[(1,)](x, q, b, f, N=n)
    torch.testing.assert_close(q.float(), ref.to_fp8(x).float(), atol=0, rtol=0)
    assert q.float().abs().max() == 448 and q.float()[x.abs() > 0].ne(0).any()
    torch.testing.assert_close(f[:finite.numel()].cpu(), finite.view(torch.float8_e4m3fn).float(), atol=0, rtol=0)


def _fp8_pool(num_pages, page, hkv, d, scales, seed=0):
    """FP8 pages as store_kv writes them (x / scale, rounded) and their dequantized float32 values."""
    k, v = _pool(num_pages, page, hkv, d, torch.float32, seed)
    pages = [ref.to_fp8(x * 3, s) for x, s in zip((k, v), scales)]
    return pages, [p.float() * s for p, s in zip(pages, scales)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_fp8(dtype):
    torch.manual_seed(5)
    k_cache, v_cache = (torch.zeros(6, 16, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2))
    k = torch.randn(5, 2, 64) * 40
    k[0, 0, 0], k[4, 1, 7] = 200.0, -150.0  # beyond 448 x scale (and stored: rows 0 and 4): saturated
    k = k.to(dtype).to(DEVICE)
    v = torch.randn(5, 2, 64).to(dtype).to(DEVICE)
    slots = torch.tensor([3, 17, 95, -1, 40], device=DEVICE)
    tk.store_kv(k, v, k_cache, v_cache, slots, k_scale=0.25, v_scale=2.0)
    want_k, want_v = (torch.zeros_like(k_cache) for _ in range(2))
    as_bytes = [t.view(torch.uint8) for t in (ref.to_fp8(k, 0.25), ref.to_fp8(v, 2.0), want_k, want_v)]
    ref.store_kv(*as_bytes, slots)  # (torch's CPU index_copy has no float8)
    torch.testing.assert_close(k_cache.float(), want_k.float(), atol=0, rtol=0)
    torch.testing.assert_close(v_cache.float(), want_v.float(), atol=0, rtol=0)
    assert k_cache.float().abs().max() == 448 and v_cache.float().abs().sum() > 0
    slots_k = k_cache.view(-1, 2, 64).float()
    assert slots_k[3, 0, 0] == 448 and slots_k[40, 1, 7] == -448


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv,page", [(128, 4, 2, 16), (32, 4, 4, 32)])
def test_paged_decode_fp8(dtype, d, hq, hkv, page):
    torch.manual_seed(6)
    ctx = [1, 40, 150]
    scales = (0.5, 2.0)
    (k_cache, v_cache), (k_deq, v_deq) = _fp8_pool(64, page, hkv, d, scales)
    table = _tables(ctx, page, 64)
    q = torch.randn(len(ctx), hq, d).to(dtype).to(DEVICE)
    got = tk.paged_decode(q, k_cache, v_cache, table, torch.tensor(ctx, dtype=torch.int32, device=DEVICE), d ** -0.5,
                          k_scale=scales[0], v_scale=scales[1])
    want = ref.paged_attention(q, k_deq, v_deq, table, [1] * len(ctx), ctx, d ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_chunks_fp8(dtype):
    torch.manual_seed(7)
    d, hq, hkv, page = 64, 4, 2, 16
    query_lens, context_lens = [5, 33, 1], [5, 60, 19]
    scales = (2.0, 0.5)
    (k_cache, v_cache), (k_deq, v_deq) = _fp8_pool(48, page, hkv, d, scales, seed=3)
    table = _tables(context_lens, page, 48, seed=4)
    q = torch.randn(sum(query_lens), hq, d).to(dtype).to(DEVICE)
    starts = torch.tensor([0, 5, 38], dtype=torch.int32, device=DEVICE)
    got = paged_attention_varlen(q, k_cache, v_cache, table, starts,
                                 torch.tensor(query_lens, dtype=torch.int32, device=DEVICE),
                                 torch.tensor(context_lens, dtype=torch.int32, device=DEVICE), d ** -0.5, *scales)
    want = ref.paged_attention(q, k_deq, v_deq, table, query_lens, context_lens, d ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
