"""MILI's CPU kernels (mili/kernels/cpu) against the torch references, alone and inside the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili import LLM, SamplingParams
from mili.kernels import cpu, reference
from mili.kernels.cpu import ops
from mili.model.cpu_linear import KernelLinear, Int8Linear, PackedEmbedding, PackedLinear
from mili.runtime.plan import StepKind
from support.devices import kernel_isas
from support.engine_state import runner_parts

BF16 = torch.bfloat16
KERNEL_ISAS = kernel_isas()


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    """The kernels split their work over torch's thread count (OpenMP): two here, whatever the suite's default
    (tests/conftest.py gives each process one), so that the split is tested."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_every_isa_this_cpu_runs_loads_and_says_why_otherwise():
    """Each ISA path this machine runs builds, passes its check at load and is the layer it was built for; one it
    can't run says why by name; MILI_CPU_ISA's default choice is the best it runs."""
    runnable = cpu.runnable_isas()
    assert runnable[0] == "none" and cpu.best_isa() == runnable[-1]
    for name in cpu.ORDER[cpu.arch()]:
        lib, why = cpu.load(name)
        if name == "none":
            assert lib is None and why
        elif name in runnable:
            assert lib is not None, why
            assert lib.mili_isa().decode() == ("avx512" if name == "amx" else name)
        else:
            assert lib is None and "lacks" in why and cpu.runnable(name) in why
    if cpu.requested() is None:
        assert cpu.current() == cpu.best_isa()


needs_kernels = pytest.mark.skipif(not KERNEL_ISAS, reason=f"no ISA of MILI's kernels runs here: {cpu.load()[1]}")


@pytest.fixture(params=KERNEL_ISAS)
def isa(request, monkeypatch):
    """Every kernel path this machine can execute (AMX, AVX-512, AVX2 with and without VNNI, NEON...): a test
    taking it runs once per path, so the AVX2 kernels are tested on an AVX-512 machine too."""
    monkeypatch.setenv("MILI_CPU_ISA", request.param)  # (direct calls and the engines built here take it)
    assert cpu.isa() == request.param
    yield request.param


@needs_kernels
@pytest.mark.parametrize("m", [1, 5, 6, 7, 16, 17, 40, 100])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 96), (272, 1024)])
def test_linear_matches_torch(isa, m, n, k):
    torch.manual_seed(m * 7 + n)
    w, x = torch.randn(n, k).to(BF16), torch.randn(m, k).to(BF16)
    packed = ops.pack_weight(w)
    assert packed.shape == (-(-n // 16), k // 2, 16, 2)
    y = ops.linear(x, packed, n)
    ref = x.float() @ w.float().T
    assert y.shape == (m, n) and y.dtype == BF16
    # float32 accumulation, one bf16 rounding of the result
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())
    rows = torch.tensor([0, n - 1, n // 2, 3])
    assert torch.equal(ops.unpack_rows(packed, rows), w[rows])


@needs_kernels
def test_kernel_linear_module_with_bias_and_leading_dims(isa):
    torch.manual_seed(11)
    w, b = torch.randn(96, 64).to(BF16), torch.randn(96).to(BF16)
    x = torch.randn(2, 3, 64).to(BF16)
    out = KernelLinear(w, b)(x)
    assert out.shape == (2, 3, 96)
    torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 9, 70])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(isa, rows, with_residual):
    torch.manual_seed(rows)
    x, r = torch.randn(rows, 96).to(BF16), torch.randn(rows, 96).to(BF16)
    w = torch.rand(96).to(BF16) + 0.5
    got = ops.rms_norm(x, w, 1e-6, r if with_residual else None)
    want = reference.rms_norm(x, w, 1e-6, r if with_residual else None)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the residual sum, rounded the same way
        got, want = got[0], want[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@needs_kernels
@pytest.mark.parametrize("t", [1, 20])
def test_qk_norm_rope_in_place_on_fused_qkv(isa, t):
    torch.manual_seed(t)
    hq, hkv, d = 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(BF16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    qw, kw = torch.rand(d).to(BF16) + 0.5, torch.rand(d).to(BF16) + 0.5
    angles = torch.rand(t, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want_q, want_k = reference.qk_norm_rope(q.clone(), k.clone(), qw, kw, 1e-6, cos, sin)
    v_before = v.clone()
    got_q, got_k = ops.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    assert got_q.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(v, v_before)
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_k.float(), want_k.float(), rtol=2e-2, atol=2e-2)


@needs_kernels
def test_silu_and_mul(isa):
    torch.manual_seed(12)
    gate_up = (torch.randn(7, 2 * 160) * 3).to(BF16)
    torch.testing.assert_close(ops.silu_and_mul(gate_up).float(), reference.silu_and_mul(gate_up).float(),
                               rtol=1e-2, atol=1e-2)


@needs_kernels
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4), (8, 1), (8, 2), (10, 2), (6, 2)])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_attention_over_scattered_pages(isa, hq, hkv, d):
    """Every group size's code path (1, 2, 4, 8, and 5 and 3 through the generic one), both head sizes;
    the kernel's pages are head-major, the reference's token-major: the same pool in both layouts."""
    torch.manual_seed(hq * 10 + hkv)
    page_size, num_pages = 16, 40
    k_cache = torch.randn(num_pages, page_size, hkv, d).to(BF16)
    v_cache = torch.randn(num_pages, page_size, hkv, d).to(BF16)
    context_lens = [1, 17, 300]
    table = torch.zeros(3, 19, dtype=torch.long)
    perm = torch.randperm(num_pages).tolist()
    for b, ctx in enumerate(context_lens):
        n = -(-ctx // page_size)
        table[b, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    q = torch.randn(3, hq, d).to(BF16)
    head_major = [c.transpose(1, 2).contiguous() for c in (k_cache, v_cache)]
    got = ops.decode_attention(q, *head_major, table, context_lens, d ** -0.5)
    want = reference.paged_attention(q, k_cache, v_cache, table, [1, 1, 1], context_lens, d ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_kernels
def test_store_and_gather_head_major_pages(isa):
    """store_kv / gather_pages over head-major pages hold what the reference's token-major ones hold."""
    torch.manual_seed(0)
    pages, page_size, hkv, d = 6, 16, 2, 64
    k, v = torch.randn(40, hkv, d).to(BF16), torch.randn(40, hkv, d).to(BF16)
    slots = torch.randperm(pages * page_size)[:40]
    slots[5] = -1  # padding: skipped
    ref_k, ref_v = torch.zeros(pages, page_size, hkv, d, dtype=BF16), torch.zeros(pages, page_size, hkv, d, dtype=BF16)
    reference.store_kv(k, v, ref_k, ref_v, slots)
    got_k, got_v = torch.zeros(pages, hkv, page_size, d, dtype=BF16), torch.zeros(pages, hkv, page_size, d, dtype=BF16)
    ops.store_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k.transpose(1, 2), ref_k) and torch.equal(got_v.transpose(1, 2), ref_v)
    from mili.runtime.attention.torch_backend import gather_pages

    table = torch.tensor([[3, 0, 5], [1, 2, 4]])
    assert torch.equal(ops.gather_pages(got_k, table, 37), gather_pages(ref_k, table, 37))


@needs_kernels
@pytest.mark.parametrize("shape", ["gqa_untied", "mha_tied"])
def test_engine_with_cpu_kernels_tracks_torch_ops(isa, qwen3_checkpoint, shape):
    """bf16 with the kernels vs bf16 with torch ops and oneDNN: the same model up to rounding. The
    kernels' engine prefills in chunks of 16 (each chunk attends to the pages before it, gathered from
    the head-major pool) and decodes over those pages."""
    prompt = {"prompt_token_ids": list(range(5, 60))}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    fast = LLM(str(qwen3_checkpoint(shape)), dtype="bfloat16", max_num_batched_tokens=16)
    plain = LLM(str(qwen3_checkpoint(shape)), dtype="bfloat16", cpu_kernels=False)
    assert fast.engine.plan.cpu_kernels and not plain.engine.plan.cpu_kernels
    assert isinstance(fast.apply_model(lambda m: m.model.layers[0].mlp.down_proj), KernelLinear)
    # without the kernels: oneDNN's packing where it runs (held off below AVX-512, as on such a CPU), else aten's
    plain_down = plain.apply_model(lambda m: m.model.layers[0].mlp.down_proj)
    assert isinstance(plain_down, PackedLinear) == (not cpu.onednn_bf16())
    if shape == "mha_tied":  # the table is stored once, packed, in the head
        assert isinstance(fast.apply_model(lambda m: m.model.embed_tokens), PackedEmbedding)
    a, b = (llm.generate(prompt, params, use_tqdm=False)[0].outputs[0] for llm in (fast, plain))
    assert a.token_ids[:4] == b.token_ids[:4]  # random weights: bf16 roundings part paths later
    lp_a, lp_b = a.logprobs[0][a.token_ids[0]].logprob, b.logprobs[0][b.token_ids[0]].logprob
    assert abs(lp_a - lp_b) < 0.1
    fast.engine.check_integrity()


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 40])
def test_int8_kernel_close_to_weight_only_int8(isa, m):
    """The int8 kernel also quantizes the activations (one scale per row): it stays within ~1% of the
    weight-only int8 product."""
    torch.manual_seed(m)
    w, x = torch.randn(80, 128).to(BF16), torch.randn(m, 128).to(BF16)
    kernel, ref = Int8Linear(w, kernels=True), Int8Linear(w, kernels=False)
    assert kernel.kernel and kernel.qweight.shape == (5, 32, 16, 4)
    dequant = ref.qweight.float() * ref.scales.float()[:, None]
    want = x.float() @ dequant.T
    got = kernel(x).float()
    assert got.shape == (m, 80)
    assert (got - want).norm() / want.norm() < 0.01


@needs_kernels
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n,k", [(48, 64), (272, 1024)])
def test_int8_kernel_is_the_integer_product(isa, m, n, k):
    """W8A8 exactly: x quantized per row (round half to even), integer sums, times both scales, then one
    bf16 rounding; large |x| puts the AVX-512 path's unsigned-offset correction to work."""
    torch.manual_seed(m + n)
    w, x = torch.randn(n, k).to(BF16), (torch.randn(m, k) * 50).to(BF16)
    layer = Int8Linear(w, kernels=True)
    sx = x.float().abs().amax(dim=1) / 127
    xq = torch.round(x.float() * (1 / sx)[:, None])  # as the kernel: times the float32 reciprocal
    wq = ops.unpack_rows(layer.qweight, torch.arange(n)).float()
    want = (xq.double() @ wq.double().T) * sx[:, None].double() * layer.scales[:n].double()
    got = layer(x)
    torch.testing.assert_close(got.double(), want.to(BF16).double(), rtol=1e-2, atol=1e-6)
    assert torch.equal(layer.column_sums[:n], wq.sum(dim=1).to(torch.int32))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's SDPA as the reference: q [Lq, Hq, D] are the last Lq of the Lk positions of k, v [Lk, Hkv, D]."""
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)  # query j sits at lk - lq + j
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       enable_gqa=True)
    return o.transpose(0, 1)


@needs_kernels
@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 5), (37, 37), (100, 100), (20, 83), (16, 300)])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (8, 8, 32), (16, 8, 128), (10, 2, 64)])
def test_prefill_attention_causal_over_prefix(isa, lq, lk, hq, hkv, d):
    """A prefill chunk (the last lq of lk positions) against float32 SDPA; q/k/v are views of one fused
    qkv output, as the model passes them."""
    torch.manual_seed(lq * 1000 + lk + hq)
    qkv = torch.randn(lk, (hq + 2 * hkv) * d).to(BF16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q[lk - lq:].view(lq, hq, d), k.view(lk, hkv, d), v.view(lk, hkv, d)
    assert ops.prefill_attention_supported(q, k, v)
    got = ops.prefill_attention(q, k, v, d ** -0.5)
    want = causal_attention(q.float(), k.float(), v.float())
    # bf16 inputs, float32 scores, the softmax rounded to bf16 before P V, one bf16 rounding of the output
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def fused_checkpoints(qwen3_checkpoint, tmp_path_factory):
    """Untied GQA 2:1, and tied GQA 4:1 (the packed table is both embedding and head)."""
    from support.checkpoints import build_checkpoint

    tied = build_checkpoint(tmp_path_factory.mktemp("fused") / "tied", "mha_tied", hidden_size=128,
                            intermediate_size=192, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    return {"gqa_untied": qwen3_checkpoint("gqa_untied"), "gqa4_tied": tied}


def _fused_equals_eager(fused, eager, prompts, params, min_fused: int, lora_request=None) -> None:
    """``fused``'s outputs (its decode steps on the fused C layer) equal ``eager``'s: every sequence's tokens, and
    their logprobs exactly; at least ``min_fused`` decode steps ran fused."""
    runner = runner_parts(fused).cpu_decode
    fused_steps, run = [], runner.run
    runner.run = lambda *args: fused_steps.append(run(*args)) or fused_steps[-1]
    a, b = (llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request) for llm in (fused, eager))
    for x, y in zip(a, b):
        for ox, oy in zip(x.outputs, y.outputs):
            assert ox.token_ids == oy.token_ids
            assert [{t: lp.logprob for t, lp in d.items()} for d in ox.logprobs] == \
                   [{t: lp.logprob for t, lp in d.items()} for d in oy.logprobs]
    assert sum(h is not None for h in fused_steps) >= min_fused  # the decode steps did run fused
    fused.engine.check_integrity()


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("shape", ["gqa_untied", "gqa4_tied"])
def test_fused_decode_step_is_the_module_path_bit_for_bit(isa, fused_checkpoints, shape, quantization):
    """Decode steps as one C call per layer (CpuDecodeRunner) against the modules one by one
    (enforce_eager): the same kernels in the same order, so the same tokens and the same logprobs exactly,
    over batches of sequences with different lengths, an n > 1 fork and a stop mid-batch."""
    path = str(fused_checkpoints[shape])
    fused = LLM(path, dtype="bfloat16", quantization=quantization)
    eager = LLM(path, dtype="bfloat16", quantization=quantization, enforce_eager=True)
    runner = runner_parts(fused).cpu_decode
    assert runner is not None and fused.engine.plan.step is StepKind.CPU_DECODE
    assert eager.engine.plan.step is StepKind.EAGER
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=3) for m in (12, 5, 12, 9)]
    params[2] = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True, logprobs=3)
    _fused_equals_eager(fused, eager, [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 40, 90)], params,
                        min_fused=8)


@needs_kernels
def test_fused_decode_step_with_lora_adapters_is_the_module_path_bit_for_bit(isa, fused_checkpoints, tmp_path):
    """LoRA adapters on the fused decode layer (kernels.c's mili_lora_add inside each layer's call) against the
    modules one by one: two adapters (one on every projection, one on q, v and down at rank 8) and the base model in
    one batch, the same tokens and logprobs exactly; a batch with no adapter passes none."""
    from mili import LoRARequest
    from support.lora import build_adapter

    path = fused_checkpoints["gqa_untied"]
    build_adapter(path, tmp_path / "a", 1, std=0.05)
    build_adapter(path, tmp_path / "b", 2, rank=8, targets=("q_proj", "v_proj", "down_proj"), std=0.05)
    loras = [LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b")), None, None]
    kwargs = dict(dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=8)
    fused, eager = LLM(str(path), **kwargs), LLM(str(path), **kwargs, enforce_eager=True)
    assert fused.engine.plan.step is StepKind.CPU_DECODE and eager.engine.plan.step is StepKind.EAGER
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 40, 90)]
    _fused_equals_eager(fused, eager, prompts, params, min_fused=8, lora_request=loras)
    plain = fused.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain][:2] != [o.outputs[0].token_ids for o in fused.generate(
        prompts[:2], params, use_tqdm=False, lora_request=loras[:2])]  # (the adapters change the output)


def _int8g_of(w: torch.Tensor, group: int, symmetric: bool):
    """w [out, in] as int8g (u, scales, offsets): per group, s (u - 128) with s = amax / 127, or s u + min."""
    wg = w.float().view(w.shape[0], -1, group)
    if symmetric:
        s = wg.abs().amax(dim=2).clamp(min=1e-8) / 127
        return (torch.round(wg / s[..., None]) + 128).to(torch.uint8).view(w.shape), s, None
    lo = wg.amin(dim=2)
    s = ((wg.amax(dim=2) - lo) / 255).clamp(min=1e-8)
    return torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 255).to(torch.uint8).view(w.shape), s, lo


@needs_kernels
def test_fused_decode_step_takes_int8g_layers_bit_for_bit(isa, fused_checkpoints, monkeypatch):
    """A model whose decoder linears are Int8GroupLinear (as a GGUF model's Q8_0 / Q6_K / Q5_K layers will be:
    symmetric groups of 32 for qkv and gate_up, groups of 16 with offsets for o and down) keeps the fused decode
    step (one C call a layer, the LinearDesc's int8g flag), and it gives the module path's tokens and logprobs
    exactly."""
    from mili.model.cpu_linear import Int8GroupLinear
    from mili.runtime import model_builder

    swap = model_builder.apply_formats

    def int8g_then_swap(model, plan, quantized):
        for layer in model.model.layers:
            for parent, name, group, symmetric in ((layer.self_attn, "qkv_proj", 32, True),
                                                   (layer.self_attn, "o_proj", 16, False),
                                                   (layer.mlp, "gate_up_proj", 32, True),
                                                   (layer.mlp, "down_proj", 16, False)):
                linear = getattr(parent, name)
                setattr(parent, name, Int8GroupLinear(*_int8g_of(linear.weight.detach(), group, symmetric),
                                                      shard_sizes=getattr(linear, "shard_sizes", None)))
        swap(model, plan, quantized)  # (the rest: the lm_head on the bf16 kernel)

    monkeypatch.setattr(model_builder, "apply_formats", int8g_then_swap)
    path = str(fused_checkpoints["gqa_untied"])
    fused = LLM(path, dtype="bfloat16")
    eager = LLM(path, dtype="bfloat16", enforce_eager=True)
    runner = runner_parts(fused).cpu_decode
    assert runner is not None and runner.available and fused.engine.plan.step is StepKind.CPU_DECODE
    assert isinstance(fused.apply_model(lambda m: m.model.layers[0].mlp.down_proj), Int8GroupLinear)
    assert runner.layers[0].qkv.int8g == 1 and not runner.layers[0].qkv.aux and runner.layers[0].down.aux
    _fused_equals_eager(fused, eager, [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 40)],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3), min_fused=6)


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 151936])
def test_argmax_reads_bf16_rows_and_takes_the_first_of_ties(isa, n):
    torch.manual_seed(n)
    x = torch.randn(5, n + 3).to(BF16)[:, :n]  # rows at a stride, as the lm_head's padded output
    x[1, n // 2] = x[1, n - 1] = 100.0  # a tie: the first index wins, as torch's
    x[2] = -5.0  # all equal
    if n > 2:  # NaN counts as the largest, the first of them wins (torch's argmax)
        x[3, 1], x[3, n - 1] = float("nan"), float("nan")
    assert torch.equal(ops.argmax(x), x.float().argmax(dim=-1))


@needs_kernels
def test_sampler_takes_the_kernel_argmax_only_when_nothing_else_is_asked(isa):
    torch.manual_seed(13)
    from mili.runtime.sampler import Sampler, SamplingMetadata

    calls = []
    sampler = Sampler(lambda x: calls.append(x.dtype) or ops.argmax(x))
    logits = torch.randn(3, 300).to(BF16)

    def meta(params):
        return SamplingMetadata.build(params, [None] * 3, [[] for _ in range(3)], [[] for _ in range(3)], 290, "cpu")

    greedy = [SamplingParams(temperature=0)] * 3
    out = sampler(logits, meta(greedy))
    assert calls == [BF16] and out.token_ids == logits[:, :290].float().argmax(dim=-1).tolist()
    sampler(logits, meta([SamplingParams(temperature=0, logprobs=1)] * 3))  # logprobs need the float copy
    sampler(logits, meta([SamplingParams(temperature=0), SamplingParams(temperature=1, seed=1)] * 1 + greedy[:1]))
    assert calls == [BF16]


@needs_kernels
@pytest.mark.parametrize("vocab", [151936, 1000, 37])
def test_apply_bitmask_matches_xgrammar(isa, vocab):
    """The structured-output mask: -inf exactly where xgrammar's own apply puts it, rows not listed and
    columns past the vocabulary untouched; words of all ones, all zeros and mixed."""
    import xgrammar

    torch.manual_seed(0)
    rows, width = 6, (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, width), dtype=torch.int32)
    bitmask[1] = -1
    bitmask[2] = 0
    bitmask[3, : width // 2] = 0
    logits = torch.randn(rows, vocab + 40)
    picked = [0, 1, 2, 3, 5]
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=picked)
    got = logits.clone()
    ops.apply_bitmask(got, bitmask, picked, vocab)
    assert torch.equal(got, expected)
    assert torch.equal(got[4], logits[4]) and torch.equal(got[:, vocab:], logits[:, vocab:])
    assert torch.isinf(got[2, :vocab]).all() and torch.equal(got[1], logits[1])


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("n,k,group", [(48, 256, 128), (272, 1024, 64), (16, 128, 32), (32, 192, 24)])
def test_int4_kernel_is_the_integer_product(isa, m, n, k, group):
    """W4A8 exactly, for an AWQ layer (w = (q - z) s, as w = s q + b with b = -z s, float32): x quantized to int8
    per row and group (round half to even, times the float32 reciprocal), integer sums of x q and of x per group,
    times the scales and offsets, summed over groups in float32, one bf16 rounding."""
    from mili.model.cpu_linear import Int4Linear
    from mili.model.quant import Int4Parts

    torch.manual_seed(m + n + group)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8)
    scales = (torch.rand(n, k // group) * 0.02 + 1e-3).half()
    x = (torch.randn(m, k) * 30).to(BF16)
    layer = Int4Linear.from_awq(Int4Parts(q, zeros, scales))
    assert layer.scales.dtype == torch.float32  # -z s is not exact in fp16
    xg = x.float().view(m, k // group, group)
    sx = xg.abs().amax(dim=2) / 127
    xq = torch.round(xg * (1 / sx)[:, :, None])
    wq = (q.double() - zeros.double().repeat_interleave(group, 1)).view(n, k // group, group)
    sums = torch.einsum("mgk,ngk->mng", xq.double(), wq)  # exact integers
    want = (sums * sx[:, None, :].double() * scales.double()[None]).sum(dim=2)
    got = layer(x)
    assert got.shape == (m, n)
    torch.testing.assert_close(got.double(), want.to(BF16).double(), rtol=1e-2, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 17])
def test_int4_symmetric_is_the_integer_product(isa, m):
    """Without offsets (GGUF's Q4_0 as stored: w = d (q - 8)): the integer product of x quantized per row and group
    with q - 8, times d, within a bf16 rounding; the same as the offset form s q - 8 s; dequantize() is d (q - 8)."""
    from mili.model.cpu_linear import Int4Linear

    g = torch.Generator().manual_seed(40 + m)
    n, k, group = 48, 256, 32
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = ((torch.rand(n, k // group, generator=g) * 0.05 + 0.01) * torch.where(
        torch.rand(n, k // group, generator=g) < 0.3, -1.0, 1.0)).half().float()
    layer = Int4Linear(q, d, None)
    assert layer.offsets is None and layer.scales.dtype == torch.float16
    x = (torch.randn(m, k, generator=g) * 20).to(BF16)
    xg = x.float().view(m, k // group, group)
    sx = xg.abs().amax(dim=2) / 127
    xq = torch.round(xg * (1 / sx)[:, :, None])
    sums = torch.einsum("mgk,ngk->mng", xq.double(), (q.double() - 8).view(n, k // group, group))
    want = (sums * sx[:, None, :].double() * d.double()[None]).sum(dim=2)
    got = layer(x)
    torch.testing.assert_close(got.double(), want.to(BF16).double(), rtol=1e-2, atol=1e-6)
    offset_form = Int4Linear(q, d, -8 * d)
    torch.testing.assert_close(got.float(), offset_form(x).float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(layer.dequantize(), d.repeat_interleave(group, 1) * (q.float() - 8))


@needs_kernels
@pytest.mark.parametrize("m", [1, 3])
def test_int4_scale_and_offset_blocks_map_exactly(isa, m):
    """GGUF's int4 blocks as w = s q + b: Q4_0 (d (q - 8): s = d, b = -8 d, kept in fp16 since exact there) and
    Q4_K's sub-blocks (d sc q - dmin m: s = d sc, b = -dmin m, float32): the kernel's product is the product
    with the dequantized weights, to the int8 quantization of x."""
    from mili.model.cpu_linear import Int4Linear

    g = torch.Generator().manual_seed(m)
    n, k = 64, 256
    x = torch.randn(m, k, generator=g).to(BF16)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.05 + 0.01).half().float()  # Q4_0: fp16 d per 32
    q4_0 = Int4Linear(q, d, -8 * d)
    sc, mins = torch.randint(0, 64, (2, n, k // 32), generator=g).float()  # Q4_K: 6-bit scales and mins
    dd, dmin = (torch.rand(2, n, 1, generator=g) * 0.01).half().float()
    q4_k = Int4Linear(q, dd * sc, -dmin * mins)
    assert q4_0.scales.dtype == torch.float16 and q4_k.scales.dtype == torch.float32
    for layer, s, b in ((q4_0, d, -8 * d), (q4_k, dd * sc, -dmin * mins)):
        dense = q.float() * s.repeat_interleave(32, 1) + b.repeat_interleave(32, 1)
        want = x.float() @ dense.T
        got = layer(x).float()
        assert (got - want).norm() / want.norm() < 0.01


def int8g_reference(x: torch.Tensor, u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                    signed: bool = False) -> torch.Tensor:
    """What the int8g kernel computes before its bf16 rounding (kernels.c), in float64: x quantized to int8 per row and
    group (round half to even, times the float32 reciprocal), exact integer sums per group, then sx (s S_u + b xsum),
    or without offsets sx s (S_u - 128 xsum); ``signed`` with offsets: sx (s (S_u - 128 xsum) + b xsum)."""
    m, k = x.shape
    n, groups = scales.shape
    group = k // groups
    xg = x.float().view(m, groups, group)
    sx = xg.abs().amax(dim=2) / 127
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(xg * (1 / sx)[:, :, None]).double()
    sums = torch.einsum("mgk,ngk->mng", xq, u.double().view(n, groups, group))  # exact integers
    xsum = xq.sum(dim=2)[:, None, :]
    if offsets is None:
        terms = (sums - 128 * xsum) * scales.double()[None]
    elif signed:
        terms = (sums - 128 * xsum) * scales.double()[None] + offsets.double()[None] * xsum
    else:
        terms = sums * scales.double()[None] + offsets.double()[None] * xsum
    return (terms * sx.double()[:, None, :]).sum(dim=2)


def assert_within_a_bf16_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (bf16) is want rounded to bf16, to float32's error in the sums: at most one bf16 ulp off."""
    err = (got.double() - want).abs()
    bound = want.abs() * 2.0 ** -8 + 1e-6 * want.abs().max()
    assert (err <= bound).all(), f"{(err > bound).sum().item()} values off, worst {(err / bound).max().item():.3g} x bound"


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 17, 64])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int8g_kernel_is_the_integer_product(isa, m, group, symmetric):
    """8-bit weights per group (u 0..255, w = s u + b, or s (u - 128) without offsets) against the exact integer
    product of x quantized per row and group, within one bf16 ulp; large |x| and u at both ends of 0..255 (the AVX2
    layer's |v| x sign(x, v) at v = -128)."""
    from mili.model.cpu_linear import Int8GroupLinear

    g = torch.Generator().manual_seed(m * 100 + group + symmetric)
    n, k = 80, 512
    u = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    u[:, :group] = 0
    u[:, group:2 * group] = 255
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3) * torch.where(
        torch.rand(n, k // group, generator=g) < 0.2, -1.0, 1.0)
    offsets = None if symmetric else -scales * torch.randint(90, 160, scales.shape, generator=g)
    layer = Int8GroupLinear(u, scales, offsets)
    assert layer.qweight.shape == (n // 16, k // 4, 16, 4) and (layer.offsets is None) == symmetric
    x = (torch.randn(m, k, generator=g) * 30).to(BF16)
    x[0, 5] = 400.0  # an outlier: most of its group's q near 0
    got = layer(x)
    assert got.shape == (m, n) and got.dtype == BF16
    want = int8g_reference(x, u, ops.unblock(layer.scales).float(),
                           None if symmetric else ops.unblock(layer.offsets).float())
    assert_within_a_bf16_ulp(got, want)
    # a row's bits do not depend on the rows beside it (the fused decode's verification rows: cpu_decode.py)
    assert torch.equal(layer(x[m - 1:]), got[m - 1:])


@needs_kernels
@pytest.mark.parametrize("n,k,group", [(16, 64, 8), (48, 96, 24), (32, 1024, 128)])
def test_int8g_kernel_other_groups_and_fp16_scales(isa, n, k, group):
    """Any group of 8 k steps the kernel takes; fp16 scales and offsets where those are exact (kept in fp16: half
    the bytes), with a bias."""
    from mili.model.cpu_linear import Int8GroupLinear

    g = torch.Generator().manual_seed(n + k + group)
    u = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half().float()
    offsets = (-scales * torch.randint(100, 150, scales.shape, generator=g)).half().float()
    bias = torch.randn(n, generator=g).to(BF16)
    layer = Int8GroupLinear(u, scales, offsets, bias)
    assert layer.scales.dtype == layer.offsets.dtype == torch.float16
    x = torch.randn(3, k, generator=g).to(BF16)
    want = int8g_reference(x, u, scales, offsets)
    torch.testing.assert_close(layer(x).float(), (want.to(BF16) + bias).float(), rtol=2e-2, atol=2e-2)
    assert_within_a_bf16_ulp(ops.linear_int8g(x, layer.qweight, layer.scales, layer.offsets), want)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int8g_kernel_signed_with_offsets(isa, m):
    """w = s (u - 128) + b: one fused layer holding parts of both forms (GGUF's Q4_K_M q and k beside a Q6_K v), each
    part exact: the symmetric rows' b is 0, the offset rows' u is q + 128. The integer product within a bf16 ulp,
    the same through the fused decode layer's dispatch flag (int8g 2), and dequantize() the parts' weights."""
    from mili.model.cpu_linear import Int8GroupLinear

    g = torch.Generator().manual_seed(7 + m)
    n, k, group = 48, 256, 16
    q = torch.cat([torch.randint(-32, 32, (32, k), generator=g), torch.randint(0, 16, (16, k), generator=g)])
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    offsets = torch.cat([torch.zeros(32, k // group), -torch.rand(16, k // group, generator=g) * 0.1])
    u = (q + 128).to(torch.uint8)
    layer = Int8GroupLinear(u, scales, offsets, signed=True)
    x = (torch.randn(m, k, generator=g) * 10).to(BF16)
    want = int8g_reference(x, u, ops.unblock(layer.scales).float(), ops.unblock(layer.offsets).float(), signed=True)
    assert_within_a_bf16_ulp(layer(x), want)
    weights = scales.repeat_interleave(group, 1) * q.float() + offsets.repeat_interleave(group, 1)
    assert torch.equal(layer.dequantize(), weights)


def test_int8g_supported_shapes():
    """The kernel takes N % 16 == 0 and K in whole groups of a multiple of 8; the rest is refused. The layer pads its
    rows to 16 and raises on other groups."""
    assert ops.int8g_supported(48, 256, 16) and ops.int8g_supported(16, 64, 32) and ops.int8g_supported(32, 96, 24)
    assert not ops.int8g_supported(40, 256, 32)  # N not a multiple of 16
    assert not ops.int8g_supported(48, 250, 32)  # K not in whole groups
    assert not ops.int8g_supported(48, 240, 12)  # a group not a multiple of 8
    assert not ops.int8g_supported(48, 256, 0)
    from mili.model.cpu_linear import Int8GroupLinear

    u = torch.zeros(40, 240, dtype=torch.uint8)
    assert Int8GroupLinear(u, torch.ones(40, 10)).qweight.shape == (3, 60, 16, 4)  # (rows padded to 48)
    for groups in (20, 7):  # groups of 12; of 240 / 7
        with pytest.raises(ValueError, match="multiple of 8"):
            Int8GroupLinear(u, torch.ones(40, groups))


def _gguf_blocks(kind: str, rows: int, cols: int, g: torch.Generator):
    """Random valid GGUF blocks of ``kind`` for a [rows, cols] tensor (raw bytes, as a file holds them) and their
    int8g form (u, scales, offsets or None), unpacked with gguf's own bit layout: q read back through
    gguf.quants.dequantize of the blocks with every scale set to 1 and every min to 0."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    qtype = getattr(T, kind)
    block, size = quants.GGML_QUANT_SIZES[qtype]
    nb = rows * cols // block
    raw = torch.randint(0, 256, (nb, size), generator=g, dtype=torch.uint8).numpy()

    def fp16(shape, lo, hi):  # d and dmin: either sign, in fp16's normal range
        v = (torch.rand(shape, generator=g) * (hi - lo) + lo) * torch.where(torch.rand(shape, generator=g) < 0.5, -1, 1)
        return v.half().numpy()

    def q_of(blocks):  # q as dequantize gives it with unit scales: [rows, cols] float32
        return quants.dequantize(blocks.reshape(-1), qtype).reshape(rows, cols)

    if kind == "Q8_0":  # d (fp16), 32 int8
        raw[:, :2] = fp16(nb, 1e-3, 2e-2).view(np.uint8).reshape(nb, 2)
        raw[0, 2:6] = np.array([0x80, 0x7F, 0, 0xFF], dtype=np.uint8)  # -128, 127, 0, -1
        unit = raw.copy()
        unit[:, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
        u = q_of(unit) + 128
        scales, offsets = raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1), None
    elif kind == "Q6_K":  # ql 128, qh 64, 16 int8 scales, d (fp16)
        raw[:, 208:] = fp16(nb, 1e-4, 2e-3).view(np.uint8).reshape(nb, 2)
        unit = raw.copy()
        unit[:, 192:208] = 1
        unit[:, 208:] = np.array([1.0], dtype=np.float16).view(np.uint8)
        u = q_of(unit) + 128  # (q - 32) + 128
        d = raw[:, 208:].copy().view(np.float16).astype(np.float32)
        scales, offsets = (d * raw[:, 192:208].view(np.int8).astype(np.float32)).reshape(rows, -1), None
    else:  # Q5_K: d, dmin (fp16), 12 bytes of 6-bit scales and mins, qh 32, qs 128
        raw[:, :2] = fp16(nb, 1e-4, 2e-3).view(np.uint8).reshape(nb, 2)
        raw[:, 2:4] = fp16(nb, 1e-4, 2e-3).view(np.uint8).reshape(nb, 2)
        sc, mins = quants.Q4_K.get_scale_min(raw[:, 4:16].copy())
        unit = raw.copy()
        unit[:, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
        unit[:, 2:4] = 0
        unit[:, 4:16] = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)  # every sc 1, every min 0
        u = q_of(unit)
        d, dmin = (raw[:, i:i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
        scales = (d * sc.astype(np.float32)).reshape(rows, -1)
        offsets = -(dmin * mins.astype(np.float32)).reshape(rows, -1)
    want = torch.from_numpy(quants.dequantize(raw.reshape(-1), qtype).reshape(rows, cols))
    u = torch.from_numpy(u)
    assert u.min() >= 0 and u.max() <= 255 and torch.equal(u, u.round())
    return (u.to(torch.uint8), torch.from_numpy(scales), None if offsets is None else torch.from_numpy(offsets),
            want)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q5_K"])
def test_int8g_gguf_blocks_map_exactly(isa, kind):
    """GGUF's 8-bit-able blocks on the int8g kernel (issue 45): Q8_0 (d q: s = d, u = q + 128, no offsets), Q6_K
    (d sc (q - 32): s = d sc, u = q + 96, no offsets) and Q5_K (d sc q - dmin m: s = d sc, u = q, b = -dmin m). The
    layer's dequantize() is gguf.quants.dequantize of the same blocks bit for bit (float32), and the kernel's
    product is the integer product over exactly those weights (x quantized per group)."""
    pytest.importorskip("gguf")
    from mili.model.cpu_linear import Int8GroupLinear

    g = torch.Generator().manual_seed(len(kind))
    rows, cols = 48, 512
    u, scales, offsets, want = _gguf_blocks(kind, rows, cols, g)
    layer = Int8GroupLinear(u, scales, offsets)
    assert layer.group == {"Q8_0": 32, "Q6_K": 16, "Q5_K": 32}[kind]
    assert layer.scales.dtype == (torch.float16 if kind == "Q8_0" else torch.float32)  # (d sc: not exact in fp16)
    dense = layer.dequantize()
    assert dense.dtype == torch.float32 and torch.equal(dense.view(torch.int32), want.view(torch.int32))
    x = (torch.randn(5, cols, generator=g) * 4).to(BF16)
    assert_within_a_bf16_ulp(layer(x), int8g_reference(x, u, scales, offsets))


def test_int4_dequantize_is_scale_times_q_plus_offset():
    """Int4Linear.dequantize(): the packed nibbles, scales and offsets back, s q + b in float32 (Q4_0's d (q - 8)
    and Q4_K's d sc q - dmin m equal gguf's dequantize as values: each product is exact)."""
    from mili.model.cpu_linear import Int4Linear

    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (40, 128), generator=g, dtype=torch.uint8)
    s, b = torch.rand(40, 4, generator=g) * 0.01, torch.randn(40, 4, generator=g) * 0.05
    dense = Int4Linear(q, s, b).dequantize()
    assert dense.shape == (40, 128) and dense.dtype == torch.float32
    assert torch.equal(dense, q.float() * s.repeat_interleave(32, 1) + b.repeat_interleave(32, 1))


def _k_quant_parts(kind: str, rows: int, cols: int, seed: int):
    """Random valid blocks of a K-quant (``kind``, or "Q4_K+Q6_K": a fused layer's Q4_K rows beside Q6_K rows, as
    Q4_K_M's q|k|v) as the loader keeps them (``gguf_blocks.group_parts``: two-level scales and offsets), with
    gguf.quants.dequantize of the same blocks. The super-block scales d (and dmin) take either sign, and some are
    fp16 subnormals, as a real file's small ones are."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from mili.model.gguf_blocks import group_parts
    from mili.model.quant import concat_parts

    if "+" in kind:
        first, second = kind.split("+")
        a, wa = _k_quant_parts(first, rows // 2, cols, seed)
        b, wb = _k_quant_parts(second, rows - rows // 2, cols, seed + 1)
        return concat_parts([a, b]), torch.cat([wa, wb])
    rng = np.random.default_rng(seed)
    qtype = getattr(T, kind)
    block, size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in ((size - 2,) if kind == "Q6_K" else (0, 2)):  # Q6_K's d last; Q4_K's and Q5_K's d, dmin first
        d = rng.uniform(2e-5, 1e-3, len(raw)) * rng.choice([-1, 1], len(raw))
        d[::7] = rng.uniform(1e-7, 6e-5, len(d[::7]))  # fp16 subnormals
        raw[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    want = quants.dequantize(raw.reshape(-1), qtype).reshape(rows, cols)
    return group_parts(raw, kind, (rows, cols)), torch.from_numpy(np.array(want, dtype=np.float32))


@needs_kernels
@pytest.mark.parametrize("kind,layer_type", [("Q4_K", "Int4Linear"), ("Q5_K", "Int4Linear"),
                                             ("Q6_K", "Int4Linear"), ("Q4_K+Q6_K", "Int8GroupLinear")])
def test_k_quants_keep_their_two_level_scales(isa, kind, layer_type):
    """GGUF's K-quants on the kernels with their scales as the file stores them (kernels.c, SCALES_K): fp16 d (and
    -dmin) per super-block of 256, an int8 sc (and m) per group, packed as uint8 and formed in the kernel. The
    layer (as the model builder makes it from the loader's parts) dequantizes to gguf.quants.dequantize bit for
    bit; its product is the integer product over those weights within a bf16 ulp (x quantized per group), and
    the same bits as the layer given the float32 values d sc and -dmin m; its scales take 1 + 2 / sub bytes a
    group, not 4 (Q4_K: ~0.58 bytes a weight in all)."""
    pytest.importorskip("gguf")
    from mili.model.cpu_linear import Int4Linear, Int8GroupLinear
    from mili.model.formats.kernel import quantized_cpu_layer

    rows, cols = 48, 1024
    parts, want = _k_quant_parts(kind, rows, cols, seed=len(kind))
    layer = quantized_cpu_layer(parts, None, None)
    assert type(layer).__name__ == layer_type
    assert layer.scales.dtype == torch.uint8 and ops.scale_form(layer.scales)[0] == ops.SCALES_K
    assert (layer.offsets is None) == (kind == "Q6_K") and getattr(layer, "signed", False) == ("+" in kind)
    dense = layer.dequantize()
    assert torch.equal(dense.view(torch.int32), want.view(torch.int32))  # (bits: zeros' signs too)
    group = cols // parts.scales.shape[1]
    sub = 256 // group
    scale_bytes = sum(t.numel() for t in (layer.scales, layer.offsets) if t is not None)
    assert scale_bytes == (1 if layer.offsets is None else 2) * rows * cols // group * (1 + 2 / sub)
    # the one-level float32 layer of the same values: the same bits out of the kernel
    offsets = None if layer.offsets is None else parts.offsets
    if layer_type == "Int4Linear":  # (Q5_K and Q6_K with their bits above the nibble: high_bits 1, 2)
        assert layer.high_bits == {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}[kind]
        q = ops.unpack_int4(layer.qweight, layer.high_bits)[:rows]
        f32 = Int4Linear(q, parts.scales, offsets, high_bits=layer.high_bits)
        u = q + (128 - 32) if offsets is None else q  # (the int8g reference's form: s (u - 128) or s u + b)
    else:
        u = ops.unpack_rows(layer.qweight, torch.arange(rows))
        f32 = Int8GroupLinear(u, parts.scales, offsets, signed=layer.signed)
    assert f32.scales.dtype == torch.float32
    g = torch.Generator().manual_seed(3)
    for m in (1, 2, 5, 17):
        x = (torch.randn(m, cols, generator=g) * 3).to(BF16)
        got = layer(x)
        assert torch.equal(got, f32(x))
        offsets = None if layer.offsets is None else ops.group_values(layer.offsets)[:rows]
        assert_within_a_bf16_ulp(got, int8g_reference(x, u, ops.group_values(layer.scales)[:rows], offsets,
                                                      signed=getattr(layer, "signed", False)))


@needs_kernels
@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
def test_int4_high_bits_read_q6_k_and_q5_k_at_their_bytes(isa, kind):
    """GGUF's Q6_K and Q5_K on the int4 kernel with their bits above the nibble (issue 45): the layer the model builder
    makes from the loader's parts is an Int4Linear with high_bits 2 (Q6_K: w = d sc (q - 32), no offsets) or 1 (Q5_K),
    about the file's bytes a weight (0.82, 0.70; int8g took 1.07); its dequantize() is gguf.quants.dequantize bit for
    bit, and its outputs are the int8g layer's (the path these blocks took before) bit for bit at every row count:
    one row, the direct kernel's pairs of rows, and many rows (expanded to int8g's layout per thread), rows 8 and 9
    either side of the switch."""
    pytest.importorskip("gguf")
    from mili.model.cpu_linear import Int4Linear, Int8GroupLinear
    from mili.model.formats.kernel import quantized_cpu_layer

    rows, cols = 80, 1024
    parts, want = _k_quant_parts(kind, rows, cols, seed=11)
    layer = quantized_cpu_layer(parts, None, None)
    assert isinstance(layer, Int4Linear) and layer.high_bits == {"Q6_K": 2, "Q5_K": 1}[kind]
    assert (layer.offsets is None) == (kind == "Q6_K")
    stored = sum(t.numel() for t in (layer.qweight, layer.scales, layer.offsets) if t is not None)
    assert stored / (rows * cols) == pytest.approx({"Q6_K": 0.8203, "Q5_K": 0.7031}[kind], abs=1e-3)
    assert torch.equal(layer.dequantize().view(torch.int32), want.view(torch.int32))
    if kind == "Q6_K":
        before = Int8GroupLinear((parts.q.to(torch.int16) + 128).to(torch.uint8), parts.scales_k, None)
    else:
        before = Int8GroupLinear(parts.q.to(torch.uint8), parts.scales_k, parts.offsets_k)
    g = torch.Generator().manual_seed(5)
    for m in (1, 2, 3, 8, 9, 17, 64):
        x = (torch.randn(m, cols, generator=g) * 3).to(BF16)
        x[0, 7] = 300.0  # (an outlier: most of its group's q near 0)
        assert torch.equal(layer(x), before(x)), m


@needs_kernels
@pytest.mark.parametrize("high_bits,symmetric", [(1, False), (2, True), (2, False), (1, True)])
def test_int4_high_bits_extreme_values(isa, high_bits, symmetric):
    """Every q at its largest (31, 63) and x at +-its scale (quantized to +-127): the AVX2 layer's int16 running sums at
    their bound (vpmaddubsw pairs of 63 x 127, flushed every I4_STEPS >> high_bits steps), against the exact integer
    product; the packed bits unpack to q, and float scales (not two-level) take the same path."""
    from mili.model.cpu_linear import Int4Linear

    g = torch.Generator().manual_seed(high_bits * 2 + symmetric)
    n, k, group = 48, 512, 32
    top = (16 << high_bits) - 1
    q = torch.randint(0, top + 1, (n, k), generator=g, dtype=torch.uint8)
    q[:16] = top
    q[16:20, ::3] = 0
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    offsets = None if symmetric else -scales * torch.randint(0, top, scales.shape, generator=g)
    layer = Int4Linear(q, scales, offsets, high_bits=high_bits)
    assert layer.qweight.shape == (n // 16, k // 8 + k * high_bits // 32, 64)
    assert torch.equal(ops.unpack_int4(layer.qweight, high_bits), q)
    u = q.to(torch.int16) + 128 - (8 << high_bits) if symmetric else q
    for m in (1, 2, 5, 12):
        x = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0).to(BF16)
        x[-1] = 1.0
        want = int8g_reference(x, u, ops.unblock(layer.scales).float(),
                               None if symmetric else ops.unblock(layer.offsets).float())
        assert_within_a_bf16_ulp(layer(x), want)


@needs_kernels
def test_fused_layer_of_mixed_types_splits_into_kernel_forms(isa):
    """A fused layer whose shards are of different GGUF types (Q4_K_M's Q4_K q and k beside a Q6_K v) becomes a
    SplitLinear of one layer per run of one form (q|k on the int4 kernel, v on it with two high bits), each at its
    file's bytes, writing its columns of the one output: dequantize() is gguf's dequantize of every shard bit for bit,
    the outputs are the parts' own side by side (bit for bit), and the fused decode step's chain of descriptions
    covers all of its rows."""
    pytest.importorskip("gguf")
    from mili.model.cpu_linear import Int4Linear, SplitLinear
    # reach-in: the fused decode step's C descriptor of a layer (its ABI, a chain of parts) has no entry point of its own
    from mili.runtime.cpu_decode import _linear_desc, _rows
    from mili.model.formats.kernel import split_cpu_layer

    shards, wants = zip(*(_k_quant_parts(kind, rows, 512, seed=i) for i, (kind, rows) in
                          enumerate((("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)))))
    layer = split_cpu_layer(list(shards), None, [64, 32, 32])
    assert isinstance(layer, SplitLinear) and [type(p) for p in layer.parts] == [Int4Linear, Int4Linear]
    assert [(p.out_features, p.high_bits, p.offsets is None) for p in layer.parts] == [(96, 0, False), (32, 2, True)]
    assert torch.equal(layer.dequantize().view(torch.int32), torch.cat(wants).view(torch.int32))
    assert split_cpu_layer([shards[0], shards[1]], None, [64, 32]) is None  # (one form: joined, as before)
    g = torch.Generator().manual_seed(2)
    for m in (1, 3, 17):
        x = (torch.randn(m, 512, generator=g) * 2).to(BF16)
        assert torch.equal(layer(x), torch.cat([p(x) for p in layer.parts], dim=1))
    desc = _linear_desc(layer)
    assert _rows(desc) == 128 and desc.n == 96 and desc.next.contents.high_bits == 2 and not desc.next.contents.next


def _int4_of(w: torch.Tensor, group: int, high_bits: int, symmetric: bool):
    """w [out, in] as int4 with high bits (q, scales, offsets): per group, s (q - 8 << high_bits), or s q + min."""
    wg = w.float().view(w.shape[0], -1, group)
    top, zero = (16 << high_bits) - 1, 8 << high_bits
    if symmetric:
        s = wg.abs().amax(dim=2).clamp(min=1e-8) / (zero - 1)
        return (torch.round(wg / s[..., None]) + zero).clamp(0, top).to(torch.uint8).view(w.shape), s, None
    lo = wg.amin(dim=2)
    s = ((wg.amax(dim=2) - lo) / top).clamp(min=1e-8)
    return torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, top).to(torch.uint8).view(w.shape), s, lo


@needs_kernels
def test_fused_decode_step_takes_high_bit_and_split_layers_bit_for_bit(isa, fused_checkpoints, monkeypatch):
    """A model whose decoder linears are int4 with high bits (GGUF's Q6_K, Q5_K as the kernels now read them) and whose
    fused q|k|v is split by form (Q4_K_M's q, k beside a Q6_K v: SplitLinear) keeps the fused decode step (the
    LinearDesc's high_bits, and its chain of parts), and gives the module path's tokens and logprobs exactly."""
    from mili.model.cpu_linear import Int4Linear, SplitLinear
    from mili.runtime import model_builder

    swap = model_builder.apply_formats

    def int4_then_swap(model, plan, quantized):
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            w, sizes = attn.qkv_proj.weight.detach(), attn.qkv_proj.shard_sizes
            qk = sum(sizes[:2])
            attn.qkv_proj = SplitLinear([Int4Linear(*_int4_of(w[:qk], 32, 0, False)),
                                         Int4Linear(*_int4_of(w[qk:], 16, 2, True), high_bits=2)],
                                        shard_sizes=sizes)
            attn.o_proj = Int4Linear(*_int4_of(attn.o_proj.weight.detach(), 32, 1, False), high_bits=1)
            mlp.gate_up_proj = Int4Linear(*_int4_of(mlp.gate_up_proj.weight.detach(), 16, 2, True),
                                          shard_sizes=mlp.gate_up_proj.shard_sizes, high_bits=2)
            mlp.down_proj = Int4Linear(*_int4_of(mlp.down_proj.weight.detach(), 32, 1, False), high_bits=1)
        swap(model, plan, quantized)  # (the rest: the lm_head on the bf16 kernel)

    monkeypatch.setattr(model_builder, "apply_formats", int4_then_swap)
    path = str(fused_checkpoints["gqa_untied"])
    fused = LLM(path, dtype="bfloat16")
    eager = LLM(path, dtype="bfloat16", enforce_eager=True)
    runner = runner_parts(fused).cpu_decode
    assert runner is not None and runner.available and fused.engine.plan.step is StepKind.CPU_DECODE
    first = runner.layers[0]
    assert first.qkv.high_bits == 0 and first.qkv.next.contents.high_bits == 2 and first.down.high_bits == 1
    _fused_equals_eager(fused, eager, [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 40)],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3), min_fused=6)


@needs_kernels
def test_int4_symmetric_takes_two_level_scales(isa):
    """The one kernel form no GGUF type gives (the int4 kernel without offsets, w = s (q - 8), with two-level scales)
    is the float32 form's bits too."""
    from mili.model.cpu_linear import Int4Linear
    from mili.model.quant import TwoLevel

    g = torch.Generator().manual_seed(9)
    q = torch.randint(0, 16, (32, 512), generator=g, dtype=torch.uint8)
    levels = TwoLevel((torch.randn(32, 2, generator=g) * 1e-3).half().float(),
                      torch.randint(-64, 64, (32, 16), generator=g, dtype=torch.int8))
    two, f32 = Int4Linear(q, levels, None), Int4Linear(q, levels.values(), None)
    assert two.scales.dtype == torch.uint8 and f32.scales.dtype == torch.float32
    assert torch.equal(two.dequantize(), f32.dequantize())
    for m in (1, 3):
        x = (torch.randn(m, 512, generator=g) * 4).to(BF16)
        assert torch.equal(two(x), f32(x))


def test_two_level_scales_pack_and_unpack():
    """ops.pack_scales of two levels (d [N, S] fp16 values, sc [N, G] int8): per block of 16 rows and super-block,
    the rows' d as fp16 then each group's 16 sc; group_values gives d sc back (float32, exact); scale_form reads the
    mode, the groups a super-block and the groups from the shape. d not held by fp16 is refused."""
    g = torch.Generator().manual_seed(0)
    d = (torch.randn(32, 3, generator=g) * 1e-3).half().float()
    sc = torch.randint(-128, 128, (32, 12), generator=g, dtype=torch.int8)
    packed = ops.pack_scales((d, sc))
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 32 + 16 * 4)
    assert ops.scale_form(packed) == (ops.SCALES_K, 4, 12)
    assert torch.equal(packed[1, 2, :32].contiguous().view(torch.float16).float(), d[16:, 2])
    assert torch.equal(packed[1, 2, 32 + 16:64].contiguous().view(torch.int8), sc[16:, 9])
    assert torch.equal(ops.group_values(packed), d.repeat_interleave(4, 1) * sc.float())
    with pytest.raises(AssertionError, match="fp16"):
        ops.pack_scales((d + 1e-9, sc))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("hk,hv,dk,dv,k", [(2, 4, 16, 16, 4), (1, 3, 128, 128, 4), (2, 2, 64, 32, 2)])
def test_gdn_decode_is_the_torch_step(isa, dtype, hk, hv, dk, dv, k):
    """The Gated DeltaNet decode step in one call (conv, gates, L2 norms, delta rule) against the torch
    reference the model runs without the kernels: on scattered slots, a fresh sequence starting from zeros
    whatever its slot held, and the other slots untouched. float32 to rounding; bf16 (the conv and SiLU
    rounded to bf16 as torch does, the state float32) to bf16's precision."""
    from mili.kernels import gated_delta as gd

    g = torch.Generator().manual_seed(hk * 100 + dk)
    b, rows, c = 3, 7, 2 * hk * dk + hv * dv
    qkv, ba = torch.randn(b, c, generator=g).to(dtype), torch.randn(b, 2 * hv, generator=g).to(dtype)
    conv = torch.randn(rows, c, k - 1, generator=g).to(dtype)
    ssm = torch.randn(rows, hv, dk, dv, generator=g)
    weight, a_log, dt = torch.randn(c, k, generator=g).to(dtype), torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    slots, fresh = torch.tensor([5, 1, 2]), torch.tensor([False, True, False])
    keep = ~fresh
    x, conv_want = gd.causal_conv1d_step(qkv, torch.where(keep[:, None, None], conv[slots], 0), weight)
    q, kk, v = x.split([hk * dk, hk * dk, hv * dv], -1)
    beta, gate = ba[:, :hv].sigmoid(), -a_log.exp() * F.softplus(ba[:, hv:].float() + dt)
    want, ssm_want = gd.recurrent_gated_delta_step(q.reshape(b, hk, dk), kk.reshape(b, hk, dk), v.reshape(b, hv, dv),
                                                   gate, beta, torch.where(keep[:, None, None, None], ssm[slots], 0))
    conv_got, ssm_got = conv.clone(), ssm.clone()
    got = ops.gdn_decode(qkv, ba, conv_got, ssm_got, slots, fresh, weight.float(), a_log, dt, hk, dk, dv)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(ssm_got[slots], ssm_want, **tol)
    assert torch.equal(conv_got[slots], conv_want.to(dtype))  # the state shifts exactly (stored inputs)
    others = [r for r in range(rows) if r not in slots.tolist()]
    assert torch.equal(conv_got[others], conv[others]) and torch.equal(ssm_got[others], ssm[others])


@needs_kernels
def test_hybrid_engine_decodes_in_the_kernel(isa, hybrid_checkpoint, monkeypatch):
    """A Qwen3.5 checkpoint's decode steps go through mili_gdn_decode (counted) and give the torch path's
    greedy tokens in float32, logprobs within 1e-4; in bf16 its linears are MILI's packed kernels."""
    path = hybrid_checkpoint("qwen3_5")
    calls = []
    real = ops.gdn_decode
    monkeypatch.setattr(ops, "gdn_decode", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    fast = LLM(str(path), dtype="float32", max_num_batched_tokens=32)
    plain = LLM(str(path), dtype="float32", cpu_kernels=False)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (fast, plain))
    assert calls and max(calls) == len(prompts)  # batched decodes, every sequence in one call
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids):
            assert abs(lx[t].logprob - ly[t].logprob) < 1e-4
    fast.engine.check_integrity()
    bf16 = LLM(str(path), dtype="bfloat16")
    layer = bf16.apply_model(lambda m: m.model.layers[0])
    assert layer.linear_attn.fused_decode is not None and isinstance(layer.mlp.down_proj, KernelLinear)
    out = bf16.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in out)
    bf16.engine.check_integrity()


def test_macos_and_unknown_cpus_are_refused_by_name(monkeypatch):
    """Where no kernels are built (macOS on Apple silicon, an architecture MILI has no layer for), every ISA but none
    is refused with the reason, so the engine runs torch's ops instead of failing to build."""
    import platform

    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert cpu.arch() == "aarch64" and cpu.runnable_isas() == ["none"]
    assert "Linux only" in cpu.runnable("neon") and "Darwin" in cpu.runnable("neon-dot")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert cpu.runnable_isas() == ["none"] and "not an ISA of riscv64" in cpu.runnable("avx2")


@needs_kernels
@pytest.mark.parametrize("k", [64, 1024])
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(isa, k):
    """Each row's product does not depend on how many rows are computed with it (one, a few on the direct kernel,
    many on AVX2's and NEON's float32 panel kernel, AMX tiles): a speculative verification's rows are the decode
    steps' bit for bit (runtime/cpu_decode.py)."""
    torch.manual_seed(k)
    w, x = torch.randn(48, k).to(BF16), torch.randn(40, k).to(BF16)
    packed = ops.pack_weight(w)
    many = ops.linear(x, packed, 48)
    for m in (1, 3, 8, 17):
        assert torch.equal(ops.linear(x[:m], packed, 48), many[:m])
    assert torch.equal(ops.linear(x[5:6], packed, 48), many[5:6])


def test_a_path_that_fails_gives_way_to_the_next_one_down():
    """Where the chosen ISA's library fails to build or to pass its check at load, the next ISA down serves (and
    the log says why), not torch's ops at once."""
    chosen = cpu.current()
    order = cpu.ORDER[cpu.arch()]
    if chosen == "none":
        pytest.skip("no kernel ISA runs here: nothing to fall from")
    with cpu.simulated(failing={chosen}):
        below = order[order.index(chosen) - 1]
        assert cpu.current() == below and cpu.available() == (below != "none")
        assert f"{chosen} failed (a simulated failure)" in cpu.why()
    assert cpu.current() == chosen and cpu.available()


@needs_kernels
def test_each_engine_runs_the_isa_its_plan_chose(qwen3_checkpoint, monkeypatch):
    """The ISA is the engine's plan's (``cpu_isa``, made once at start-up), not the process's: two engines in one
    process, one held to a lower path, each run their steps on their own library, whatever the other or
    MILI_CPU_ISA says; a path the CPU lacks is refused by name (the best it runs serves)."""
    monkeypatch.delenv("MILI_CPU_ISA", raising=False)
    best = cpu.best_isa()
    lower = KERNEL_ISAS[0] if len(KERNEL_ISAS) > 1 else "none"  # (an AVX2-only CPU: avx2 against none)
    path = str(qwen3_checkpoint("gqa_untied"))
    held, free = LLM(path, dtype="bfloat16", cpu_isa=lower), LLM(path, dtype="bfloat16")
    assert held.engine.plan.device.cpu_kernels == ("" if lower == "none" else lower)
    assert free.engine.plan.device.cpu_kernels == best and f"CPU ISA {best}" in free.engine.plan.device.cpu_headline
    calls = {}
    for name in dict.fromkeys(KERNEL_ISAS):
        lib = cpu.load(name)[0]
        for fn in ("mili_decode_layers", "mili_linear", "mili_argmax_rows"):
            def counted(*args, _fn=getattr(lib, fn), _name=name):
                calls[_name] = calls.get(_name, 0) + 1
                return _fn(*args)
            monkeypatch.setattr(lib, fn, counted)
    prompt, params = {"prompt_token_ids": list(range(5, 30))}, SamplingParams(temperature=0, max_tokens=6)
    monkeypatch.setenv("MILI_CPU_ISA", lower)  # (read by nothing an engine runs: its plan chose at start-up)
    outs = []
    for llm, isa in ((free, best), (held, lower), (free, best)):
        calls.clear()
        outs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        assert set(calls) == ({isa} if isa != "none" else set()), (isa, calls)
    assert outs[0] == outs[2]
    if lower != "none":  # (a model too big for the lower path's reach: the same tokens within bf16's roundings)
        assert outs[1][:2] == outs[0][:2]
    refused = LLM(path, dtype="bfloat16", cpu_isa="amx" if "amx" not in cpu.runnable_isas() and cpu.arch() ==
                  "x86_64" else "neon" if cpu.arch() == "x86_64" else "avx2")
    assert refused.engine.plan.device.cpu_kernels == best
    assert "refused" in refused.engine.plan.device.cpu_headline


def test_a_wheel_carries_every_source_the_kernels_build_from():
    """pyproject's package data names kernels.c, every file it includes (itself or through those files: the ABI's
    header, the ISA layers, the kernel families) and the CPU probe: an installed (not editable) MILI builds the same
    libraries."""
    import ast
    import fnmatch
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # (the line read as it is: tomllib is Python 3.11's)
    line = re.search(r'^"mili\.kernels\.cpu" = (\[.*?\])', (root / "pyproject.toml").read_text(), re.M)
    patterns = ast.literal_eval(line.group(1))
    included, todo = set(), [cpu.SOURCE]
    while todo:
        for name in re.findall(r'#include "([^"]+)"', todo.pop().read_text()):
            if name not in included:
                included.add(name)
                todo.append(cpu.HERE / name)
    assert included and included == {h.name for h in cpu.HEADERS}
    for name in ["kernels.c", "probe.c", *included]:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
