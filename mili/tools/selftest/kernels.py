"""The device's kernels against their torch references (``mili/kernels/reference.py``), at the Qwen3 head
dim (128) and GQA: on CUDA the Triton kernels (norms, RoPE, the KV store, paged decode and mixed steps, FP8 KV
pages on SM 89+, the FP8, AWQ and int8 GEMMs with and without split K, fused MoE experts, SwiGLU, the q/k-norm +
RoPE + K/V store launch, the small-batch GEMV); on the CPU MILI's C kernels where they build (they need AVX-512
BF16), else nothing (the torch path is the reference itself)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mili.kernels import reference as ref

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _close(got, want, tol) -> tuple[bool, str]:
    atol, rtol = tol
    got, want = got.float().cpu(), want.float().cpu()
    err = (got - want).abs()
    ok = bool((err <= atol + rtol * want.abs()).all()) and got.shape == want.shape
    return ok, f"max |err| {err.max().item():.2e}"


def _norm_checks(ops, dev, dtype) -> list[tuple[str, bool, str]]:
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(7, 1024, generator=g).to(dtype).to(dev) for _ in range(2))
    w = (torch.rand(1024, generator=g) + 0.5).to(dtype).to(dev)
    out = [("rms_norm + residual", *_close(ops.rms_norm(x, w, 1e-6, r)[0], ref.rms_norm(x, w, 1e-6, r)[0],
                                            TOL[dtype]))]
    t, hq, hkv, d = 9, 16, 8, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(dev)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    qw, kw = ((torch.rand(d, generator=g) + 0.5).to(dtype).to(dev) for _ in range(2))
    pos = torch.arange(100, 100 + t, dtype=torch.float32)
    emb = torch.cat([pos[:, None] / 10000 ** (torch.arange(0, d, 2) / d)] * 2, dim=-1)
    cos, sin = emb.cos().to(dev), emb.sin().to(dev)
    # the reference first, on copies: the kernels work in place on the fused qkv rows (the model's case)
    want = ref.qk_norm_rope(q.clone(), k.clone(), qw, kw, 1e-6, cos, sin)
    got = ops.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    out.append(("q/k norm + RoPE", *_close(torch.cat([got[0], got[1]], 1), torch.cat([want[0], want[1]], 1),
                                           (1 / 16, 2e-2) if dtype != torch.float32 else TOL[dtype])))
    return out


def _attention_checks(dev, dtype, kv_fp8: bool) -> list[tuple[str, bool, str]]:
    from mili.kernels.triton import attention as ta
    from mili.kernels.triton.varlen_attention import paged_attention_varlen

    g = torch.Generator().manual_seed(1)
    pages, page, hq, hkv, d = 64, 16, 16, 8, 128
    ctx = [1, 17, 40, 150]
    kv_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    k_cache = torch.zeros(pages, page, hkv, d, dtype=kv_dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(pages, generator=g).tolist()
    width = max(-(-c // page) for c in ctx)
    table, used = [], 0
    for c in ctx:
        n = -(-c // page)
        table.append(perm[used:used + n] + [0] * (width - n))
        used += n
    table = torch.tensor(table, device=dev)
    total = sum(ctx)
    k, v = (torch.randn(total, hkv, d, generator=g).to(dtype).to(dev) for _ in range(2))
    slots = torch.cat([torch.tensor([table[b, p // page].item() * page + p % page for p in range(c)])
                       for b, c in enumerate(ctx)]).to(dev)
    ta.store_kv(k, v, k_cache, v_cache, slots, 0.5, 0.5) if kv_fp8 else ta.store_kv(k, v, k_cache, v_cache, slots)
    scales = (0.5, 0.5) if kv_fp8 else (1.0, 1.0)
    kc_ref, vc_ref = (c.float().to(dtype) * s for c, s in zip((k_cache, v_cache), scales))
    name = "FP8 KV pages: " if kv_fp8 else ""
    out = []
    want_k = torch.zeros(pages, page, hkv, d, dtype=dtype, device=dev)
    want_v = torch.zeros_like(want_k)
    ref.store_kv(k, v, want_k, want_v, slots)
    out.append((name + "store K/V", *_close(kc_ref, want_k, (0.07, 0.07) if kv_fp8 else (0, 0))))
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=dev)
    q = torch.randn(len(ctx), hq, d, generator=g).to(dtype).to(dev)
    got = ta.paged_decode(q, k_cache, v_cache, table, ctx_t, d ** -0.5, k_scale=scales[0], v_scale=scales[1])
    want = ref.paged_attention(q, kc_ref, vc_ref, table, [1] * len(ctx), ctx, d ** -0.5)
    out.append((name + "paged decode (split)", *_close(got, want, TOL[dtype])))
    qlens = [1, 9, 40, 150]
    qs = torch.randn(sum(qlens), hq, d, generator=g).to(dtype).to(dev)
    starts = torch.tensor([0, 1, 10, 50], dtype=torch.int32, device=dev)
    got = paged_attention_varlen(qs, k_cache, v_cache, table, starts,
                                 torch.tensor(qlens, dtype=torch.int32, device=dev), ctx_t, d ** -0.5, *scales)
    want = ref.paged_attention(qs, kc_ref, vc_ref, table, qlens, ctx, d ** -0.5)
    out.append((name + "paged attention, a decode and chunks (prefix + chunk)", *_close(got, want, TOL[dtype])))
    return out


def _gemm_checks(dev, dtype, fp8_act: bool) -> list[tuple[str, bool, str]]:
    from mili.kernels.triton import quant_gemm as qg
    from mili.model.quant import quantize_int8_per_channel

    g = torch.Generator().manual_seed(2)
    n, k = 1024, 1024
    w = torch.randn(n, k, generator=g) * 0.05
    scale = w.abs().reshape(n // 128, 128, k // 128, 128).amax((1, 3)) / 448
    q = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // 128), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 128, generator=g) * 0.01).half()
    packed = qg.pack_int4(values).to(dev)
    q8, scales8 = (t.to(dev) for t in quantize_int8_per_channel(w))
    out = []
    for rows, phase in ((1, "decode, split K"), (200, "prefill")):
        x = torch.randn(rows, k, generator=g).to(dtype).to(dev)
        got = qg.fp8_linear(x, q.to(dev), scale.to(dev), (128, 128), fp8_act)
        want = ref.fp8_linear(x, q.to(dev), scale.to(dev), (128, 128), fp8_act)
        kind = "W8A8" if fp8_act else "weight-only"
        out.append((f"FP8 GEMM {kind} ({phase})", *_close(got, want, TOL[dtype])))
        got = qg.int4_linear(x, packed, zeros.to(dev), scales.to(dev))
        want = ref.int4_linear(x.cpu(), values, zeros, scales)
        tol = (0.05, 0.02) if dtype != torch.float32 else (1e-4, 1e-4)
        out.append((f"AWQ int4 GEMM ({phase})", *_close(got, want, tol)))
        got, want = qg.int8_linear(x, q8, scales8), ref.int8_linear(x, q8, scales8)
        out.append((f"int8 GEMM weight-only ({phase})", *_close(got, want, TOL[dtype])))
    return out


def _fused_checks(dev, dtype, kv_fp8: bool) -> list[tuple[str, bool, str]]:
    """The small-batch fusions: SwiGLU in one pass, q/k-norm + RoPE with the K/V store (the unfused kernels' q and
    pages, exactly), the split-K GEMV (one decode row, and eight)."""
    from mili.kernels.triton import attention as ta
    from mili.kernels.triton import gemv, norm_rope, swiglu

    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(5, 2 * 3072, generator=g) * 4).to(dtype).to(dev)
    out = [("SwiGLU", *_close(swiglu.silu_and_mul(gate_up), ref.silu_and_mul(gate_up),
                              (1e-5, 1e-5) if dtype == torch.float32 else (1e-5, 2 ** -6)))]  # (two roundings)
    t, hq, hkv, d = 6, 16, 8, 128
    q, k, v = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(dev).split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    qw, kw = ((torch.rand(d, generator=g) + 0.5).to(dtype).to(dev) for _ in range(2))
    emb = torch.cat([torch.arange(t, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)] * 2, -1)
    cos, sin = emb.cos().to(dev), emb.sin().to(dev)
    slots = torch.tensor([3, 17, -1, 40, 63, 5], device=dev)
    pages = [torch.zeros(4, 16, hkv, d, dtype=torch.float8_e4m3fn if kv_fp8 else dtype, device=dev) for _ in range(4)]
    scales = (0.5, 2.0) if kv_fp8 else (1.0, 1.0)
    want_q, normed_k = norm_rope.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    ta.store_kv(normed_k, v, pages[0], pages[1], slots, *scales)
    got_q = norm_rope.qk_norm_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, pages[2], pages[3], slots, *scales)
    same = [torch.equal(a.view(torch.uint8) if kv_fp8 else a, b.view(torch.uint8) if kv_fp8 else b)
            for a, b in ((got_q, want_q), (pages[2], pages[0]), (pages[3], pages[1]))]
    out.append(("FP8 KV pages: " * kv_fp8 + "q/k norm + RoPE + K/V store (= unfused)", all(same),
                f"q, K, V identical: {same}"))
    w = (torch.randn(1024, 3072, generator=g) * 0.05).to(dtype).to(dev)
    for rows in (1, 8):
        x = torch.randn(rows, 3072, generator=g).to(dtype).to(dev)
        out.append((f"split-K GEMV ({rows} rows)", *_close(gemv.gemv(x, w), F.linear(x.float(), w.float()),
                                                           TOL[dtype])))
    return out


def _moe_check(dev, dtype) -> tuple[str, bool, str]:
    from mili.kernels.triton.fused_moe import fused_experts
    from mili.model.fused import FusedExperts

    g = torch.Generator().manual_seed(3)
    experts, hidden, inter, tokens, top_k = 16, 256, 128, 40, 4
    block = FusedExperts(experts, hidden, inter, dtype).to(dev)
    with torch.no_grad():
        block.w13.copy_(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1)
        block.w2.copy_(torch.randn(experts, hidden, inter, generator=g) * 0.1)
        x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
        weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(top_k, dim=-1)
        weights, ids = weights.to(dtype).to(dev), ids.to(dev)
        got, want = fused_experts(x, block.w13, block.w2, weights, ids), block(x, weights, ids)
    return ("fused MoE experts", *_close(got, want, (3e-2, 3e-2) if dtype != torch.float32 else (2e-3, 2e-3)))


def check(device: torch.device) -> list[tuple[str, bool, str]]:
    """(kernel, ok, detail) for every kernel of ``device``; an empty list where there is none of MILI's own."""
    if device.type == "cpu":
        from mili.kernels import cpu

        if not cpu.available():
            return []
        from mili.kernels.cpu.ops import CpuOps

        return [(f"CPU {name} (bf16)", ok, d) for name, ok, d in _norm_checks(CpuOps, device, torch.bfloat16)]
    return triton_checks(device)


def triton_checks(device: torch.device, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
                  fp8: bool | None = None) -> list[tuple[str, bool, str]]:
    """(kernel, ok, detail) for each of MILI's Triton kernels on ``device``: a GPU, or the CPU under
    ``TRITON_INTERPRET=1``. ``fp8``: check the FP8 paths too (the FP8 KV cache, W8A8) in bf16; None: where the device
    has FP8."""
    from mili.kernels.triton.launch import device_spec
    from mili.kernels.triton.ops import TritonOps

    has_fp8 = device_spec(device).has_fp8 if fp8 is None else fp8
    rows = []
    for dtype in dtypes:
        label = str(dtype).removeprefix("torch.")
        found = _norm_checks(TritonOps, device, dtype) + _attention_checks(device, dtype, False)
        found += _fused_checks(device, dtype, False)
        if has_fp8 and dtype == torch.bfloat16:
            found += _attention_checks(device, dtype, True) + _fused_checks(device, dtype, True)
        found += _gemm_checks(device, dtype, has_fp8 and dtype != torch.float32)
        found.append(_moe_check(device, dtype))
        rows += [(f"{name} ({label})", ok, d) for name, ok, d in found]
    return rows
