"""Qwen3.5's XML tool calls through a real `mili serve`: a scripted Qwen3 checkpoint whose tokenizer carries
the released Qwen3.5 template (the special tokens have the same names) thinks, talks and calls a tool; the
official openai client (chat, streamed and not; responses) and the anthropic client read the same call.
A forced tool_choice on the same server is a grammar over the XML form (the scripted model is random
wherever the grammar masks its chain)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from support.checkpoints import DATA
from support.scripted import build_scripted_checkpoint, script_text
from support.server import Server

# The template opens <think> in the prompt (its last token is "\n", 198), so the reply holds only </think>.
# The chain is first-order (no token twice), so the call is written with fewer newlines than the template
# shows; the parser reads both (tests/unit/test_xml_tool_calls.py has the template's own spelling).
REPLY = ("Let me think.</think>\n\nI will check.\n<tool_call> <function=get_time><parameter=days>2</parameter>"
         "</function>\n</tool_call>")
TIME = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "zone": {"enum": ["UTC", "CET"]}},
        "required": ["days"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "hot": {"type": "boolean"}},
           "required": ["city", "hot"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}},
         {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
SCHEMAS = {"get_time": TIME, "get_weather": WEATHER}
MSGS = [{"role": "user", "content": "What time is it in two days?"}]
CALL = ("get_time", '{"days": 2}')


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_scripted_checkpoint(tmp_path_factory.mktemp("xml") / "qwen35_caller", script_text(198, REPLY),
                                     hidden=64)
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    (path / "chat_template.jinja").write_text((DATA / "qwen3.5" / "qwen3.5_chat_template.jinja").read_text())
    return path


@pytest.fixture(scope="module")
def server(serve, model):
    return serve(model)


def test_the_parser_is_picked_from_the_template(server):
    assert httpx.get(f"{server.url}/health").json()["tool_call_parser"] == "qwen3_xml"
    assert "tool calls: qwen3_xml" in server.output()


def test_openai_chat_whole_and_streamed(client):
    kwargs = dict(model="test", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=80)
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "\n\nI will check."
    assert c.message.model_extra["reasoning_content"] == "Let me think."
    (call,) = c.message.tool_calls
    assert (call.function.name, call.function.arguments) == CALL and call.id.startswith("call_")

    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert [tuple(v) for v in calls.values()] == [CALL] and finish == "tool_calls"
    assert content.strip() == "I will check." and reasoning == "Let me think."
    assert not any(tag in content for tag in ("<tool_call>", "<function=", "<parameter=", "</"))

    # tool_choice none: nothing is parsed, the block is plain content
    c = client.chat.completions.create(**kwargs, tool_choice="none").choices[0]
    assert c.message.tool_calls is None and "<function=get_time>" in c.message.content


def test_anthropic_messages_whole_and_streamed(server):
    ac = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kwargs = dict(model="test", max_tokens=80, messages=MSGS, thinking={"type": "enabled", "budget_tokens": 40},
                  tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS])
    m = ac.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == "Let me think." and m.content[1].text == "\n\nI will check."
    assert (m.content[2].name, m.content[2].input) == ("get_time", {"days": 2})
    with ac.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id", "signature"}) for b in final.content] == \
        [b.model_dump(exclude={"id", "signature"}) for b in m.content]


def test_responses_api(client):
    r = client.responses.create(model="test", input="What time is it in two days?", max_output_tokens=80,
                                reasoning={"effort": "medium"}, temperature=0, tools=[
                                    {"type": "function", **t["function"]} for t in TOOLS])
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message", "function_call"], kinds
    assert (r.output[2].name, r.output[2].arguments) == CALL


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_writes_the_xml_form(client, choice):
    kwargs = dict(model="test", messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=200,
                  parallel_tool_calls=False, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for seed in range(3):
        c = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content, c.message
        (call,) = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        streamed = {}
        for chunk in client.chat.completions.create(seed=seed, stream=True, **kwargs):
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = streamed.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
        assert [tuple(v) for v in streamed.values()] == [(call.function.name, call.function.arguments)]


def test_the_flag_overrides_the_template(model):
    """--tool-call-parser hermes on a Qwen3.5 template: the XML block is not a (hermes) call, so it is content."""
    s = Server(model, "--tool-call-parser", "hermes")
    try:
        assert httpx.get(f"{s.url}/health").json()["tool_call_parser"] == "hermes"
        r = httpx.post(f"{s.url}/v1/chat/completions", json={
            "model": "test", "messages": MSGS, "tools": TOOLS, "temperature": 0, "max_tokens": 80}).json()
        message = r["choices"][0]["message"]
        assert "tool_calls" not in message and "<function=get_time>" in message["content"]
    finally:
        assert s.stop() == 0, s.output()
