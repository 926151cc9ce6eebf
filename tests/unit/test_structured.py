"""Structured outputs in the engine (offline API): a grammar makes even a random-weight model obey.

The checkpoint has random weights and the real Qwen3 vocabulary and tokenizer: left alone it writes
gibberish, so every valid output below is the grammar's doing.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from support.engine_state import assert_drained, engine_core
from support.scripted import CHAIN, build_scripted_checkpoint
from mili import LLM, InvalidRequest, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["color", "count", "ok", "name", "tags", "inner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(qwen3_checkpoint):
    return LLM(str(qwen3_checkpoint("gqa4_realvocab")), dtype="float32")


def _run(llm, so: StructuredOutputsParams, seeds, max_tokens=300, prompt="Answer:"):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so) for s in seeds]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert_drained(llm)  # every page back
    return [o.outputs[0] for o in outs]


def _compiler(llm):
    """An xgrammar compiler for the engine's tokenizer and vocabulary, of our own: it checks texts independently."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(llm.get_tokenizer(), vocab_size=llm.engine.model_config.vocab_size)
    return xgrammar.GrammarCompiler(info)


def test_json_schema_every_seed_finishes_and_validates(llm):
    outs = _run(llm, StructuredOutputsParams(json=SCHEMA), range(12))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not one forced string


def test_unconstrained_output_of_this_model_is_not_json(llm):
    """The control: without a grammar the same requests are not valid JSON."""
    outs = llm.generate(["Answer:"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=40) for s in range(4)],
                        use_tqdm=False)
    for o in outs:
        with pytest.raises(ValueError):
            json.loads(o.outputs[0].text)


def test_regex_choice_and_grammar(llm):
    for o in _run(llm, StructuredOutputsParams(regex=r"[a-z]{3}-\d{2}"), range(6)):
        assert o.finish_reason == "stop" and re.fullmatch(r"[a-z]{3}-\d{2}", o.text), o.text
    choices = ["yes", "no", "not sure"]
    texts = {o.text for o in _run(llm, StructuredOutputsParams(choice=choices), range(8))}
    assert texts <= set(choices) and len(texts) > 1
    grammar = 'root ::= "(" digit ("+" digit){0,3} ")"\ndigit ::= [0-9]'
    for o in _run(llm, StructuredOutputsParams(grammar=grammar), range(6)):
        assert re.fullmatch(r"\(\d(\+\d){0,3}\)", o.text), o.text


def test_json_object_is_always_a_json_object_so_far(llm):
    """Any object: a random model may not close its strings within max_tokens, so each output is a
    complete object (finished: stop) or a valid prefix of one (length)."""
    import xgrammar

    outs = _run(llm, StructuredOutputsParams(json_object=True), range(6), max_tokens=60)
    checker = xgrammar.GrammarMatcher(_compiler(llm).compile_json_schema('{"type": "object"}', strict_mode=False))
    for o in outs:
        assert o.text.lstrip().startswith("{")
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:  # the text itself (not its tokens) is accepted by a fresh matcher of the grammar
            checker.reset()
            assert checker.accept_string(o.text), o.text


def test_bad_constraints_are_refused_by_name(llm):
    for so, words in [(StructuredOutputsParams(json={"type": "nope"}), "Unsupported type"),
                      (StructuredOutputsParams(regex="(ab"), "regular expression"),
                      (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar")]:
        with pytest.raises(InvalidRequest, match=words) as e:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidRequest):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    # a stop token id outside the vocabulary once reached xgrammar's matcher, whose failure stopped the engine
    vocab = llm.engine.inputs.model_config.vocab_size
    with pytest.raises(InvalidRequest, match="stop token ids") as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, stop_token_ids=[vocab], structured_outputs=
                                           StructuredOutputsParams(choice=["a"])), use_tqdm=False)
    assert e.value.param == "stop_token_ids"
    assert llm.generate(["x"], SamplingParams(max_tokens=4, stop_token_ids=[vocab - 1], structured_outputs=
                                              StructuredOutputsParams(choice=["a"])), use_tqdm=False)[0].outputs
    assert not llm.engine.has_unfinished_requests()


def test_n_greater_than_one_each_sequence_has_its_own_matcher(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    (out,) = llm.generate(["Answer:"], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_compiles_are_cached_by_spec_and_never_block_other_requests(llm, monkeypatch):
    """While a grammar compiles, unconstrained requests keep decoding; the same spec compiles once."""
    engine = llm.engine
    gate = threading.Event()
    import xgrammar

    real = xgrammar.GrammarCompiler.compile_grammar
    calls = []

    def slow_compile(self, grammar, *args, **kwargs):  # (the engine's compiles, in its compile thread)
        calls.append(grammar)
        gate.wait(30)
        return real(self, grammar, *args, **kwargs)

    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_grammar", slow_compile)
    so = StructuredOutputsParams(regex="[0-9]{4}-waiting")  # a spec not compiled before
    engine.add_request("a", SamplingParams(max_tokens=8, temperature=0, structured_outputs=so), "constrained-1")
    engine.add_request("a", SamplingParams(max_tokens=8, temperature=0, structured_outputs=so), "constrained-2")
    engine.add_request("b", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "free")
    done = {}
    for _ in range(6):
        for out in engine.step():
            done[out.request_id] = out
    assert done["free"].finished and len(done["free"].outputs[0].token_ids) == 6
    waited = time.monotonic()  # (the compile thread loads the tokenizer before it compiles: on a fast machine the
    while not calls and time.monotonic() - waited < 30:  # free request can finish first)
        time.sleep(0.01)
    assert "constrained-1" not in done and "constrained-2" not in done and len(calls) == 1
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert re.fullmatch(r"[0-9]{4}-waiting", done["constrained-1"].outputs[0].text)
    assert done["constrained-2"].outputs[0].text == done["constrained-1"].outputs[0].text  # greedy, same grammar
    assert len(calls) == 1  # one compile for both requests
    engine.check_integrity()


def test_abort_while_compiling_frees_everything(llm):
    engine = llm.engine
    so = StructuredOutputsParams(json={"type": "object", "properties": {"abort_me": {"type": "boolean"}}})
    engine.add_request("x", SamplingParams(max_tokens=8, structured_outputs=so), "to-abort")
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests() and not engine_core(engine).compiling
    engine.check_integrity()


def test_constraint_starts_after_thinking(tmp_path):
    """The scripted model thinks "<think>Let me think</think>" first; a choice constraint that starts
    after </think> leaves the thinking alone and then forces the answer (the model would say Hello!)."""
    llm = LLM(str(build_scripted_checkpoint(tmp_path / "scripted", CHAIN)), dtype="float32")
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (thinking,) = llm.chat(messages, params, use_tqdm=False)
    text = thinking.outputs[0].text
    assert text.startswith("<think>Let me think</think>") and text.split("</think>")[1].strip() in ("yes", "no")
    assert thinking.outputs[0].finish_reason == "stop"
    (free,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert free.outputs[0].text.endswith("Hello!")
    (off,) = llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    assert off.outputs[0].text in ("yes", "no")


def test_bounded_json_strings_refuse_control_characters(llm):
    """xgrammar 0.2.8 lets a tab into a string with maxLength; MILI's grammars do not (invalid JSON)."""
    import xgrammar

    from mili.structured import build_grammar

    compiled = _compiler(llm).compile_grammar(build_grammar("json", json.dumps({"type": "string", "maxLength": 5})))
    for text, valid in [('"ab"', True), ('"a\tb"', False), ('"a\nb"', False), ('"abcdef"', False)]:
        assert xgrammar.GrammarMatcher(compiled).accept_string(text) is valid, text


def test_trained_demo_ends_a_constrained_reply_by_itself():
    """The random model above ends only where a grammar's bounds force it to. The trained `demo` under an
    unbounded constraint (plain English characters, any length; the end of turn allowed anywhere) ends its
    reply itself: finish_reason stop, well before max_tokens, greedy and sampled. (It never saw JSON:
    inside an unbounded JSON string it does not write the closing quote, so JSON is not what this tests.)"""
    llm = LLM("demo", dtype="float32")
    pattern = r"[A-Za-z ,.;:'!?]+"
    so = StructuredOutputsParams(regex=pattern)
    prompts = [[{"role": "user", "content": p}] for p in
               ("Hello", "Who are you?", "Tell me about wisdom.", "What does John 3:16 say?")]
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs=so)] * 4
    params += [SamplingParams(temperature=0.7, seed=s, max_tokens=100, structured_outputs=so) for s in range(4)]
    outs = llm.chat(prompts * 2, params, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    for o in outs:
        o = o.outputs[0]
        assert o.finish_reason == "stop" and len(o.token_ids) < 100, o.text
        assert re.fullmatch(pattern, o.text) and re.search(r"[A-Za-z]{3}", o.text), o.text
