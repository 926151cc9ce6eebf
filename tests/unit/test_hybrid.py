"""The hybrid Qwen generation (Qwen3.5, Qwen3.5 MoE, Qwen3-Next, the hub's Qwen3.5 layout) against HF
transformers in float32: greedy tokens and logprobs through the offline LLM API with chunked prefill and
batching, preemption under few pages and state slots, aborts, forks; the state-slot and page invariants
after every scenario."""

from __future__ import annotations

import logging

import pytest
import torch

from support.engine_state import assert_drained, engine_core, runner_parts
from support.hybrid import hf_reference
from support.parity import assert_greedy_matches_hf, hf_greedy
from mili import LLM, SamplingParams
from mili.config import ModelConfig
from mili.errors import InvalidRequest, ModelLoadError
from mili.model.checkpoint import load_hf_config
from mili.model.loader import load_weights
from mili.model.qwen3_5 import Qwen3_5ForCausalLM
from mili.model.batch import ForwardBatch
from mili.runtime.attention.torch_backend import TorchAttentionBackend

PROMPT_LENS = [1, 5, 17, 64, 150, 311]  # 150 and 311 are prefilled in chunks (budget 96 tokens)
MAX_TOKENS = 12
# the MoE with fused experts is checked against the per-expert checkpoint it was made from (same weights)
REFERENCE_KIND = {"qwen3_5_moe_fused": "qwen3_5_moe"}
LAYOUT_ONLY = ("qwen3_5_hub", "qwen3_5_moe_fused")  # the same math in another layout: three prompts suffice


@pytest.fixture(scope="module")
def references(hybrid_checkpoint):
    """HF's greedy tokens and per-step logits for each kind, computed once."""
    cache = {}

    def get(kind: str, prompts: list[list[int]]):
        key = (kind, tuple(map(tuple, prompts)))
        if key not in cache:
            model = hf_reference(hybrid_checkpoint(kind), REFERENCE_KIND.get(kind, kind))
            cache[key] = hf_greedy(model, prompts, MAX_TOKENS)
        return cache[key]

    return get


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _check_integrity(llm) -> None:
    """No finished sequence kept its state slot or pages; every snapshot left is a cache node's (check_integrity)."""
    assert_drained(llm)


def _assert_matches(outs, reference, logprobs: bool = True) -> None:
    assert_greedy_matches_hf(outs, reference, MAX_TOKENS, logprobs)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_hub", "qwen3_5_moe_fused"])
def test_greedy_matches_hf_generate(hybrid_checkpoint, references, kind, caplog):
    """All prompts in one batch (decodes beside prefill chunks), long ones prefilled in several chunks."""
    prompts = _prompts()
    if kind in LAYOUT_ONLY:
        prompts = [prompts[1], prompts[4], prompts[5]]
    text_only = {"language_model_only": True} if kind == "qwen3_5_hub" else {}  # (with the tower: test_vision*.py)
    with caplog.at_level(logging.INFO, logger="mili"):
        llm = LLM(str(hybrid_checkpoint(kind)), dtype="float32", max_num_batched_tokens=96, page_size=16, **text_only)
    assert "prefix-cache snapshots" in caplog.text
    if kind == "qwen3_5_hub":  # the vision tower skipped with one line; the mtp.* tensors are no reason to refuse
        assert sum("vision tower" in r.message for r in caplog.records) == 1
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _assert_matches(outs, references(kind, prompts))
    _check_integrity(llm)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_preemption_and_few_slots_keep_the_tokens(hybrid_checkpoint, references, kind):
    """Two state slots for six requests, and a KV pool too small for all of them: sequences wait for slots,
    are preempted (slot and pages freed, recomputed later) and still write HF's tokens."""
    prompts = _prompts()
    llm = LLM(str(hybrid_checkpoint(kind)), dtype="float32", max_num_batched_tokens=64, page_size=16, num_kv_pages=30,
              num_state_slots=3)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    most_running = 0
    while engine.has_unfinished_requests():
        engine.step()
        most_running = max(most_running, engine.stats().num_running)
        engine.check_integrity()  # after every step
    assert most_running == 3 and engine.stats().num_preemptions > 0
    reference = references(kind, prompts)
    exact = sum(r.seqs[0].output_token_ids == ref for r, (ref, _) in zip(requests, reference))
    assert exact >= len(prompts) - 1
    _check_integrity(llm)


def test_aborts_and_stops_return_slots(hybrid_checkpoint):
    llm = LLM(str(hybrid_checkpoint("qwen3_5")), dtype="float32", max_num_batched_tokens=64, page_size=16, num_state_slots=4)
    engine, core = llm.engine, engine_core(llm)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in _prompts(seed=2)]
    for _ in range(4):  # some prefilling, some decoding, some waiting for a slot
        core.step()
        engine.check_integrity()
    stats = engine.stats()
    assert stats.num_state_slots_free == 0 and stats.num_waiting
    core.finish_seqs([(requests[0].request_id, 0)])  # a stop string found by the output processor
    engine.check_integrity()
    core.abort_requests([r.request_id for r in requests[1:]])
    engine.check_integrity()
    _check_integrity(llm)


def test_forked_sequences_take_their_parents_state(hybrid_checkpoint, references):
    """n = 3 greedy samples: the children forked after the prompt carry the parent's recurrent state."""
    prompts = _prompts()[2:4]
    llm = LLM(str(hybrid_checkpoint("qwen3_5")), dtype="float32", max_num_batched_tokens=96, page_size=16, num_state_slots=6)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (ref, _) in zip(outs, references("qwen3_5", prompts)):
        assert [o.token_ids for o in out.outputs] == [ref] * 3
    with pytest.raises(InvalidRequest, match="exceeds the 6 recurrent-state slots") as e:  # n past the slots
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2, n=7), use_tqdm=False)
    assert e.value.param == "n"
    _check_integrity(llm)


def test_prompt_logprobs_match_hf(hybrid_checkpoint):
    """A 150-token prompt scored over three prefill chunks (the state carried between them) is HF's log_softmax."""
    prompt = _prompts()[4]
    llm = LLM(str(hybrid_checkpoint("qwen3_next")), dtype="float32", max_num_batched_tokens=64, page_size=16)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf_reference(hybrid_checkpoint("qwen3_next"), "qwen3_next")(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - want).abs().max().item() < 1e-4
    _check_integrity(llm)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_chunked_state_logits_match_hf(hybrid_checkpoint, kind):
    """Prefill in three chunks over scattered pages and a state slot other than 0, then decodes (the first beside
    a one-token prompt whose slot holds garbage): every position's logits agree with HF's forward to 1e-4."""
    path = str(hybrid_checkpoint(kind))
    cfg = ModelConfig.from_hf(load_hf_config(path))
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg, TorchAttentionBackend(), torch.float32)
    model = model.to_empty(device="cpu")
    load_weights(model, path)
    model.init_rotary(1024, torch.device("cpu"))
    shape, page_size, length = model.linear_shape, 8, 53
    layers = cfg.layer_types.count("linear_attention")
    states = [(torch.full((3, *shape.conv_state_shape()), 7.0), torch.full((3, *shape.ssm_state_shape()), 7.0))
              for _ in range(layers)]  # garbage in the slots: a sequence's first chunk must not read it
    kv_shape = (12, page_size, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.zeros(kv_shape), torch.zeros(kv_shape)) for _ in range(cfg.num_attention_layers)]
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(3))
    pages = torch.tensor([[9, 2, 7, 0, 4, 11, 5]])
    logits = []
    for start, end in [(0, 20), (20, 37), (37, 51), (52, 53)]:
        pos = torch.arange(start, end)
        batch = ForwardBatch(ids[start:end], pos, pages[0][pos // page_size] * page_size + pos % page_size,
                             pages, [end - start], [end], int(end - start == 1), torch.arange(end - start),
                             state_slots=[2])
        if start == 52:  # position 51 was decoded beside a one-token prompt (slot 0, still garbage: unread)
            logits.append(decoded[:1])
        with torch.no_grad():
            logits.append(model.compute_logits(model(batch, kv, states)))
        if end == 51:
            other = int(ids[7])
            batch = ForwardBatch(torch.tensor([int(ids[51]), other]), torch.tensor([51, 0]),
                                 torch.tensor([int(pages[0, 51 // page_size]) * page_size + 51 % page_size,
                                               10 * page_size]),
                                 torch.stack([pages[0], torch.tensor([10, 0, 0, 0, 0, 0, 0])]), [1, 1], [52, 1], 2,
                                 torch.arange(2), state_slots=[2, 0])
            with torch.no_grad():
                decoded = model.compute_logits(model(batch, kv, states))
    ours = torch.cat(logits)
    reference = hf_reference(hybrid_checkpoint(kind), kind)
    with torch.no_grad():
        ref = reference(ids[None]).logits[0]
        ref_other = reference(torch.tensor([[other]])).logits[0, 0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert ((decoded[1] - ref_other).abs().max() / ref_other.abs().max()).item() < 1e-4


def test_unknown_layer_kind_in_a_hybrid_is_refused(hybrid_checkpoint, tmp_path):
    import json
    import shutil

    path = tmp_path / "ck"
    shutil.copytree(hybrid_checkpoint("qwen3_5"), path)
    config = json.loads((path / "config.json").read_text())
    config["layer_types"][1] = "sliding_attention"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"layer_types has 'sliding_attention' \(layer 1.*full_attention and "
                                             r"linear_attention"):
        LLM(str(path))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_bfloat16_matches_hf_bfloat16(hybrid_checkpoint, kind, tmp_path):
    """bfloat16: weights and conv states in bf16, the SSM state kept in float32 (mamba_ssm_dtype's default, as
    HF keeps it), and the log-probabilities HF's bf16 model gives the same tokens.

    Greedy tokens are no test here: HF's own bf16 decode parts from its bf16 prefill (and from float32) at top-2
    gaps of 0.3 on these random models, so no near-tie rule separates rounding from a bug. Instead, teacher
    forcing: every prompt token's logprob (a prefill in 16-token chunks, the state stored and read back between
    chunks) and every greedily decoded token's (the state stored every step) against HF's bf16 forward over the
    same ids. The prompt tokens' bound on the mean is below what float32 (HF's own float32 model, checked here) or
    an SSM state stored in bf16 (the checkpoint saying mamba_ssm_dtype bfloat16, checked for qwen3_next) are off by
    (measured on the torch path: 0.0009 and 0.0007, HF float32 0.017 and 0.045, the bf16 state 0.009; with MILI's
    CPU kernels, whose linears and attention round in their own order: 0.0021 for qwen3_next); the decoded tokens' is
    looser (0.012 and 0.019 measured: one token a step, bf16 rounding and the MoE's routing near-ties add up) and
    catches a state lost or misplaced between steps, not its dtype."""
    import json
    import shutil

    prompts, max_tokens = _prompts(), 24
    path = hybrid_checkpoint(kind)
    hf16 = hf_reference(path, kind, torch.bfloat16)
    hf32 = hf_reference(path, kind)

    def errors(path, dtype: str = "bfloat16") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """|ours - HF bf16| per prompt token and per decoded token; and |HF float32 - HF bf16| per prompt token."""
        llm = LLM(str(path), dtype=dtype, max_num_batched_tokens=16, page_size=16)
        states = runner_parts(llm).states
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        prompt_err, decode_err, float32_err = [], [], []
        for p, out in zip(prompts, outs):
            got = out.outputs[0].token_ids
            ids = torch.tensor([p + got])
            with torch.no_grad():
                ref = hf16(ids).logits[0].float().log_softmax(-1)
                ref32 = hf32(ids).logits[0].float().log_softmax(-1)
            prompt_err += [out.prompt_logprobs[i][p[i]].logprob - ref[i - 1, p[i]].item() for i in range(1, len(p))]
            float32_err += [ref32[i - 1, p[i]].item() - ref[i - 1, p[i]].item() for i in range(1, len(p))]
            decode_err += [out.outputs[0].logprobs[j][t].logprob - ref[len(p) - 1 + j, t].item()
                           for j, t in enumerate(got)]
        _check_integrity(llm)
        return (torch.tensor(prompt_err).abs(), torch.tensor(decode_err).abs(), torch.tensor(float32_err).abs(),
                states)

    prompt_err, decode_err, float32_err, states = errors(path)
    assert llm_dtypes(states) == (torch.bfloat16, torch.float32)
    bound = 4e-3
    assert prompt_err.mean() < bound and prompt_err.max() < 0.1, (prompt_err.mean(), prompt_err.max())
    assert decode_err.mean() < 4e-2 and decode_err.max() < 0.5, (decode_err.mean(), decode_err.max())
    assert float32_err.mean() > 2 * bound  # the bound means something: float32 is further from HF's bf16 than it allows
    if kind == "qwen3_next":  # and an SSM state stored in bf16 is too
        bf16_state = tmp_path / "bf16_state"
        shutil.copytree(path, bf16_state)
        config = json.loads((bf16_state / "config.json").read_text())
        (bf16_state / "config.json").write_text(json.dumps({**config, "mamba_ssm_dtype": "bfloat16"}))
        prompt_err, _, _, states = errors(bf16_state)
        assert llm_dtypes(states) == (torch.bfloat16, torch.bfloat16)
        assert prompt_err.mean() > bound, prompt_err.mean()


def llm_dtypes(states) -> tuple[torch.dtype, torch.dtype]:
    """The (conv, SSM) state dtypes of every linear-attention layer (all layers alike)."""
    kinds = {(conv.dtype, ssm.dtype) for conv, ssm in states.caches}
    assert len(kinds) == 1
    return kinds.pop()
