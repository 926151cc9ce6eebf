"""Fewer, fuller kernels at small batch (issue 58): SwiGLU in one pass, Qwen3's q/k-norm + RoPE with the K/V store in
one launch, and the split-K GEMV of decode batches; each against its torch reference, or the unfused Triton kernels
bit for bit, on the CPU under TRITON_INTERPRET=1 (set by tests/conftest.py) or compiled on a GPU with MILI_TEST_GPU=1;
then their wiring: the attention layer's fused store, the GEMV's linear layers, the plan's choice, and greedy decoding
through the engine. (Their speed is a GPU's to measure: benchmarks/gemv_ab.py.)"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

triton = pytest.importorskip("triton")

from support.devices import TRITON_DEVICE as DEVICE  # noqa: E402
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from mili.kernels import reference as ref  # noqa: E402
from mili.kernels.triton import attention as tk  # noqa: E402
from mili.kernels.triton import gemv as tg  # noqa: E402
from mili.kernels.triton import norm_rope as tn  # noqa: E402
from mili.kernels.triton import swiglu  # noqa: E402
from mili.kernels.triton.launch import TARGETS, gemm_smem_bound  # noqa: E402
from mili.kernels.triton.ops import TritonOps  # noqa: E402

F8 = torch.float8_e4m3fn
# SwiGLU is two roundings deep (silu, then the product): the interpreter's float32 -> bf16 cast truncates (torch
# rounds to nearest even), so a bf16 result may sit up to two ulps (2^-7 .. 2^-6 relative) from torch's; fp16's cast
# rounds as torch's, and the float32 exp may differ from torch's in its last bits (one fp16 ulp, rarely)
SWIGLU_TOL = {torch.float32: dict(atol=1e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-6, rtol=2 ** -6),
              torch.float16: dict(atol=1e-6, rtol=2 ** -10)}


def _randn(*shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


# -- SwiGLU ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [1, 7, 96, 1031, 2304])  # odd widths, one block, several blocks with a ragged last
def test_silu_and_mul_matches_torch(dtype, inter):
    gate_up = _randn(5, 2 * inter, seed=inter, scale=4.0, dtype=dtype)  # (|gate| up to ~16: exp's tails too)
    got = swiglu.silu_and_mul(gate_up)
    want = ref.silu_and_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **SWIGLU_TOL[dtype])


def test_silu_and_mul_takes_any_leading_shape_and_strided_rows():
    gate_up = _randn(2, 3, 2 * 40, seed=1, dtype=torch.bfloat16)
    torch.testing.assert_close(swiglu.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **SWIGLU_TOL[torch.bfloat16])
    wide = _randn(4, 2 * 40 + 8, seed=2, dtype=torch.bfloat16)[:, 8:]  # rows 88 apart
    torch.testing.assert_close(swiglu.silu_and_mul(wide), ref.silu_and_mul(wide), **SWIGLU_TOL[torch.bfloat16])
    assert swiglu.silu_and_mul(gate_up[:0]).shape == (0, 3, 40)
    assert TritonOps.silu_and_mul is swiglu.silu_and_mul


# -- q/k-norm + RoPE + K/V store ------------------------------------------------------------------------------------
def _attention_inputs(t, hq, hkv, d, dtype, seed):
    """q, k, v as strided views of one fused qkv output (as the model has them), norm weights, cos/sin [T, D]."""
    qkv = _randn(t, (hq + 2 * hkv) * d, seed=seed, scale=2.0, dtype=dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    weights = [(torch.rand(d, generator=torch.Generator().manual_seed(seed + i)) + 0.5).to(dtype).to(DEVICE)
               for i in (1, 2)]
    pos = torch.arange(100, 100 + t, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    return (q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), *weights, emb.cos().to(DEVICE),
            emb.sin().to(DEVICE))


def _pages(hkv, d, dtype, seed):
    """Two pools of 4 pages of 16 slots, filled with noise (slots the store must leave alone stay as they were)."""
    pools = [_randn(4, 16, hkv, d, seed=seed + i, dtype=torch.float32) for i in (0, 1)]
    return [p.to(dtype) for p in pools]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == F8 else x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("d,hq,hkv", [(128, 4, 2), (64, 2, 2), (32, 8, 1)])
def test_qk_norm_rope_store_is_norm_rope_then_store(dtype, fp8, d, hq, hkv):
    """The fused launch's q and pages are qk_norm_rope's q and store_kv's pages after it, bit for bit; padding rows
    (slot -1) write nothing; FP8 pages hold k / k_scale and v / v_scale rounded as store_kv rounds them."""
    q, k, v, qw, kw, cos, sin = _attention_inputs(6, hq, hkv, d, dtype, seed=d + hq)
    slots = torch.tensor([3, 17, -1, 40, 63, -1], device=DEVICE)
    cache = F8 if fp8 else dtype
    scales = (0.25, 2.0) if fp8 else (1.0, 1.0)
    want_k, want_v = _pages(hkv, d, cache, seed=7)
    got_k, got_v = want_k.clone(), want_v.clone()
    want_q, normed_k = tn.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    tk.store_kv(normed_k, v, want_k, want_v, slots, *scales)
    got_q = tn.qk_norm_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, got_k, got_v, slots, *scales)
    assert torch.equal(got_q, want_q)
    assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))
    before = _pages(hkv, d, cache, seed=7)[0].view(-1, hkv, d)
    assert not torch.equal(_bits(got_k.view(-1, hkv, d)[17]), _bits(before[17]))  # (the slots were written)


def test_qk_norm_rope_store_falls_back_where_the_kernel_does_not_take_the_head_dim():
    """head_dim 48 (not 2 x a power of two): torch's norm + RoPE, then the Triton store."""
    q, k, v, qw, kw, cos, sin = _attention_inputs(3, 2, 1, 48, torch.float32, seed=3)
    slots = torch.tensor([0, -1, 5], device=DEVICE)
    want_k, want_v = _pages(1, 48, torch.float32, seed=8)
    got_k, got_v = want_k.clone(), want_v.clone()
    want_q, normed_k = ref.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    tk.store_kv(normed_k, v, want_k, want_v, slots)
    got_q = TritonOps.qk_norm_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, got_k, got_v, slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def _qwen3_attention(backend, dtype, seed=0):
    from transformers import Qwen3Config

    from mili.config import ModelConfig
    from mili.model.qwen3 import Qwen3Attention

    hf = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
    hf.architectures = ["Qwen3ForCausalLM"]
    layer = Qwen3Attention(ModelConfig.from_hf(hf), backend, dtype, TritonOps)
    torch.manual_seed(seed)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape) * 0.2 + (1.0 if p.dim() == 1 else 0.0)).to(dtype)
    return layer.to(DEVICE)


def test_the_attention_layer_stores_in_the_norm_launch():
    """Qwen3Attention on the Triton back-end (the fused launch, then ``forward(stored=True)``) gives the unfused
    path's output and pages, bit for bit: a prefill of 5 tokens, then a decode over them."""
    from mili.model.batch import ForwardBatch
    from mili.runtime.attention.triton_backend import TritonAttentionBackend

    class Unfused(TritonAttentionBackend):
        qk_norm_rope_store = None  # (as the torch and CPU back-ends: no fused op, the layer stores through forward)

    dtype = torch.bfloat16
    outs = []
    for backend in (TritonAttentionBackend(4), Unfused(4)):
        layer = _qwen3_attention(backend, dtype)
        k_cache, v_cache = (torch.zeros(4, 16, 2, 32, dtype=dtype, device=DEVICE) for _ in range(2))
        table = torch.tensor([[2, 0, 0, 0]], device=DEVICE)
        steps = []
        for start, n in ((0, 5), (5, 1)):
            pos = torch.arange(start, start + n, device=DEVICE)
            batch = ForwardBatch(
                input_ids=torch.zeros(n, dtype=torch.long, device=DEVICE), positions=pos,
                slot_mapping=2 * 16 + pos, page_table=table, query_lens=[n], context_lens=[start + n],
                num_decodes=int(n == 1), logits_indices=torch.tensor([n - 1], device=DEVICE),
                context_lens_t=torch.tensor([start + n], dtype=torch.int32, device=DEVICE),
                query_lens_t=torch.tensor([n], dtype=torch.int32, device=DEVICE),
                query_start_t=torch.tensor([0], dtype=torch.int32, device=DEVICE))
            inv = 1.0 / (1e6 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
            emb = torch.cat([pos.float().cpu()[:, None] * inv] * 2, dim=-1)
            h = _randn(n, 64, seed=start, dtype=dtype)
            with torch.no_grad():
                steps.append(layer(h, batch, (emb.cos().to(DEVICE), emb.sin().to(DEVICE)), k_cache, v_cache))
        outs.append((steps, k_cache, v_cache))
    (fused, fk, fv), (unfused, uk, uv) = outs
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
    assert torch.equal(fk, uk) and torch.equal(fv, uv) and fk[2, :6].abs().sum() > 0 and not fk[2, 6:].any()


# -- the split-K GEMV -------------------------------------------------------------------------------------------------
SPLIT, WHOLE = (37, 300), (19, 40)  # (N, K): K in parts (2 of 256 in 16 bits) plus a reduce pass; one part, no reduce


def _gemv_case(m, n, k, dtype, bias, seed):
    x = _randn(m, k, seed=seed, dtype=dtype)
    w = _randn(n, k, seed=seed + 1, scale=0.5, dtype=dtype)
    b = _randn(n, seed=seed + 2, dtype=dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("n,k", [SPLIT, WHOLE])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear_in_float32(m, n, k, bias):
    assert (tg.gemv_config(n, k, torch.float32, TARGETS["sm_90"]).split > 1) == ((n, k) == SPLIT)
    x, w, b = _gemv_case(m, n, k, torch.float32, bias, seed=m)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(tg.gemv(x, w, b).double(), want, atol=2e-5, rtol=1e-5)


@contextlib.contextmanager
def float32_reductions():
    """torch's 16-bit matmuls reduced in float32 inside, the flags put back after through torch's own setters.
    (Not monkeypatch: torch serves these flags through `__getattr__`, so pytest 9.2 records them as missing and its
    undo fails on `delattr`.)"""
    matmul = torch.backends.cuda.matmul
    flags = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    saved = {flag: getattr(matmul, flag) for flag in flags}
    try:
        for flag in flags:
            setattr(matmul, flag, False)
        yield
    finally:
        for flag, value in saved.items():
            setattr(matmul, flag, value)


def test_float32_reductions_puts_the_flags_back():
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    assert before == (True, True)  # torch's defaults
    with float32_reductions():
        assert (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction) == (
            False, False)
    assert (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction) == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k", [SPLIT, WHOLE])
def test_gemv_matches_linear_in_16_bits(dtype, m, n, k):
    """The float32 sums (+ bias) rounded once: torch's 16-bit linear within one rounding. (On a GPU torch lets
    cuBLAS reduce 16-bit products in 16 bits by default: an H200 then parted by 0.047 on one output; the
    comparison with torch asks it for float32 reductions.)"""
    x, w, b = _gemv_case(m, n, k, dtype, True, seed=10 + m)
    want = F.linear(x.float(), w.float(), b.float())  # the exact-ish sum, then one rounding to compare with
    got = tg.gemv(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=1e-3, rtol=2 ** -7)
    with float32_reductions():
        torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=1e-3, rtol=2 ** -6)


def test_gemv_rows_do_not_depend_on_the_batch_and_runs_repeat():
    """A row's output is the same bits alone or among 8 rows (the tiles and the split depend on N and K only), and
    the same every run (no atomics: the parts are added in order)."""
    n, k = SPLIT
    x, w, b = _gemv_case(8, n, k, torch.bfloat16, True, seed=20)
    all_rows = tg.gemv(x, w, b)
    assert torch.equal(all_rows, tg.gemv(x, w, b))
    for i in (0, 3, 7):
        assert torch.equal(tg.gemv(x[i:i + 1], w, b), all_rows[i:i + 1])
    strided = torch.cat([x, x], dim=1)[:, :k]  # rows 2K apart
    assert torch.equal(tg.gemv(strided, w, b), all_rows)
    assert tg.gemv(x[:0], w, b).shape == (0, n)


QWEN3_0_6B = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
              "lm_head": (151936, 1024)}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_config_fits_every_device(target, dtype):
    """Tiles within the device's shared memory (two or three stages), the K parts covering K with none empty, and
    enough programs: about four an SM where the shape has them."""
    spec = TARGETS[target]
    for n, k in list(QWEN3_0_6B.values()) + [(37, 300), (19, 40), (5120, 25600), (1, 64)]:
        c = tg.gemv_config(n, k, dtype, spec)
        k_steps = triton.cdiv(k, c.block_k)
        assert c.block_n in (16, 32, 64) and 16 <= c.block_k <= 256 and c.num_stages in (2, 3)
        assert gemm_smem_bound(tg.GEMV_BLOCK_M, c.block_n, c.block_k, dtype.itemsize, dtype.itemsize,
                               c.num_stages) <= spec.smem_per_block
        assert c.split * c.steps_per_split >= k_steps > (c.split - 1) * c.steps_per_split
        programs = triton.cdiv(n, c.block_n) * c.split  # (at least half the aim: whole parts round the split down)
        assert 2 * programs >= min(tg.GEMV_PROGRAMS_PER_SM * spec.num_sms, triton.cdiv(n, 16) * k_steps)
    head = tg.gemv_config(*QWEN3_0_6B["lm_head"], torch.bfloat16, TARGETS["sm_90"])
    assert (head.block_n, head.split) == (64, 1)  # 2374 column tiles: no split, no reduce
    down = tg.gemv_config(*QWEN3_0_6B["down"], torch.bfloat16, TARGETS["sm_90"])
    assert down.split > 1 and down.block_n == 16


# -- the GEMV's linear layers and the plan ----------------------------------------------------------------------
def test_small_batch_linear_runs_the_gemv_up_to_8_rows():
    from mili.model.gpu_linear import SmallBatchLinear

    dense = nn.Linear(40, 19, bias=True, dtype=torch.bfloat16).to(DEVICE)
    layer = SmallBatchLinear(dense.weight, dense.bias, None)
    assert layer.weight is dense.weight and layer.bias.data_ptr() == dense.bias.data_ptr()  # nothing copied
    x = _randn(2, 4, 40, seed=30, dtype=torch.bfloat16)  # 8 rows: the GEMV
    assert torch.equal(layer(x), tg.gemv(x.reshape(8, 40), dense.weight, dense.bias).view(2, 4, 19))
    x = _randn(9, 40, seed=31, dtype=torch.bfloat16)  # 9: cuBLAS (here torch's CPU linear)
    assert torch.equal(layer(x), F.linear(x, dense.weight, dense.bias))


def test_every_plain_16_bit_linear_and_a_tied_head_take_the_gemv():
    from mili.model.fused import FusedLinear, RouterLinear
    from mili.model.gpu_linear import SmallBatchLinear, use_small_batch_gemv

    bf16 = torch.bfloat16
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(50, 16, dtype=bf16)
    model.model.qkv = FusedLinear(16, [8, 4, 4], True, bf16)
    model.model.o = nn.Linear(8, 16, bias=False, dtype=bf16)
    model.model.gate = RouterLinear(16, 4, bias=False, dtype=bf16)
    model.model.f32 = nn.Linear(16, 16, dtype=torch.float32)
    model.lm_head = None
    qkv_weight = model.model.qkv.weight
    use_small_batch_gemv(model)
    assert isinstance(model.model.qkv, SmallBatchLinear) and model.model.qkv.shard_sizes == [8, 4, 4]
    assert model.model.qkv.weight is qkv_weight and model.model.qkv.bias is not None
    assert isinstance(model.model.o, SmallBatchLinear)
    assert type(model.model.gate) is RouterLinear and type(model.model.f32) is nn.Linear  # (routing; float32)
    assert isinstance(model.lm_head, SmallBatchLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 50 * 16 + 16 * 16 + 16 + 16 * 8 + 4 * 16 + 16 * 16 + 16


def test_the_plan_puts_16_bit_linears_on_the_gemv_on_cuda_with_triton():
    from test_plan import H100, INTERPRETER, engine, qwen3

    from mili.runtime.plan import plan

    assert plan(engine(), qwen3(), H100).small_batch_gemv
    assert plan(engine(), qwen3("float16"), H100).small_batch_gemv
    assert not plan(engine(), qwen3("float32"), H100).small_batch_gemv  # (float32: cuBLAS's IEEE sums)
    assert not plan(engine(attention_backend="torch"), qwen3(), H100).small_batch_gemv
    assert not plan(engine(attention_backend="triton"), qwen3(), INTERPRETER).small_batch_gemv  # (CPU: tests only)


def test_greedy_decoding_with_the_gemv_linears(tiny_checkpoint):
    """The engine on the Triton path with every linear and the lm_head on SmallBatchLinear (decode batches of 2 rows
    on the GEMV, the prefill step's 14 rows on torch's linear), bf16: the greedy tokens of the same engine without."""
    from mili import LLM, SamplingParams
    from mili.model.gpu_linear import SmallBatchLinear, use_small_batch_gemv

    # (cpu_weight_prepack off: on a CPU where oneDNN's bf16 packing runs, the plan packs the linears, and none would
    # be a plain nn.Linear to swap)
    kw = dict(dtype="bfloat16", attention_backend="triton", enforce_eager=True, max_num_batched_tokens=24,
              kv_cache_memory=2**20, cpu_weight_prepack=False)
    prompts = [[5, 6, 7], [9] * 11]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def greedy(llm):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]

    plain = greedy(LLM(str(tiny_checkpoint), **kw))
    llm = LLM(str(tiny_checkpoint), **kw)
    model = llm.apply_model(lambda m: m)
    use_small_batch_gemv(model)
    swapped = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    assert len(swapped) == 2 * 4 + 1  # q|k|v, o, gate|up, down a layer, and the lm_head
    assert greedy(llm) == plain
    llm.engine.check_integrity()
