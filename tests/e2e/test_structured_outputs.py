"""Tool calls and structured outputs through a real `mili serve`, with the official openai client.

The random-weight checkpoint (real Qwen3 vocabulary, tokenizer and template) writes gibberish unless a
grammar holds it; the scripted one writes a `<tool_call>` block of its own accord (tool_choice auto).
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from support.checkpoints import QWEN3_TOKENIZER
from support.scripted import build_scripted_checkpoint, script_text
from support.server import openai_client

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "stormy"]},
        "level": {"type": "integer", "minimum": 1, "maximum": 10},
        "windy": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 6}, "maxItems": 3},
        "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                  "required": ["lat"], "additionalProperties": False},
    },
    "required": ["mood", "level", "windy", "note", "days", "where"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def test_json_schema_many_seeds_all_stop_parse_and_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    texts = set()
    for seed in range(10):
        r = client.chat.completions.create(model="test", messages=MSGS, temperature=1.0, seed=seed, max_tokens=300,
                                           response_format=fmt, extra_body=NO_THINK)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        texts.add(choice.message.content)
    assert len(texts) > 1


def test_json_object(client):
    r = client.chat.completions.create(model="test", messages=MSGS, temperature=1.0, seed=0, max_tokens=40,
                                       response_format={"type": "json_object"}, extra_body=NO_THINK)
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_vllm_guided_fields_on_completions_and_chat(client):
    r = client.completions.create(model="test", prompt="Code:", max_tokens=20, temperature=1.0, seed=1, n=3,
                                  extra_body={"guided_regex": r"[A-Z]{2}-\d{3}"})
    assert all(re.fullmatch(r"[A-Z]{2}-\d{3}", c.text) and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model="test", prompt="Pick:", max_tokens=10, temperature=1.0, seed=2,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")
    r = client.chat.completions.create(model="test", messages=MSGS, max_tokens=10, temperature=1.0, seed=3,
                                       extra_body={**NO_THINK, "structured_outputs": {"choice": ["up", "down"]}})
    assert r.choices[0].message.content in ("up", "down")
    r = client.completions.create(model="test", prompt="Sum:", max_tokens=20, temperature=1.0, seed=4,
                                  extra_body={"guided_grammar": 'root ::= [1-9] "+" [1-9] "=" [0-9]+'})
    assert re.fullmatch(r"[1-9]\+[1-9]=[0-9]+", r.choices[0].text)
    r = client.completions.create(model="test", prompt="JSON:", max_tokens=300, temperature=1.0, seed=5,
                                  extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    stream = client.completions.create(model="test", prompt="Code:", max_tokens=20, temperature=1.0, seed=1,
                                       stream=True, extra_body={"guided_regex": r"[A-Z]{2}-\d{3}"})
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", "".join(c.choices[0].text for c in stream if c.choices))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate(client, choice):
    names = set()
    for seed in range(4):
        r = client.chat.completions.create(model="test", messages=MSGS, tools=TOOLS, tool_choice=choice, seed=seed,
                                           temperature=1.0, max_tokens=300, parallel_tool_calls=False,
                                           extra_body=NO_THINK)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls and not c.message.content
        for call in c.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            names.add(call.function.name)
    if isinstance(choice, dict):
        assert names == {"get_time"}


def _stream_calls(client, **kwargs) -> tuple[str, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        indices = [d.index for d in delta.tool_calls or []]
        assert len(set(indices)) == len(indices), "two entries for one call in a chunk"  # (OpenAI: one)
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.id is not None:
                assert d.id.startswith("call_") and d.function.name and entry["name"] is None
                entry["name"] = d.function.name
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_tool_call_reassembles_to_the_non_streamed_one(client, parallel):
    kwargs = dict(model="test", messages=MSGS, tools=TOOLS, tool_choice="required", seed=11, temperature=1.0,
                  max_tokens=300, parallel_tool_calls=parallel, extra_body=NO_THINK)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = _stream_calls(client, **kwargs)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason and "tool_call" not in content
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if not parallel:  # one call, then the grammar allows only the end
        assert len(calls) == 1 and finish == "tool_calls"
    else:  # a random model may call again and again: each whole call counts, a cut one does not
        assert len(calls) >= 1 and finish in ("tool_calls", "length")


def test_bad_constraints_are_400s_naming_the_field(client):
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= missing"}}, "guided_grammar"),
        ({"extra_body": {"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                                                                "maximum": 1}}}}}, "guided_json"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"extra_body": {"guided_regex": "a+", "min_tokens": 3}}, "min_tokens"),
    ]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="test", messages=MSGS, max_tokens=5, **kwargs)
        error = e.value.body
        assert error["param"] == param and error["type"] == "invalid_request_error", (kwargs, error)
    r = client.chat.completions.create(model="test", messages=MSGS, max_tokens=3)  # still serving
    assert r.choices[0].finish_reason == "length"


def test_tool_round_trip_renders_through_the_template(client, server):
    """An assistant turn with tool_calls and a tool message: the prompt is the template's rendering."""
    arguments = json.dumps({"city": "Paris", "unit": "C", "days": 1})
    messages = [*MSGS,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model="test", messages=messages, tools=TOOLS, max_tokens=4, extra_body=NO_THINK)
    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments in text and "<tool_response>" in text
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


# -- a checkpoint that calls a tool by itself (tool_choice auto) --------------------------------------
# (spaced so that no token repeats: the scripted model is first-order)
CALL_TEXT = 'I will check.\n<tool_call>\n{"name": "get_time", "arguments" : {"zone":"CET"}}\n</tool_call>'


@pytest.fixture(scope="module")
def caller(serve, tmp_path_factory):
    # with thinking off, the prompt ends with "</think>\n\n" (token 271): the chain starts there
    path = build_scripted_checkpoint(tmp_path_factory.mktemp("tools") / "caller", script_text(271, CALL_TEXT),
                                     hidden=64)
    return openai_client(serve(path))


def test_auto_tool_call_from_the_model(caller):
    kwargs = dict(model="test", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=80, extra_body=NO_THINK)
    c = caller.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will check."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments == '{"zone":"CET"}'
    content, calls, finish = _stream_calls(caller, **kwargs)
    assert calls == [("get_time", call.function.arguments)] and finish == "tool_calls"
    assert content.strip() == "I will check." and "<tool_call>" not in content
    # tool_choice none: no parsing, the block is plain content
    c = caller.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
    assert c.message.tool_calls is None and "<tool_call>" in c.message.content and c.finish_reason == "stop"
