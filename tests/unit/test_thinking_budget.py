"""A thinking budget (``SamplingParams.thinking_token_budget``) on scripted checkpoints that would think forever:
the reasoning stops after exactly the budget's tokens, the budget's message and ``</think>`` are forced, and the
model's answer follows; token for token, with n-gram and MTP drafts, the async loop asked for, ``n > 1``, and on
a Qwen3.5 hybrid."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mili import LLM, SamplingParams
from mili.errors import InvalidRequest

from support.checkpoints import QWEN3_TOKENIZER
from support.engine_state import assert_drained
from support.hybrid import build_scripted_hybrid_checkpoint
from support.scripted import build_scripted_checkpoint

THINK, END, NL, HELLO, BANG, EOS = 151667, 151668, 198, 9707, 0, 151645
A, B = 10061, 752  # "Let", " me": the thinking loops on them
# after "\n" the model opens <think>, then thinks A B A B ... forever; after </think> it answers "\n\nHello!"
FOREVER = {NL: THINK, THINK: A, A: B, B: A, END: 271, 271: HELLO, HELLO: BANG, BANG: EOS}
ANSWER = [END, 271, HELLO, BANG, EOS]
MESSAGE = " Time is up."


@pytest.fixture(scope="module")
def forever(tmp_path_factory):
    return build_scripted_checkpoint(tmp_path_factory.mktemp("think") / "forever", FOREVER)


@pytest.fixture(scope="module")
def llm(forever):
    return LLM(str(forever), dtype="float32")


def _thinking(n: int) -> list[int]:
    return [A, B] * (n // 2) + [A] * (n % 2)


def _run(llm, prompt: list[int], **params) -> list[list[int]]:
    sp = SamplingParams(**{"temperature": 0, "max_tokens": 200, **params})
    outs = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    assert_drained(llm)
    return [list(o.token_ids) for o in outs[0].outputs]


def test_the_model_thinks_forever_without_a_budget(llm):
    out = _run(llm, [100, NL], max_tokens=50)[0]
    assert out == [THINK] + _thinking(49)


@pytest.mark.parametrize("budget", [0, 1, 7, 64])
def test_the_budget_ends_thinking_exactly(llm, budget):
    """Qwen3's way (the model writes <think>): exactly ``budget`` tokens after it, then </think> forced."""
    assert _run(llm, [100, NL], thinking_token_budget=budget)[0] == [THINK] + _thinking(budget) + ANSWER


def test_a_prompt_that_opened_the_thinking_counts_from_its_first_token(llm):
    """Qwen3.5's templates end the prompt inside <think>: the budget counts from the first generated token."""
    assert _run(llm, [100, NL, THINK], thinking_token_budget=5)[0] == _thinking(5) + ANSWER
    assert _run(llm, [100, NL, THINK], thinking_token_budget=0)[0] == ANSWER
    # a prompt whose thinking is closed already (an earlier turn's, or thinking off): the budget waits for <think>
    assert _run(llm, [THINK, A, END, 100, NL], thinking_token_budget=3)[0] == [THINK] + _thinking(3) + ANSWER


def test_the_message_is_forced_before_the_end(llm):
    forced = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER).encode(MESSAGE, add_special_tokens=False)
    out = _run(llm, [100, NL], thinking_token_budget=4, thinking_budget_message=MESSAGE)[0]
    assert out == [THINK] + _thinking(4) + forced + ANSWER
    assert llm.generate([{"prompt_token_ids": [100, NL]}],
                        SamplingParams(temperature=0, max_tokens=200, thinking_token_budget=4,
                                       thinking_budget_message=MESSAGE), use_tqdm=False)[0].outputs[0].text == (
        "<think>Let meLet me Time is up.</think>\n\nHello!")


def test_each_of_n_sequences_has_its_own_budget_and_sampling_keeps_to_it(llm):
    outs = _run(llm, [100, NL], thinking_token_budget=6, n=3, temperature=0.5, seed=3)
    assert outs == [[THINK] + _thinking(6) + ANSWER] * 3  # (the scripted margin makes sampling pick the chain)


def test_ngram_drafts_never_cross_the_budget(forever):
    """The thinking loop is what n-gram drafting predicts best: drafts are accepted, the output is the same."""
    spec = LLM(str(forever), dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    for budget in (0, 3, 21, 64):
        assert _run(spec, [100, NL], thinking_token_budget=budget)[0] == [THINK] + _thinking(budget) + ANSWER
    stats = spec.engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] > 20, stats


def test_async_scheduling_asked_for_runs_budgeted_requests_in_turn(forever):
    overlap = LLM(str(forever), dtype="float32", async_scheduling="on")
    mixed = overlap.generate([{"prompt_token_ids": [100, NL]}] * 2,
                             [SamplingParams(temperature=0, max_tokens=40),
                              SamplingParams(temperature=0, max_tokens=200, thinking_token_budget=9)],
                             use_tqdm=False)
    assert list(mixed[0].outputs[0].token_ids) == [THINK] + _thinking(39)
    assert list(mixed[1].outputs[0].token_ids) == [THINK] + _thinking(9) + ANSWER
    assert_drained(overlap)


def test_a_hybrid_with_mtp_drafts_keeps_to_the_budget(tmp_path):
    path = str(build_scripted_hybrid_checkpoint(tmp_path / "forever-hybrid", FOREVER, mtp=True))
    plain = LLM(path, dtype="float32")
    spec = LLM(path, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    for llm in (plain, spec):
        for budget in (2, 17):
            assert _run(llm, [100, NL], thinking_token_budget=budget)[0] == [THINK] + _thinking(budget) + ANSWER
    assert spec.engine.spec_decode_stats()["num_accepted_tokens"] > 0


def test_bad_budgets_are_refused_by_name(llm, tiny_checkpoint):
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidRequest, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)
    with pytest.raises(InvalidRequest, match="thinking_budget_message"):
        SamplingParams(thinking_budget_message=3)
