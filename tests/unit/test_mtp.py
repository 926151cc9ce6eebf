"""MTP speculative decoding (the checkpoint's multi-token-prediction head drafts): the head's forward against a
float32 reimplementation from the raw ``mtp.*`` tensors (with its KV over earlier pairs); the same greedy output
as without speculation on random hybrids (dense and MoE heads) through chunked prefill, batches, forks,
preemption and prefix-cache hits, every page and state slot back; a scripted head that drafts right."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from support.engine_state import engine_core, model_runner, runner_parts
from support.hybrid import build_hybrid_checkpoint, build_scripted_hybrid_checkpoint
from mili import LLM, SamplingParams
from mili.model.batch import ForwardBatch
from test_speculative import (assert_same_outputs, drained_clean, repetitive_prompts, spec_outputs,
                             spec_params)

MTP = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def hub(hybrid_checkpoint):
    return hybrid_checkpoint("qwen3_5_hub")


# -- the head against a reimplementation ----------------------------------------------------------------------
def _reference_head(path, tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """vLLM's Qwen3_5MultiTokenPredictor in float32 from the checkpoint's tensors: pair p = (prev[p], tokens[p])
    at rotary position p, causal attention over pairs 0 .. p; [T, H] after mtp.norm."""
    w = {k: v.float() for k, v in load_file(path / "model.safetensors").items()}
    text = json.loads((path / "config.json").read_text())["text_config"]
    eps, d = text["rms_norm_eps"], text["head_dim"]
    nq, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    rope = text["rope_parameters"]

    def norm(x, name):  # zero-centred
        return F.rms_norm(x, (x.shape[-1],), eps=eps) * (1 + w[name])

    def rotate(x, pos):  # rotate-half RoPE on the first partial_rotary_factor of each head
        rot = int(d * rope["partial_rotary_factor"])
        inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot)
        ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)[:, None]
        x1, x2 = x[..., :rot].chunk(2, dim=-1)
        return torch.cat([x[..., :rot] * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin(), x[..., rot:]], -1)

    t, m = tokens.shape[0], "mtp.layers.0."
    e = norm(w["model.language_model.embed_tokens.weight"][tokens], "mtp.pre_fc_norm_embedding.weight")
    x = torch.cat([e, norm(prev, "mtp.pre_fc_norm_hidden.weight")], -1) @ w["mtp.fc.weight"].T
    a = norm(x, m + "input_layernorm.weight")
    q, gate = (a @ w[m + "self_attn.q_proj.weight"].T).view(t, nq, 2 * d).chunk(2, dim=-1)
    k = (a @ w[m + "self_attn.k_proj.weight"].T).view(t, nkv, d)
    v = (a @ w[m + "self_attn.v_proj.weight"].T).view(t, nkv, d)
    pos = torch.arange(t).float()
    q = rotate(norm(q, m + "self_attn.q_norm.weight"), pos)
    k = rotate(norm(k, m + "self_attn.k_norm.weight"), pos)
    rep = nq // nkv
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / d ** 0.5
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(rep, 1)).reshape(t, -1)
    x = x + (o * gate.reshape(t, -1).sigmoid()) @ w[m + "self_attn.o_proj.weight"].T
    y = norm(x, m + "post_attention_layernorm.weight")
    mlp = F.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)
    return norm(x + mlp @ w[m + "mlp.down_proj.weight"].T, "mtp.norm.weight")


def test_head_matches_a_reimplementation_over_its_kv(hub):
    """Pairs 0 .. 5 of one sequence: the first four as a prefill chunk, then one at a time as drafting does
    (each attends to the K/V the earlier calls wrote in the head's pages): the reimplementation's outputs."""
    llm = LLM(str(hub), dtype="float32", speculative_config=MTP)
    runner = model_runner(llm)
    model, kv = runner.parts.model, runner.parts.kv_caches[-1]
    assert len(runner.parts.kv_caches) == 2  # the model's one full-attention layer, and the head's
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (6,), generator=g)
    prev = torch.randn(6, 64, generator=g)
    prev[0] = 0  # (a sequence's first pair: no hidden state before it)
    (page,) = engine_core(llm).pages.allocate(1)
    chunk = ForwardBatch(input_ids=tokens[:4], positions=torch.arange(4), slot_mapping=page * 16 + torch.arange(4),
                         page_table=torch.tensor([[page]]), query_lens=[4], context_lens=[4], num_decodes=0,
                         logits_indices=torch.arange(4))
    with torch.inference_mode():
        got = [model.mtp_forward(tokens[:4], prev[:4], chunk, kv)]
        for p in (4, 5):
            one = runner.parts.batches.one_token_batch([[page]], [p], tokens[p:p + 1])
            got.append(model.mtp_forward(tokens[p:p + 1], prev[p:p + 1], one, kv))
    engine_core(llm).pages.decref([page])
    want = _reference_head(hub, tokens, prev)
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
    # the drafts: the shared lm_head's argmax
    head = load_file(hub / "model.safetensors")["lm_head.weight"].float()
    assert torch.equal(model.compute_logits(torch.cat(got)).argmax(-1), (want @ head.T).argmax(-1))


# -- the engine: the same output ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3_5_hub", "qwen3_next"])
def test_greedy_output_is_unchanged(kind, hub, tmp_path):
    """A random head drafts (mostly wrong) through chunked prefill (a 48-token budget), a batch with n = 2 forks
    and sequences that cannot draft, prefix-cache hits (the prompts twice), then preemption (few pages and
    state slots): the same tokens, text and logprobs as without speculation; every page and slot back.
    Qwen3-Next: an MoE head (routed experts and a shared expert) from a config that names no MTP layer."""
    path = str(hub if kind == "qwen3_5_hub" else build_hybrid_checkpoint(tmp_path / kind, kind, mtp=True))
    base = dict(dtype="float32", max_num_batched_tokens=48)
    prompts = repetitive_prompts(512, n=8 if kind == "qwen3_5_hub" else 4)
    params = [spec_params()[i % 3] for i in range(len(prompts))]
    params[-1] = SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True)
    want = spec_outputs(LLM(path, **base), prompts, params)
    spec = LLM(path, **base, speculative_config=MTP)
    for _ in range(2 if kind == "qwen3_5_hub" else 1):  # the second time through, prefix-cache hits
        assert_same_outputs(want, spec_outputs(spec, prompts, params))
        drained_clean(spec)
    assert spec.engine.spec_decode_stats()["num_drafts"] > 20
    if kind != "qwen3_5_hub":
        return
    assert spec.engine.stats().num_pages_cached > 0
    tight = LLM(path, **base, num_kv_pages=10, num_state_slots=4, speculative_config=MTP)
    assert_same_outputs(want, spec_outputs(tight, prompts, params))
    assert tight.engine.stats().num_preemptions > 0
    drained_clean(tight)


# -- a scripted head: drafts right ------------------------------------------------------------------------------
CYCLE = {1000: 2000, 2000: 3000, 3000: 4000, 4000: 1000}


def test_scripted_head_drafts_right(tmp_path):
    """A hybrid whose next token is a fixed function of the current one, and an MTP head that predicts the
    same function: acceptance >= 80%, about k + 1 tokens a step, the output unchanged; then with every third
    step's second draft spoilt (drafts partly accepted, the hybrid's chunk recomputed), still unchanged."""
    path = str(build_scripted_hybrid_checkpoint(tmp_path / "scripted", CYCLE, mtp=True))
    prompts = [{"prompt_token_ids": [1000, 2000, 3000, 4000, 1000]}, {"prompt_token_ids": [3000] * 20}]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = spec_outputs(LLM(path, dtype="float32"), prompts, params)
    spec = LLM(path, dtype="float32", speculative_config=MTP)
    assert_same_outputs(want, spec_outputs(spec, prompts, params))
    stats = spec.engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] >= 0.8 * stats["num_draft_tokens"] > 0, stats
    assert stats["num_drafts"] <= 2 * (64 / 4 + 2)  # about 4 tokens a step
    drained_clean(spec)

    drafter, calls = runner_parts(spec).mtp, iter(range(10**9))
    draft = drafter.draft

    def spoilt(scheduled):
        draft(scheduled)
        for s in scheduled:
            if len(s.draft) > 1 and next(calls) % 3 == 1:
                s.draft[1] = 7
    drafter.draft = spoilt
    before = spec.engine.spec_decode_stats()
    assert_same_outputs(want, spec_outputs(spec, prompts, params))
    stats = spec.engine.spec_decode_stats()
    accepted, drafted = (stats[k] - before[k] for k in ("num_accepted_tokens", "num_draft_tokens"))
    assert 0.4 * drafted < accepted < drafted, stats
    drained_clean(spec)


def test_sampled_drafts_repeat_with_a_seed_and_stop_strings_cut_alike(tmp_path):
    """On the scripted hybrid whose head drafts right: seeded sampled output (n = 2) repeats exactly from run to
    run with drafts verified by rejection, and a stop string cuts the text where it does without speculation."""
    path = str(build_scripted_hybrid_checkpoint(tmp_path / "scripted", CYCLE, mtp=True))
    prompts = [{"prompt_token_ids": [1000, 2000, 3000]}, {"prompt_token_ids": [4000] * 9}]
    spec = LLM(path, dtype="float32", speculative_config=MTP)
    seeded = SamplingParams(temperature=0.7, n=2, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)
    first, second = (spec_outputs(spec, prompts, seeded) for _ in range(2))
    assert first == second
    assert spec.engine.spec_decode_stats()["num_accepted_tokens"] > 0
    plain = LLM(path, dtype="float32")
    text = plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    stop = SamplingParams(temperature=0, max_tokens=20, stop=[text[len(text) // 2:len(text) // 2 + 3]])
    assert_same_outputs(spec_outputs(plain, prompts, stop), spec_outputs(spec, prompts, stop))
    drained_clean(spec)


def test_drafts_on_the_triton_backend(tmp_path):
    """The head's one-token batches and the verifications through the Triton attention kernels (the CUDA path,
    here under TRITON_INTERPRET=1): the torch backend's greedy tokens without speculation, drafts accepted."""
    pytest.importorskip("triton")
    path = str(build_scripted_hybrid_checkpoint(tmp_path / "scripted", CYCLE, mtp=True))
    prompts = [{"prompt_token_ids": [1000, 2000]}, {"prompt_token_ids": [3000] * 5}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = spec_outputs(LLM(path, dtype="float32"), prompts, params)
    spec = LLM(path, dtype="float32", attention_backend="triton",
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert_same_outputs(want, spec_outputs(spec, prompts, params))
    stats = spec.engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] >= 0.8 * stats["num_draft_tokens"] > 0, stats
    drained_clean(spec)
