"""``--kv-cache-dtype int8`` on the CPU: int8 K/V pages [pages, Hkv, page_size, D] beside float32 scales [pages, Hkv,
page_size] (one symmetric scale per token and kv head), on MILI's C kernels. The kernels on every ISA path this
machine runs against a torch reference that quantizes the same way; the plan's choice and its refusals; the pool's
size; the bf16 pages unchanged; the next-token distributions within a stated KL budget of the bf16 pages'; the fused
decode layer equal to the module path; a hybrid's attention layers; prefix-cache hits, n > 1 and preemption."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mili import LLM, InvalidRequest, SamplingParams
from mili.kernels import cpu
from mili.kernels.cpu import ops
from mili.kernels.cpu.ops import Int8Pages, quantize_kv_rows
from mili.runtime.plan import StepKind

from support.devices import kernel_isas
from support.engine_state import assert_drained, prefill_outputs, runner_parts

BF16 = torch.bfloat16
KERNEL_ISAS = kernel_isas()
# (the engine's int8 pages need the kernels the process runs: under MILI_CPU_ISA=none, int8 is refused, tested below)
needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"MILI's kernels don't run here: {cpu.load()[1]}")
INT8 = dict(dtype="bfloat16", kv_cache_dtype="int8")

# The KL budget of the int8 pages against the bf16 pages (same engine, same kernels but the pages'), in bf16 on the
# tiny checkpoint over PROMPTS: the mean over every next-token distribution (each prompt position's, from one prefill;
# each greedy decode step's while both engines' tokens agree) and the largest single one. Measured on an AVX2 Zen 3:
# prompt positions (667) mean 3.6e-4, max 1.4e-3; decode steps (59) mean 3.2e-4, max 9.4e-4. (For scale: against the
# same checkpoint in float32, the bf16 pages' model is at mean 3.3e-4, the int8 pages' at 4.9e-4: int8 adds about
# what bf16's own rounding costs.) The budget leaves ~5x on the mean and ~7x on the largest:
KL_MEAN_BUDGET = 0.002
KL_MAX_BUDGET = 0.01


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    """The kernels split their work over torch's threads: two here, so the split is tested (as test_cpu_kernels)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=KERNEL_ISAS)
def isa(request, monkeypatch):
    """Every kernel path this machine executes (AVX-512, AVX2 with and without VNNI, NEON...), forced in turn."""
    monkeypatch.setenv("MILI_CPU_ISA", request.param)  # (direct calls and the engines built here take it)
    assert cpu.isa() == request.param
    yield request.param


def _pool(num_pages: int, hkv: int, page_size: int, d: int, tokens: int, seed: int):
    """K, V [tokens, Hkv, D] (bf16, K with a wider range and a zero row) stored at scattered slots of fresh int8 pages:
    (k, v, k_pages, v_pages, slots)."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(tokens, hkv, d, generator=g) * torch.rand(tokens, hkv, 1, generator=g) * 8).to(BF16)
    v = torch.randn(tokens, hkv, d, generator=g).to(BF16)
    k[min(3, tokens - 1), 0] = 0  # a row of zeros: scale 0
    slots = torch.randperm(num_pages * page_size, generator=g)[:tokens]
    pages = [Int8Pages.zeros((num_pages, hkv, page_size, d), v=v) for v in (False, True)]
    ops.store_kv(k, v, *pages, slots)
    return k, v, *pages, slots


def _row(slots: torch.Tensor, h: int, hkv: int, page_size: int) -> torch.Tensor:
    return (slots // page_size * hkv + h) * page_size + slots % page_size


@needs_kernels
@pytest.mark.parametrize("d,page_size", [(128, 16), (64, 16), (24, 16), (64, 5), (32, 20)])
def test_store_quantizes_each_row_as_the_reference(isa, d, page_size):
    """Each (token, kv head) row: scale = amax / 127 and round(x / scale) exactly as torch computes them, at the row's
    place in the head-major pages (D 24: a tail shorter than a vector; page sizes 5 and 20: a K block shorter than 16
    rows, an odd page's last V row alone), the layout undone by ``rows``; a slot < 0 writes nothing; the dequantized
    gather of K and of V is bf16(q x scale) exactly."""
    hkv = 2
    k, v, k_pages, v_pages, slots = _pool(9, hkv, page_size, d, 70 if page_size == 16 else 9 * page_size - 3, seed=d)
    for x, pages in ((k, k_pages), (v, v_pages)):
        q, scale = quantize_kv_rows(x)
        for h in range(hkv):
            rows = _row(slots, h, hkv, page_size)
            assert torch.equal(pages.rows().view(-1, d)[rows], q[:, h])
            assert torch.equal(pages.scales.view(-1)[rows], scale[:, h])
        assert (q.abs() <= 127).all() and (scale[3, 0] == 0 if x is k else True)
    padded = Int8Pages.zeros((2, hkv, page_size, d))
    ops.store_kv(k[:2], v[:2], padded, Int8Pages.zeros((2, hkv, page_size, d), v=True), torch.tensor([-1, 5]))
    assert padded.rows().view(-1, d)[_row(torch.tensor([5]), 0, hkv, page_size)].any()
    assert int((padded.scales != 0).sum()) == hkv  # the -1 slot wrote nothing
    # two sequences' first 37 tokens over their pages, dequantized
    n = 37 if page_size == 16 else 3 * page_size - 1
    table = torch.tensor([[3, 0, 5], [1, 2, 8]])
    for pages in (k_pages, v_pages):
        got = ops.gather_pages(pages, table, n)
        want = torch.empty(2, n, hkv, d, dtype=BF16)
        for b in range(2):
            for p in range(n):
                page = table[b, p // page_size]
                want[b, p] = (pages.rows()[page, :, p % page_size].float()
                              * pages.scales[page, :, p % page_size, None]).to(BF16)
        assert torch.equal(got, want)


def test_the_layout_in_bytes():
    """The int8 pages' layout as kernels.c states it, spelled out for one page of 20 rows (a block of 16 and one of 4;
    V's 10 pairs) and one of 5 (V's last row alone): ``rows`` reads value d of row r where the text says it is."""
    d = 4
    for page_size in (20, 5):
        values = torch.arange(page_size * d, dtype=torch.int64).remainder(127).to(torch.int8).view(1, 1, page_size, d)
        k, v = Int8Pages(values, torch.zeros(1, 1, page_size)).rows(), Int8Pages(values, None, v=True).rows()
        flat = values.view(-1)
        for r in range(page_size):
            b = r // 16 * 16
            m = min(16, page_size - b)
            for i in range(d):
                assert k[0, 0, r, i] == flat[b * d + i // 2 * 2 * m + 2 * (r - b) + i % 2]
                lone = r % 2 == 0 and r + 1 == page_size
                assert v[0, 0, r, i] == flat[r * d + i if lone else r // 2 * 2 * d + 2 * i + r % 2]


def _reference_decode(q, k_pages: Int8Pages, v_pages: Int8Pages, table, context_lens, scale):
    """Decode attention over the pages dequantized in float32 (value x scale), float32 throughout: [B, Hq, D]."""
    out = []
    for b, ctx in enumerate(context_lens):
        pages = table[b, :-(-ctx // k_pages.shape[2])]
        k, v = ((c.rows()[pages].float() * c.scales[pages][..., None]).transpose(1, 2)
                .reshape(-1, *c.shape[1::2])[:ctx] for c in (k_pages, v_pages))  # [ctx, Hkv, D]
        o = F.scaled_dot_product_attention(q[b, :, None].float(), k.transpose(0, 1), v.transpose(0, 1), scale=scale,
                                           enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d,page_size", [(hq, hkv, d, 16) for hq, hkv in [(4, 2), (4, 4), (8, 1), (10, 2),
                                                                                  (6, 2), (16, 8)] for d in (64, 128)]
                         + [(6, 2, 64, 5), (4, 1, 128, 20), (10, 2, 64, 100), (16, 8, 128, 1)])
def test_decode_attention_reads_int8_pages(isa, hq, hkv, d, page_size):
    """Every group size (1, 2, 3, 5, 8), both head sizes, contexts of 1, 17 (a partial block), 300 and 600 tokens
    (two and three of the kernel's 256-position tasks, their softmaxes combined) over scattered pages: within the
    output's bf16 rounding (and q's int16 step) of the float32 reference over the same dequantized values. Page sizes
    5, 20, 100 and 1: K blocks shorter than 16 rows, odd pages' last V rows alone, tasks that start inside a block or
    a V pair."""
    num_pages = 640 // page_size
    g = torch.Generator().manual_seed(hq * 10 + hkv + d + page_size)
    _, _, k_pages, v_pages, _ = _pool(num_pages, hkv, page_size, d, num_pages * page_size, seed=hq + d)
    context_lens = [1, 17, 300, 600]
    table = torch.stack([torch.randperm(num_pages, generator=g)[:-(-600 // page_size)] for _ in context_lens])
    q = torch.randn(4, hq, d, generator=g).to(BF16)
    assert ops.decode_attention_supported(q, k_pages)
    got = ops.decode_attention(q, k_pages, v_pages, table, context_lens, d ** -0.5)
    want = _reference_decode(q, k_pages, v_pages, table, context_lens, d ** -0.5)
    # one bf16 rounding of the output (2^-9 relative); q as int16 (a step of amax / 32767) and float32 sums in
    # another order: ~1e-4 absolute on outputs of ~1
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)


@needs_kernels
def test_plan_pool_and_what_it_reports(isa, tiny_checkpoint):
    """int8 on the CPU kernels: the plan's KV dtype, /health's kv_cache_dtype, int8 pages and their scales in the
    pool, (D + 4) / 2D of bf16's bytes a page (so 1.78x the pages at D = 32 here; 1.94x at Qwen3's D = 128), and
    copy-on-write copying values and scales."""
    memory = 48 * 1024  # bf16: 2 layers x K,V x 16 tokens x 2 heads x 32 x 2 bytes = 8 KiB a page: 6 pages
    bf16 = LLM(str(tiny_checkpoint), dtype="bfloat16", kv_cache_memory=memory)
    int8 = LLM(str(tiny_checkpoint), kv_cache_memory=memory, **INT8)
    assert int8.engine.plan.kv_dtype == torch.int8 and int8.engine.plan.describe()["kv cache"] == "int8"
    assert int8.engine.info.kv_cache_dtype == "int8" and bf16.engine.info.kv_cache_dtype == "bfloat16"
    per_page = 2 * 2 * 16 * 2 * (32 + 4)  # K,V x layers x tokens x kv heads x (D int8 + a float32 scale)
    assert bf16.engine.stats().num_pages == 6 and int8.engine.stats().num_pages == memory // per_page == 10
    k_pages = runner_parts(int8).kv_caches[1][0]
    assert isinstance(k_pages, Int8Pages) and k_pages.values.shape == (10, 2, 16, 32)
    assert k_pages.scales.shape == (10, 2, 16) and k_pages.scales.dtype == torch.float32
    assert isinstance(runner_parts(bf16).kv_caches[0][0], torch.Tensor)
    outs = int8.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 20)],
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert_drained(int8)
    k_pages.values[3] = torch.randint(-127, 128, k_pages.values.shape[1:], dtype=torch.int8)
    k_pages.scales[3] = torch.rand(k_pages.scales.shape[1:])
    runner_parts(int8).memory.copy_pages([(3, 7)])
    assert torch.equal(k_pages.values[7], k_pages.values[3]) and torch.equal(k_pages.scales[7], k_pages.scales[3])


def test_refused_where_the_kernels_do_not_run(tiny_checkpoint):
    """int8 pages are the CPU kernels' (bf16, one rank): refused by name elsewhere; fp8 on the CPU names int8."""
    with pytest.raises(InvalidRequest, match="--kv-cache-dtype int8 runs on MILI's CPU kernels .* cpu_kernels is off"):
        LLM(str(tiny_checkpoint), cpu_kernels=False, **INT8)
    with pytest.raises(InvalidRequest, match="int8 runs on MILI's CPU kernels .* the model runs float32") as e:
        LLM(str(tiny_checkpoint), dtype="float32", kv_cache_dtype="int8")
    assert e.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidRequest, match="--kv-cache-dtype fp8 needs the Triton attention backend .* "
                                             "--kv-cache-dtype int8"):
        LLM(str(tiny_checkpoint), dtype="bfloat16", kv_cache_dtype="fp8")
    with pytest.raises(InvalidRequest, match="int8 runs on MILI's CPU kernels .* no CPU kernels"):
        LLM(str(tiny_checkpoint), cpu_isa="none", **INT8)  # (no kernels built: torch's ops)


def _prompts(n: int, seed: int, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(20, 200, (n,), generator=g)]


PROMPTS = _prompts(6, seed=11)


def _greedy_with_logits(llm, prompt: list[int], steps: int, monkeypatch) -> tuple[list[int], torch.Tensor]:
    """One prompt's greedy tokens and the log-distribution each came from ([steps, V]: the prefill's last row, then
    each decode step's), the model's logits recorded as the runner computes them."""
    model, rows = llm.apply_model(lambda m: m), []
    compute = model.compute_logits
    with monkeypatch.context() as m:
        m.setattr(model, "compute_logits", lambda h: rows.append(compute(h)) or rows[-1])
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=steps,
                                                                         ignore_eos=True), use_tqdm=False)
    assert [r.shape[0] for r in rows] == [1] * steps
    return out[0].outputs[0].token_ids, torch.cat(rows).float().log_softmax(-1)


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of each row of log-distributions."""
    return (p.exp() * (p - q)).sum(-1)


@needs_kernels
def test_next_token_distributions_within_the_kl_budget(tiny_checkpoint, monkeypatch):
    """Against the bf16 pages in the same engine, in bf16: every prompt position's next-token distribution (one
    prefill, attending over the stored int8 K/V) and every greedy decode step's while the two engines' tokens agree
    (the fused C decode layer over int8 pages) stay within KL_MEAN_BUDGET on average and KL_MAX_BUDGET each; the KL
    is above zero (the pages really are int8). The bf16 pages' own outputs: the same tokens with the fused layer
    and with the module path (the int8 work leaves them alone)."""
    common = dict(dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=256)
    bf16, int8 = LLM(str(tiny_checkpoint), **common), LLM(str(tiny_checkpoint), kv_cache_dtype="int8", **common)
    assert int8.engine.plan.step is StepKind.CPU_DECODE
    prompt_kl = torch.cat([_kl(prefill_outputs(bf16, p).float().log_softmax(-1),
                               prefill_outputs(int8, p).float().log_softmax(-1)) for p in PROMPTS])
    decode_kl, compared = [], 0
    for p in PROMPTS:
        (ta, la), (tb, lb) = (_greedy_with_logits(llm, p, 16, monkeypatch) for llm in (bf16, int8))
        agree = next((j for j, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
        decode_kl.append(_kl(la[:agree + 1], lb[:agree + 1]))  # (step j's distribution follows the same j tokens)
        compared += agree + 1
    decode_kl = torch.cat(decode_kl)
    assert compared >= len(PROMPTS) * 8  # (most paths agree for most of their steps)
    for kl in (prompt_kl, decode_kl):
        assert 0 < kl.mean() <= KL_MEAN_BUDGET and kl.max() <= KL_MAX_BUDGET, (kl.mean(), kl.max())
    eager = LLM(str(tiny_checkpoint), enforce_eager=True, **common)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert ([o.outputs[0].token_ids for o in bf16.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)])


@needs_kernels
def test_fused_decode_layer_is_the_module_path_bit_for_bit(isa, tiny_checkpoint):
    """The fused C decode layer (mili_decode_layers over int8 pages) against the modules one by one (enforce_eager:
    the backend's store and decode kernels): the same tokens and logprobs exactly, over sequences of different
    lengths, an n > 1 fork (its shared pages) and a sampled one."""
    fused, eager = (LLM(str(tiny_checkpoint), enforce_eager=e, **INT8) for e in (False, True))
    assert fused.engine.plan.step is StepKind.CPU_DECODE and eager.engine.plan.step is StepKind.EAGER
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=3) for m in (12, 5, 12, 9)]
    params[2] = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 40, 90)]
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (fused, eager))
    for x, y in zip(a, b):
        assert len(x.outputs) == len(y.outputs)
        for ox, oy in zip(x.outputs, y.outputs):
            assert ox.token_ids == oy.token_ids
            assert [{t: lp.logprob for t, lp in d.items()} for d in ox.logprobs] == \
                   [{t: lp.logprob for t, lp in d.items()} for d in oy.logprobs]
    assert_drained(fused)


@needs_kernels
def test_prefix_cache_hit_gives_the_tokens_of_a_miss(tiny_checkpoint):
    """A prompt whose first 64 tokens are cached (four whole pages, written by an earlier request) gets the tokens
    it gets with no prefix cache: a chunk attends over its own K/V as the pages hold them, cached or not."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 512, (64,), generator=g).tolist()
    first, second = (shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 23))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cached = LLM(str(tiny_checkpoint), max_num_batched_tokens=32, **INT8)
    plain = LLM(str(tiny_checkpoint), max_num_batched_tokens=32, enable_prefix_caching=False, **INT8)
    cached.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    hit = cached.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 64
    miss = plain.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert_drained(cached, evict=True)


@needs_kernels
def test_preemption_and_n_keep_running_on_few_pages(tiny_checkpoint):
    """Twelve requests (two with n = 2) on 24 int8 pages: preempted and recomputed, every sequence finishes its
    tokens, and its tokens are those of a run with pages to spare but where a recomputation parted them (a
    preempted sequence's K/V are recomputed by a prefill, whose bf16 roundings differ from its decodes')."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(12, seed=4)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 10 + \
             [SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=24, ignore_eos=True) for i in (1, 2)]
    per_page = 2 * 2 * 16 * 2 * (32 + 4)
    tight = LLM(str(tiny_checkpoint), max_num_batched_tokens=64, kv_cache_memory=24 * per_page, **INT8)
    ample = LLM(str(tiny_checkpoint), max_num_batched_tokens=64, **INT8)
    assert tight.engine.stats().num_pages == 24
    outs, refs = (llm.generate(prompts, params, use_tqdm=False) for llm in (tight, ample))
    assert tight.engine.stats().num_preemptions > 0
    same = 0
    for out, ref in zip(outs, refs):
        assert [len(o.token_ids) for o in out.outputs] == [24] * len(ref.outputs)
        same += all(o.token_ids == r.token_ids for o, r in zip(out.outputs, ref.outputs))
    assert same >= len(prompts) // 2
    assert_drained(tight, evict=True)


@needs_kernels
def test_hybrid_attention_layers_on_int8_pages(hybrid_checkpoint):
    """A Qwen3.5 hybrid: its full-attention layers' pages int8 (the Gated DeltaNet states as ever), prefill in
    chunks, decode, n = 2; its greedy tokens those of the bf16 pages but where the paths part late (random
    weights); a prefix-cache hit (state snapshots and int8 pages together) gives the tokens of the miss."""
    path = str(hybrid_checkpoint("qwen3_5"))
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    int8 = LLM(path, max_num_batched_tokens=32, **INT8)
    bf16 = LLM(path, dtype="bfloat16", max_num_batched_tokens=32)
    assert all(isinstance(k, Int8Pages) for k, _ in runner_parts(int8).kv_caches)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (int8, bf16))
    agree = [next((j for j, (x, y) in enumerate(zip(o.outputs[0].token_ids, r.outputs[0].token_ids)) if x != y), 12)
             for o, r in zip(a, b)]
    assert sum(agree) >= 3 * 12, agree  # (random weights in bf16: near-ties part some paths)
    forked = int8.generate(prompts[0], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
    assert [len(o.token_ids) for o in forked.outputs] == [8, 8]
    again = int8.generate(prompts, params, use_tqdm=False)  # (the prompts' pages and snapshots cached now)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in a]
    assert any(o.num_cached_tokens for o in again)
    assert_drained(int8, evict=True)
