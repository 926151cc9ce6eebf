"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' log_softmax over the prompt, in
float32: chunked prefill, slices of rows, batches, n > 1, max_tokens 0, a cached prefix, a preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM as HFQwen3

from mili import LLM, SamplingParams
from mili.engine.scheduler import Scheduler
from mili.errors import InvalidRequest
from mili.kernels import cpu as cpu_kernels
from mili.runtime import prompt_logprobs as plp
from mili.runtime.plan import StepKind

from support.engine_state import assert_drained, model_runner

TOL = 1e-4
TIE = 1e-4  # top-N ids may differ from HF's only between alternatives closer than this


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_HF = {}


def _reference(path, prompt: list[int]) -> torch.Tensor:
    """HF's float32 log_softmax at every prompt position: row p scores token p + 1."""
    if path not in _HF:
        _HF[path] = HFQwen3.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _HF[path](torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def _check(entries, prompt: list[int], ref: torch.Tensor, n: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row, token, entry = ref[i - 1], prompt[i], entries[i]
        target = row[token].item()
        assert entry[token].logprob == pytest.approx(target, abs=TOL), (i, token)
        assert entry[token].decoded_token is not None
        # its rank, up to ties with it
        assert int((row > target + TIE).sum()) + 1 <= entry[token].rank <= int((row >= target - TIE).sum())
        for t, lp in entry.items():  # every alternative's value is HF's for that id
            assert lp.logprob == pytest.approx(row[t].item(), abs=TOL)
        ours = sorted(entry, key=lambda t: entry[t].rank)[:n]
        ref_vals, ref_ids = row.topk(n)
        assert len(ours) == n and len(entry) == n + (token not in ours)
        for ours_id, ref_id in zip(ours, ref_ids.tolist()):
            assert ours_id == ref_id or abs(row[ours_id] - row[ref_id]) < TIE, (i, ours_id, ref_id)


@pytest.mark.parametrize("shape,slice_rows", [("gqa_untied", 5), ("mha_tied", None)])
def test_prompt_logprobs_match_hf(qwen3_checkpoint, monkeypatch, shape, slice_rows):
    """Several requests of different lengths, chunked (32 tokens a step) and batched together, one with n=2;
    ``slice_rows`` (gqa_untied) makes the logits come a few rows at a time."""
    path = str(qwen3_checkpoint(shape))
    slices = []
    if slice_rows is not None:
        monkeypatch.setattr(plp, "MAX_SLICE_ROWS", slice_rows)
    call = plp.PromptScorer.__call__
    monkeypatch.setattr(plp.PromptScorer, "__call__", lambda self, first, logits: (slices.append(logits.shape[0]),
                                                                                 call(self, first, logits)))
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, page_size=8)
    prompts = [_prompt(n, seed) for seed, n in enumerate([1, 2, 45, 150, 77])]
    num_top = [3, 0, 2, 5, 1]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=k, n=1 + (i == 2))
              for i, k in enumerate(num_top)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt, k in zip(outs, prompts, num_top):
        _check(out.prompt_logprobs, prompt, _reference(path, prompt), k)
        assert out.num_cached_tokens == 0
    assert len(outs[2].outputs) == 2
    assert sum(slices) == sum(len(p) - 1 for p in prompts)  # each position scored once
    assert max(slices) <= (slice_rows or 32) and len(slices) > len(prompts)
    # the sampled tokens are those of the same requests without prompt logprobs
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)
    llm.engine.check_integrity()


def test_cached_prefix_is_recomputed(qwen3_checkpoint):
    """A request sharing a long cached prefix still scores every position (no cache hit), identically; its
    pages go into the cache for the requests after it."""
    path = str(qwen3_checkpoint("gqa_untied"))
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, page_size=8)
    prefix = _prompt(120, 7)
    prompt = prefix + _prompt(9, 8)
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    (cold,) = llm.generate({"prompt_token_ids": prompt}, scoring, use_tqdm=False)
    (other,) = llm.generate({"prompt_token_ids": prefix + _prompt(5, 9)}, SamplingParams(max_tokens=1),
                            use_tqdm=False)
    assert other.num_cached_tokens == 120  # the prefix is cached
    (warm,) = llm.generate({"prompt_token_ids": prompt}, scoring, use_tqdm=False)
    assert warm.num_cached_tokens == 0
    assert [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in warm.prompt_logprobs] \
        == [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in cold.prompt_logprobs]
    _check(warm.prompt_logprobs, prompt, _reference(path, prompt), 2)
    (plain,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.num_cached_tokens == 128  # all but the last token: it inserted its pages
    llm.engine.check_integrity()


def test_max_tokens_zero_scores_without_generating(qwen3_checkpoint):
    path = str(qwen3_checkpoint("gqa_untied"))
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, page_size=8)
    prompts = [_prompt(70, 3), _prompt(1, 4), _prompt(20, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=0, prompt_logprobs=1, n=2), use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        assert out.finished and len(out.outputs) == 2
        assert all(o.token_ids == [] and o.text == "" and o.finish_reason == "length" for o in out.outputs)
        _check(out.prompt_logprobs, prompt, _reference(path, prompt), 1)
    assert llm.engine.stats().num_generated_tokens == 0
    assert_drained(llm)
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequest):
        SamplingParams(prompt_logprobs=21)


def test_preempted_request_scores_each_position_once(qwen3_checkpoint, monkeypatch):
    """A small pool: a long decode preempts the scoring request mid-prompt, and the cache later gives back
    less than it had scored; the positions scored before are computed again but not sent twice."""
    path = str(qwen3_checkpoint("gqa_untied"))
    starts = []  # (computed from the cache, scored) each time the scoring request (re)starts
    # reach-in: where a (re)started sequence resumes: the preemption this test needs is seen nowhere else
    start = Scheduler._start_from_cache

    def spy(self, seq):
        fresh = not seq.page_table
        start(self, seq)
        if fresh and seq.params.prompt_logprobs is not None:
            starts.append((seq.num_computed_tokens, seq.request.num_scored))

    monkeypatch.setattr(Scheduler, "_start_from_cache", spy)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, page_size=16, num_kv_pages=16, max_model_len=256)
    decode, scored = _prompt(180, 11), _prompt(100, 12)
    outs = llm.generate([{"prompt_token_ids": decode}, {"prompt_token_ids": scored}],
                        [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)], use_tqdm=False)
    assert llm.engine.stats().num_preemptions >= 1
    assert any(0 < computed < num_scored for computed, num_scored in starts), starts
    _check(outs[1].prompt_logprobs, scored, _reference(path, scored), 1)
    llm.engine.check_integrity()


def _score(llm: LLM, decode: list[int], scored: list[int]):
    """A long decode beside a prompt being scored; the scored request's prompt logprobs."""
    outs = llm.generate([{"prompt_token_ids": decode}, {"prompt_token_ids": scored}],
                        [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)], use_tqdm=False)
    llm.engine.check_integrity()
    return outs[1].prompt_logprobs


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels unavailable: {cpu_kernels.load()[1]}")
def test_one_token_chunks_on_the_fused_cpu_decode_path(qwen3_checkpoint):
    """bf16 on MILI's CPU kernels, a budget of 2 tokens: beside a decode the prompt comes one token a step,
    so each step is a decode-only batch the fused decode path runs, prompt rows and all; its scores are the
    module path's (enforce_eager), bit for bit."""
    path = str(qwen3_checkpoint("gqa_untied"))
    fused = LLM(path, dtype="bfloat16", max_num_batched_tokens=2)
    runner = model_runner(fused)
    assert runner.parts.cpu_decode is not None
    ran = []  # per fused step: how many prompt rows it scored
    run = runner.parts.cpu_decode.run

    def spy(batch, kv, *rest):
        hidden = run(batch, kv, *rest)
        if hidden is not None:
            ran.append(batch.num_prompt_rows)
        return hidden

    runner.parts.cpu_decode.run = spy
    decode, scored = _prompt(3, 21), _prompt(20, 22)
    got = _score(fused, decode, scored)
    assert sum(ran) == len(scored) - 1  # every prompt position scored on the fused path
    eager = LLM(path, dtype="bfloat16", max_num_batched_tokens=2, enforce_eager=True)
    assert eager.engine.plan.step is StepKind.EAGER
    expected = _score(eager, decode, scored)
    assert [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in got] \
        == [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in expected]


def test_triton_backend(qwen3_checkpoint):
    """The Triton attention path (interpreted on the CPU) scores prompts like HF."""
    pytest.importorskip("triton")
    path = str(qwen3_checkpoint("gqa_untied"))
    llm = LLM(path, dtype="float32", attention_backend="triton", max_num_batched_tokens=24)
    prompts = [_prompt(n, 30 + n) for n in (9, 40)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        _check(out.prompt_logprobs, prompt, _reference(path, prompt), 2)
    llm.engine.check_integrity()


def test_tensor_parallel_two_ranks(qwen3_checkpoint):
    """TP=2 (gloo, a rank process): rank 0 scores, both ranks gather each slice's vocabulary shards; a
    1000-token prompt in one chunk comes in two slices (512 rows at most)."""
    path = str(qwen3_checkpoint("mha_tied"))
    llm = LLM(path, dtype="float32", max_num_batched_tokens=1100, tensor_parallel_size=2)
    try:
        prompts = [_prompt(1000, 40), _prompt(37, 41)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
        for out, prompt in zip(outs, prompts):
            _check(out.prompt_logprobs, prompt, _reference(path, prompt), 3)
        llm.engine.check_integrity()
    finally:
        llm.engine.shutdown()
