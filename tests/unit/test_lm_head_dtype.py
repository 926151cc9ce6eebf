"""``lm_head_dtype`` (``--lm-head-dtype auto|bf16|int8``): the lm_head on MILI's int8 kernel, one scale per
output channel, where the body is quantized (auto) or when asked.

The int8 layer's error has a bound: rounding a weight to the nearest step of s = max|row| / 127 moves it by
at most s / 2, so a logit computed without activation quantization (float32: aten's weight-only int8) moves
by at most sum_k |x_k| * s_j / 2, and a log-probability by at most twice the largest such move. The tests
check that bound on the layer, the greedy tokens of the tiny parity checkpoints (the same but where the
unquantized model's top two log-probabilities lie within that bound), and the cost in KL on the trained demo
against Gaussian noise of twice the rounding's RMS."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.engine_state import prefill_outputs
from support.parity import prompt_logprobs
from mili import LLM, InvalidRequest, SamplingParams
from mili.kernels import cpu
from mili.model.cpu_linear import Int8Linear, KernelLinear, PackedEmbedding


def test_the_int8_layer_stays_within_its_rounding_bound():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 64, generator=g), torch.randn(7, 64, generator=g) * 2
    layer = Int8Linear(w)
    got = layer(x)
    scales = w.abs().amax(dim=1) / 127
    bound = x.abs().sum(-1, keepdim=True) * scales / 2
    err = (got - x @ w.T).abs()
    assert (err <= bound + 1e-4).all() and err.max() > 1e-3  # within the bound, and really rounded


@pytest.mark.parametrize("shape", ["gqa_untied", "mha_tied"])
def test_int8_head_keeps_the_greedy_tokens_within_its_bound(qwen3_checkpoint, shape):
    """float32, so the head's rounding is the only difference: every prompt position's log-probabilities
    within twice the layer's logit bound of the unquantized model's (the bound taken from the hidden states'
    L1 norms), and greedy continuations equal until a near tie under that bound."""
    path = str(qwen3_checkpoint(shape))
    common = dict(dtype="float32", enable_prefix_caching=False)
    plain, quant = LLM(path, **common), LLM(path, lm_head_dtype="int8", **common)
    head = quant.apply_model(lambda m: m.lm_head)
    assert isinstance(head, Int8Linear) and "lm_head int8" in quant.engine.plan.weight_format
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    want, got = prompt_logprobs(plain, prompt), prompt_logprobs(quant, prompt)
    w = plain.apply_model(lambda m: m)
    table = (w.lm_head.weight if w.lm_head is not None else w.model.embed_tokens.weight).float()
    step = table.abs().amax(dim=1).max() / 127
    hidden_l1 = _hidden_l1(plain, prompt)
    bound = 2 * hidden_l1 * step / 2  # log-probabilities: twice the largest logit move
    diff = (got - want).abs().amax(-1)
    assert (diff <= bound + 1e-5).all(), (diff, bound)
    assert diff.max() > 1e-6  # (quantized)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt[:n]} for n in (3, 17, 40)]
    for p, a, b in zip(prompts, plain.generate(prompts, params, use_tqdm=False),
                       quant.generate(prompts, params, use_tqdm=False)):
        a, b = a.outputs[0].token_ids, b.outputs[0].token_ids
        parted = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if parted is not None:  # a near tie: the unquantized top two within the bound
            logprobs = prompt_logprobs(plain, p["prompt_token_ids"] + a[:parted])[-1]
            top2 = logprobs.topk(2).values
            assert top2[0] - top2[1] <= 2 * bound.max(), (shape, parted)


def _hidden_l1(llm, prompt: list[int]) -> torch.Tensor:
    """The L1 norm of the final hidden state at every prompt position (what the head multiplies)."""
    hidden = prefill_outputs(llm, prompt, head=False).float()
    return hidden.abs().sum(-1)


def test_int8_head_kl_on_the_trained_demo():
    """The shipped `demo` on Bible chapters it never saw, float32: the int8 head's next-token distributions
    cost less KL than the same head with Gaussian noise of twice the rounding's RMS (s / sqrt(12) per
    weight, s its row's step), and more than a tenth of it (the rounding is really applied)."""
    from transformers import AutoTokenizer

    from mili.model.demo import demo_checkpoint

    path = demo_checkpoint()
    text = (Path(__file__).resolve().parents[1] / "data" / "demo" / "heldout.txt").read_text()
    verses = [line.split(" ", 1)[1] for line in text.splitlines()[:40] if line.startswith("  ")]
    ids = AutoTokenizer.from_pretrained(path)(" ".join(verses), add_special_tokens=False)["input_ids"][:200]
    common = dict(dtype="float32", enable_prefix_caching=False)
    ref = prompt_logprobs(LLM(path, **common), ids)
    int8 = prompt_logprobs(LLM(path, lm_head_dtype="int8", **common), ids)
    noisy = LLM(path, **common)
    model = noisy.apply_model(lambda m: m)
    table = model.model.embed_tokens.weight  # tied: noise on a head of its own, the lookup table kept
    step = table.abs().amax(dim=1, keepdim=True) / 127
    g = torch.Generator().manual_seed(0)
    noisy_head = table + torch.randn(table.shape, generator=g) * (2 * step / 12 ** 0.5)
    model.lm_head = torch.nn.Linear(table.shape[1], table.shape[0], bias=False)
    model.lm_head.weight.data = noisy_head
    budget = prompt_logprobs(noisy, ids)

    def kl(q):
        return (ref.exp() * (ref - q)).sum(-1).mean().item()

    assert 0.1 * kl(budget) < kl(int8) < kl(budget), (kl(int8), kl(budget))


@pytest.mark.skipif(not (cpu.available() and cpu.int8_available()), reason="MILI's int8 kernel: AVX-512 VNNI or AMX")
def test_auto_bf16_and_int8_on_the_kernels():
    """bf16 on the CPU's kernels: auto keeps an unquantized body's head packed bf16 (the tied table stored
    once) and gives an int8 body an int8 head; bf16 keeps it under an int8 body; int8 puts it on the W8A8
    kernel beside a bf16 body (the tied table kept for the lookup). The trained demo says the same "Hello"
    reply with each."""
    from mili.tools.bench import weight_bytes_per_step

    def head(**kw):
        llm = LLM("demo", dtype="bfloat16", **kw)
        model = llm.apply_model(lambda m: m)
        reply = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=30),
                         chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0].outputs[0].text
        return type(model.lm_head), type(model.model.embed_tokens), llm.engine.plan.weight_format, reply, \
            weight_bytes_per_step(model)

    plain = head()
    assert plain[:2] == (KernelLinear, PackedEmbedding) and "lm_head" not in plain[2]
    int8_body = head(quantization="int8")
    assert int8_body[0] is Int8Linear
    kept = head(quantization="int8", lm_head_dtype="bf16")
    assert kept[:2] == (KernelLinear, PackedEmbedding) and kept[2].endswith("lm_head bfloat16")
    int8_head = head(lm_head_dtype="int8")
    assert int8_head[0] is Int8Linear and int8_head[0] is not PackedEmbedding
    assert int8_head[2] == "unquantized, lm_head int8 (W8A8 kernel)"
    assert plain[3] == int8_head[3] and int8_body[3] == kept[3], (plain[3], int8_head[3], int8_body[3], kept[3])
    # mili bench's bytes a step: the head as it is read (4,096 x 384: 3.1 MB in bf16, half that in int8)
    vocab, hidden = 4096, 384
    assert plain[4] - int8_head[4] == pytest.approx(vocab * hidden, rel=0.02)
    assert kept[4] - int8_body[4] == pytest.approx(vocab * hidden, rel=0.02)


def test_int8_head_off_the_cpu_layers_is_refused_by_name(tiny_checkpoint):
    with pytest.raises(InvalidRequest, match="lm_head_dtype must be auto, bf16 or int8"):
        LLM(str(tiny_checkpoint), lm_head_dtype="fp8")
    with pytest.raises(InvalidRequest, match="--lm-head-dtype int8 runs on the CPU's linear layers, one rank"):
        LLM(str(tiny_checkpoint), dtype="float32", lm_head_dtype="int8", tensor_parallel_size=2)
