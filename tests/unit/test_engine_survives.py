"""One request never stops the engine.

- hypothesis drives the whole engine (torch and Triton attention backends, tight KV memory so requests
  are preempted) with SamplingParams drawn over their valid ranges and edges: every token is in the
  vocabulary, every request ends (an "error" only where no token could be sampled), and every KV page
  comes back.
- A failure that belongs to one request (its sampling, its sampled id, its grammar matcher, its
  detokenization) ends that request with an error; the requests beside it get exactly the tokens they
  get alone, and the engine goes on.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mili import LLM, SamplingParams
from mili.runtime.sampler import NO_TOKEN

from support.engine_state import assert_drained, runner_parts

VOCAB = 512  # the tiny checkpoint's
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
EXTREME = [0.0, 5e-324, 1e-45, 1e-5, 0.7, 1.0, 1e38, 1e39, math.inf]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    per_page = 2 * 2 * 16 * 2 * 32 * 4  # K+V, layers, page, kv heads, head_dim, float32
    return {backend: LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
                         kv_cache_memory=12 * per_page, attention_backend=backend)
            for backend in ("torch", "triton")}


def _assert_clean(llm):
    assert_drained(llm)


unit = st.one_of(st.sampled_from([5e-324, 1e-45, 0.5, 1.0]), st.floats(0, 1, exclude_min=True))


@st.composite
def request(draw):
    params = SamplingParams(
        n=draw(st.integers(1, 3)), max_tokens=draw(st.integers(1, 5)),
        temperature=draw(st.sampled_from(EXTREME)), top_p=draw(unit), min_p=draw(st.one_of(st.just(0.0), unit)),
        top_k=draw(st.sampled_from([-1, 1, 3, VOCAB, 10**6])),
        repetition_penalty=draw(st.sampled_from([x for x in EXTREME if x > 0])),
        presence_penalty=draw(st.sampled_from([-2.0, 0.0, 2.0])), frequency_penalty=draw(st.floats(-2, 2)),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))), ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
        logprobs=draw(st.sampled_from([None, 0, 3])))
    if draw(st.booleans()):  # min_tokens, up to max_tokens
        params.min_tokens = draw(st.integers(0, params.max_tokens))
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    return {"prompt_token_ids": prompt}, params


def _serve_any(engines, backend, batch):
    llm = engines[backend]
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    for out, (_, params) in zip(outs, batch):
        assert out.finished and len(out.outputs) == params.n
        for o in out.outputs:
            assert o.finish_reason in ("stop", "length"), (o.finish_reason, out.error)
            assert all(0 <= t < VOCAB for t in o.token_ids)
            assert len(o.token_ids) <= params.max_tokens
            if o.logprobs is not None:
                assert all(not math.isnan(lp.logprob) for entry in o.logprobs for lp in entry.values())
    _assert_clean(llm)


_HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=25, deadline=None, suppress_health_check=_HEALTH)
@given(batch=st.lists(request(), min_size=1, max_size=4))
def test_any_params_are_served_and_every_page_comes_back(engines, batch):
    _serve_any(engines, "torch", batch)


@settings(max_examples=3, deadline=None, suppress_health_check=_HEALTH)  # (the interpreter is slow)
@given(batch=st.lists(request(), min_size=1, max_size=3))
def test_any_params_are_served_on_the_triton_path(engines, batch):
    _serve_any(engines, "triton", batch)


# -- a failure of one request's own ends that request alone ---------------------------------------------------
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
MARK = 0.123  # the temperature that marks the request a fault is injected into (its tokens are never compared)


def _with_marked(params_marked: SamplingParams):
    return [GREEDY, params_marked, GREEDY]


def _check(llm, outs, alone, message, monkeypatch):
    assert outs[1].finished and outs[1].error is not None and message in outs[1].error, outs[1].error
    assert all(o.finish_reason == "error" for o in outs[1].outputs)
    for k in (0, 2):
        assert outs[k].error is None and outs[k].outputs[0].token_ids == alone[k].outputs[0].token_ids
    _assert_clean(llm)
    # the engine goes on: the same batch again, with no fault, is served whole
    monkeypatch.undo()
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in alone]
    _assert_clean(llm)


@pytest.fixture
def llm(engines):
    return engines["torch"]


@pytest.fixture
def alone(llm):
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_a_row_whose_sampling_raises_fails_alone(llm, alone, monkeypatch):
    sampler = runner_parts(llm).sampler
    real = type(sampler).__call__

    def failing(self, logits, meta):
        if meta.temperature is not None and bool((meta.temperature == MARK).any()):
            raise RuntimeError("injected sampling fault")
        return real(self, logits, meta)

    monkeypatch.setattr(type(sampler), "__call__", failing)
    marked = SamplingParams(temperature=MARK, max_tokens=6, ignore_eos=True, n=2)
    outs = llm.generate(PROMPTS, _with_marked(marked), use_tqdm=False)
    _check(llm, outs, alone, "injected sampling fault", monkeypatch)


@pytest.mark.parametrize("bad", [VOCAB, 10**9, -5, NO_TOKEN])
def test_a_token_outside_the_vocabulary_is_never_fed_back(llm, alone, monkeypatch, bad):
    sampler = runner_parts(llm).sampler
    real = type(sampler).__call__

    def wrong_ids(self, logits, meta):
        out = real(self, logits, meta)
        for row in meta.random_rows.tolist():  # only the marked request samples at random
            out.token_ids[row] = bad
        return out

    monkeypatch.setattr(type(sampler), "__call__", wrong_ids)
    outs = llm.generate(PROMPTS, _with_marked(SamplingParams(temperature=MARK, max_tokens=6, ignore_eos=True)),
                        use_tqdm=False)
    expected = "no token could be sampled" if bad == NO_TOKEN else f"token id {bad} is outside"
    _check(llm, outs, alone, expected, monkeypatch)


def test_a_grammar_matcher_that_raises_fails_its_request_alone(llm, alone, monkeypatch):
    from mili.sampling_params import StructuredOutputsParams
    from mili.structured import SeqGrammar

    def broken(self, token):
        raise RuntimeError("injected matcher fault")

    monkeypatch.setattr(SeqGrammar, "accept", broken)
    marked = SamplingParams(temperature=0.0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    outs = llm.generate(PROMPTS, _with_marked(marked), use_tqdm=False)
    _check(llm, outs, alone, "injected matcher fault", monkeypatch)


def test_a_bitmask_fill_that_raises_fails_its_request_alone(llm, alone, monkeypatch):
    """The batch's bitmask fill fails: the rows are sampled one by one, and the row whose grammar's own fill
    fails ends; the others' tokens stand."""
    from mili.sampling_params import StructuredOutputsParams
    from mili.structured import GrammarManager, SeqGrammar

    def broken(*args, **kwargs):
        raise RuntimeError("injected bitmask fault")

    monkeypatch.setattr(GrammarManager, "_fill", broken)
    monkeypatch.setattr(SeqGrammar, "next_token_bitmask", broken)
    marked = SamplingParams(temperature=0.0, max_tokens=6,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    outs = llm.generate(PROMPTS, _with_marked(marked), use_tqdm=False)
    _check(llm, outs, alone, "injected bitmask fault", monkeypatch)


def test_a_detokenizer_that_raises_fails_its_request_alone(llm, alone, monkeypatch):
    from mili.tokenizer.detokenizer import TextStream

    real = TextStream.append

    def broken(self, token):
        if self.num_prompt_tokens == 17:  # the marked request's prompt
            raise UnicodeError("injected detokenizer fault")
        return real(self, token)

    monkeypatch.setattr(TextStream, "append", broken)
    outs = llm.generate(PROMPTS, _with_marked(GREEDY), use_tqdm=False)
    _check(llm, outs, alone, "injected detokenizer fault", monkeypatch)


def test_the_reported_request_is_served(llm):
    """temperature 1e39 with min_tokens (the request that stopped the engine): tokens of the vocabulary."""
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=1e39, max_tokens=16, min_tokens=4),
                       use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) >= 4
    assert all(0 <= t < VOCAB for t in out.outputs[0].token_ids)
    _assert_clean(llm)
