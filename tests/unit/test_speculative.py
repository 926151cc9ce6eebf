"""Speculative decoding (n-gram prompt lookup): the same output as without it, for dense Qwen3 and the hybrids,
through chunked prefill, batching with sequences that draft nothing, preemption, prefix-cache hits, penalties,
logprobs, stop strings, n, structured outputs and seeds; drafts that are always right on scripted checkpoints;
the sampler's verification keeping the distribution (chi-square); counters; refusals by name."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from support.engine_state import assert_drained, engine_core, runner_parts
from support.hybrid import build_scripted_hybrid_checkpoint
from support.scripted import build_scripted_checkpoint
from mili import LLM, InvalidRequest, SamplingParams, StructuredOutputsParams
from mili.config import EngineConfig, SpeculativeConfig
from mili.runtime.sampler import Sampler, SamplingMetadata
from mili.sampling_params import SamplingParams as Params
from mili.speculative.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}


def drained_clean(llm) -> None:
    """Nothing runs; every page and state slot is free or idle in the prefix cache."""
    assert_drained(llm)


def repetitive_prompts(vocab: int, n: int = 10, seed: int = 0) -> list[dict]:
    """Prompts that repeat a random phrase (the n-gram finds drafts) and plain random ones (it finds fewer)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        phrase = torch.randint(0, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        tail = torch.randint(0, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        prompts.append({"prompt_token_ids": (phrase * 5 + tail + phrase) if i % 3 else tail})
    return prompts


def spec_outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in out.outputs] for out in outs]


def assert_same_outputs(want, got) -> None:
    for w, g in zip(want, got, strict=True):
        for (w_ids, w_text, w_reason, w_lps), (g_ids, g_text, g_reason, g_lps) in zip(w, g, strict=True):
            assert g_ids == w_ids and g_text == w_text and g_reason == w_reason
            if w_lps is not None:  # the same tokens scored at the same positions (float32: same values)
                for a, b in zip(w_lps, g_lps, strict=True):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


# -- the pieces --------------------------------------------------------------------------------------------
def test_config_is_checked_by_name():
    config = EngineConfig("x", speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert config.speculative_config == SpeculativeConfig("ngram", 2, prompt_lookup_max=4, prompt_lookup_min=1)
    for bad, words in [("{", "not valid JSON"), ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram"}, "needs num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "positive"),
                       ({"method": "ngram", "num_speculative_tokens": 99}, "at most 15"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown field"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
                         "prompt_lookup_max": 2}, "exceeds")]:
        with pytest.raises(InvalidRequest, match=words) as e:
            EngineConfig("x", speculative_config=bad)
        assert e.value.param == "speculative_config"


def test_mtp_without_an_mtp_head_is_refused_before_loading(tiny_checkpoint):
    with pytest.raises(InvalidRequest, match=r"mtp needs the checkpoint's MTP head \(mtp\.\* tensors"):
        LLM(str(tiny_checkpoint), speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_ngram_proposer_takes_the_longest_recurring_suffix():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # the suffix 1 2 3 recurs: what followed it
    assert p.propose([5, 1, 2, 9, 7, 2, 8, 1, 2], 2) == [9, 7]  # "1 2" beats the later lone "2"
    assert p.propose([1, 2, 3, 4, 5], 2) == []  # nothing recurs
    assert p.propose([4, 1, 9, 4, 2, 4], 2) == [2, 4]  # the latest occurrence
    assert NgramProposer(2, 2).propose([1, 2, 3, 1], 3) == []  # "3 1" never occurred before
    assert p.propose([1, 2, 1, 2], 0) == []
    # a match next to the end copies on over its own draft: a repeated token, a short cycle
    assert p.propose([9, 5, 5, 5, 5], 3) == [5, 5, 5]
    assert p.propose([9, 1, 2, 1, 2], 4) == [1, 2, 1, 2]


# -- the sampler's verification keeps the distribution -----------------------------------------------------
@pytest.mark.parametrize("draft", [0, 3, 5])  # the likeliest token, a middling one, one top-k removes
def test_verified_draws_follow_the_target_distribution(draft):
    """A row verifying a draft d draws d with probability p(d), else from p without d: the tokens follow p,
    whatever d is (chi-square over 30,000 rows, temperature and top-k applied as without drafts)."""
    torch.manual_seed(0)
    vocab, rows = 8, 30_000
    logits = torch.tensor([2.0, 1.2, 0.9, 0.5, 0.1, -0.3, -1.0, -2.0])
    params = Params(temperature=0.8, top_k=5)
    meta = SamplingMetadata.build([params] * rows, [None] * rows, [[]] * rows, [[]] * rows, vocab,
                                  torch.device("cpu"), drafts=[draft] * rows)
    tokens = torch.tensor(Sampler()(logits.expand(rows, vocab).clone(), meta).token_ids)
    scaled = logits / 0.8
    scaled[scaled < scaled.topk(5).values[-1]] = float("-inf")
    p = scaled.double().softmax(-1)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[p == 0].sum() == 0  # never a token top-k removed, draft or not
    keep = p > 0
    assert chisquare(counts[keep].numpy(), (p[keep] / p[keep].sum() * counts.sum()).numpy()).pvalue > 1e-3


def test_seeded_rows_verify_reproducibly():
    torch.manual_seed(0)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    logits = torch.randn(1, 50)
    draws = []
    for gen in (g1, g2):
        meta = SamplingMetadata.build([Params(temperature=1.0, seed=7)] * 1, [gen], [[]], [[]], 50, torch.device("cpu"),
                                      drafts=[int(logits.argmax())])
        draws.append([Sampler()(logits.clone(), meta).token_ids[0] for _ in range(20)])
    assert draws[0] == draws[1]


# -- the engine: the same output, dense and hybrid ----------------------------------------------------------
def spec_params(vocab_text: str | None = None):
    """Greedy with and without the sampling extras that read the output so far."""
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, repetition_penalty=1.4,
                           presence_penalty=0.3, frequency_penalty=0.2),
            SamplingParams(temperature=0, max_tokens=30, min_tokens=20)]


def _oracle(llm, prompts, want, vocab: int) -> None:
    """Make ``llm``'s drafter propose the plain run's own continuation, wrong at every third step's second
    position: drafts wholly accepted, partly accepted and rejected, whatever the model is."""
    truth = {tuple(p["prompt_token_ids"]): w[0][0] for p, w in zip(prompts, want)}
    calls = iter(range(10**9))

    def propose(seq, k):
        done = seq.num_tokens - seq.prompt_len
        draft = list(truth[tuple(seq.token_ids[:seq.prompt_len])][done:done + k])
        if next(calls) % 3 == 1 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % vocab
        return draft

    engine_core(llm).drafter.propose = propose


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_greedy_output_is_unchanged(model, tiny_checkpoint, hybrid_checkpoint):
    """Chunked prefill (a 48-token budget), a batch where some sequences draft and others cannot, prefix-cache
    hits (every prompt twice), then preemption (few pages): the same tokens, text and logprobs as without
    speculation, with the n-gram's drafts and with drafts that are right, partly right and wrong; every page
    and state slot back."""
    path = str(tiny_checkpoint if model == "dense" else hybrid_checkpoint("qwen3_5"))
    base = dict(dtype="float32", max_num_batched_tokens=48)
    vocab = 512 if model == "dense" else 256
    prompts = repetitive_prompts(vocab)
    params = [spec_params()[i % 3] for i in range(len(prompts))]
    want = spec_outputs(LLM(path, **base), prompts, params)
    spec = LLM(path, **base, speculative_config=NGRAM)
    for _ in range(2):  # the second time through, the prompts hit the prefix cache
        assert_same_outputs(want, spec_outputs(spec, prompts, params))
        drained_clean(spec)
    assert spec.engine.spec_decode_stats()["num_drafts"] > 20
    _oracle(spec, prompts, want, vocab)
    before = spec.engine.spec_decode_stats()
    assert_same_outputs(want, spec_outputs(spec, prompts, params))
    drained_clean(spec)
    stats = spec.engine.spec_decode_stats()
    accepted, drafted = (stats[k] - before[k] for k in ("num_accepted_tokens", "num_draft_tokens"))
    assert 0.5 * drafted < accepted < drafted, stats
    tight = LLM(path, **base, num_kv_pages=14 if model == "dense" else 10, speculative_config=NGRAM,
                **({"num_state_slots": 4} if model == "hybrid" else {}))
    _oracle(tight, prompts, want, vocab)
    assert_same_outputs(want, spec_outputs(tight, prompts, params))
    assert tight.engine.stats().num_preemptions > 0
    drained_clean(tight)


def test_stop_strings_n_and_seeds(tiny_checkpoint):
    """A stop string cuts the text where it does without speculation; n = 3 seeded sequences repeat exactly
    from run to run (speculation draws its own uniforms, so not the plain run's tokens: the distribution is
    the same, the stream is not)."""
    prompts = repetitive_prompts(512, n=4, seed=3)
    plain, spec = LLM(str(tiny_checkpoint), dtype="float32"), LLM(str(tiny_checkpoint), dtype="float32",
                                                                 speculative_config=NGRAM)
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=30, stop=[o.outputs[0].text[8:12]]) for o in free]
    assert_same_outputs(spec_outputs(plain, prompts, params), spec_outputs(spec, prompts, params))
    seeded = SamplingParams(temperature=0.8, top_p=0.9, n=3, seed=11, max_tokens=20, ignore_eos=True)
    first, second = (spec_outputs(spec, prompts, seeded) for _ in range(2))
    assert first == second
    assert spec.engine.spec_decode_stats()["num_accepted_tokens"] > 0
    drained_clean(spec)


def test_structured_outputs_reject_drafts_the_grammar_forbids(qwen3_checkpoint):
    """Drafts copied from a prompt full of non-JSON text are verified against the grammar's mask: the greedy
    constrained output is the plain one, and sampled outputs still validate."""
    import json

    path = str(qwen3_checkpoint("gqa4_realvocab"))
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"], "additionalProperties": False})
    prompt = 'x {"a": 1} {"a": 1} {"a": 1} {"a": 1} {"a'
    greedy = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    plain, spec = LLM(path, dtype="float32"), LLM(path, dtype="float32", speculative_config=NGRAM)
    assert_same_outputs(spec_outputs(plain, [prompt], [greedy]), spec_outputs(spec, [prompt], [greedy]))
    outs = spec.generate([prompt] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=so)
                                        for s in range(6)], use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        assert isinstance(json.loads(o.outputs[0].text)["a"], int)
    assert spec.engine.spec_decode_stats()["num_drafts"] > 0
    drained_clean(spec)


# -- scripted checkpoints: drafts always right -------------------------------------------------------------
CYCLE = {1000: 2000, 2000: 3000, 3000: 4000, 4000: 1000}  # the greedy next token cycles through four ids


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_scripted_checkpoints_accept_almost_every_draft(model, tmp_path):
    """A model whose next token is a fixed function of the current one repeats a cycle; once the cycle has
    appeared, every n-gram draft is right: acceptance >= 80% in the counters, the output unchanged, and a
    verifying step emits k + 1 tokens."""
    build = build_scripted_checkpoint if model == "dense" else build_scripted_hybrid_checkpoint
    path = str(build(tmp_path / model, CYCLE))
    prompt = [{"prompt_token_ids": [1000, 2000, 3000, 4000, 1000]}]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = spec_outputs(LLM(path, dtype="float32"), prompt, params)
    spec = LLM(path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert_same_outputs(want, spec_outputs(spec, prompt, params))
    stats = spec.engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] >= 0.8 * stats["num_draft_tokens"] > 0, stats
    assert stats["num_drafts"] <= 64 / 4 + 1  # about 4 tokens a step
    drained_clean(spec)


def test_speculation_stops_above_its_batch_size(tiny_checkpoint):
    prompts = repetitive_prompts(512, n=6)
    spec = LLM(str(tiny_checkpoint), dtype="float32", speculative_config={**NGRAM, "disable_by_batch_size": 5})
    spec.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert spec.engine.spec_decode_stats()["num_drafts"] == 0  # six running: off
    spec.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert spec.engine.spec_decode_stats()["num_drafts"] > 0


@pytest.mark.skipif(not __import__("mili.kernels.cpu", fromlist=["x"]).available(), reason="needs AVX-512")
def test_bf16_verifications_run_fused_and_match_plain_decoding_bit_for_bit(tiny_checkpoint):
    """On the CPU's kernels a verification runs in the fused decode layer, a row per token attending up to
    its own position as its decode step would: bf16 greedy tokens and logprobs equal plain decoding's
    exactly (drafts right, partly right and wrong)."""
    path = str(tiny_checkpoint)
    prompts = repetitive_prompts(512, n=6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    want = spec_outputs(LLM(path, dtype="bfloat16"), prompts, params)
    spec = LLM(path, dtype="bfloat16", speculative_config=NGRAM)
    runner = runner_parts(spec).cpu_decode
    assert runner is not None
    fused, run = [], runner.run

    def spy(batch, kv, verifying=False):
        hidden = run(batch, kv, verifying)
        fused.append(hidden is not None and batch.num_decodes < batch.num_seqs)  # (a verification in it)
        return hidden

    runner.run = spy
    _oracle(spec, prompts, want, 512)
    got = spec_outputs(spec, prompts, params)
    assert got == want
    assert sum(fused) >= 4  # the steps with verifications (about 20 tokens / 4 a step) ran fused
    drained_clean(spec)


def test_the_trained_demo_accepts_most_ngram_drafts_on_scripture():
    """The trained `demo` continuing held-out chapters repeats their phrases ("the children of Israel", "the
    son of ..."), as its corpus does: most n-gram drafts are accepted (102 of 147 measured), the output is
    the plain one. (The random checkpoints above accept almost none of the n-gram's own drafts.)"""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "data" / "demo" / "heldout.txt").read_text()
    prompts = [text[i:i + 1200] for i in range(1500, 9000, 1500)][:4]
    params = SamplingParams(temperature=0, max_tokens=48)
    spec = LLM("demo", dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_min": 2})
    assert_same_outputs(spec_outputs(LLM("demo", dtype="float32"), prompts, params),
                        spec_outputs(spec, prompts, params))
    stats = spec.engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] >= 0.6 * stats["num_draft_tokens"] > 40, stats
    drained_clean(spec)


def test_verifications_on_the_triton_backend(tiny_checkpoint):
    """The Triton kernels (the CUDA path, here under TRITON_INTERPRET=1) take a verification as a short chunk:
    the same greedy tokens as the torch backend without speculation."""
    prompts = repetitive_prompts(512, n=2, seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = spec_outputs(LLM(str(tiny_checkpoint), dtype="float32"), prompts, params)
    spec = LLM(str(tiny_checkpoint), dtype="float32", attention_backend="triton", speculative_config=NGRAM)
    _oracle(spec, prompts, want, 512)
    assert_same_outputs(want, spec_outputs(spec, prompts, params))
    assert spec.engine.spec_decode_stats()["num_accepted_tokens"] > 0
    drained_clean(spec)
