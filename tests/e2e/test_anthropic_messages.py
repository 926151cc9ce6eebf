"""Anthropic's Messages API through a real `mili serve`, with the official anthropic client.

The server runs the scripted checkpoint of scripted.build_caller_checkpoint (tests/support) (it thinks when asked, says
"I will check." and writes a get_time `<tool_call>` block), behind an API key.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from support.scripted import CALLER_TEXT, chain_length, prompt_tokens

KEY = "sekret"
USER = [{"role": "user", "content": "What time is it in Paris?"}]
GREEDY = {"temperature": 0}  # this SDK sends sampling fields only as extra_body
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
        "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_time", "description": "The time in a zone", "input_schema": TIME},
         {"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
# the same tools as the OpenAI chat shape the template renders
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def server(serve, caller_model):
    return serve(caller_model[0], "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def _blocks(message) -> list[dict]:
    """A message's content without the ids a tool_use block gets afresh each time."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in message.content]


def _both(client, **kwargs):
    """The reply to one request, non-streamed and streamed (the SDK's accumulated final message, and the
    text its text_stream gave)."""
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    return whole, streamed, text


def test_create_and_stream_agree(client, caller_model):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}]
    whole, streamed, text = _both(client, model="test", max_tokens=100, system=system, messages=USER,
                                  extra_body=GREEDY, extra_headers={"anthropic-version": "2023-06-01"})
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "test"
    assert whole.id.startswith("msg_") and streamed.id.startswith("msg_") and whole.id != streamed.id
    assert [(b.type, b.text) for b in whole.content] == [("text", CALLER_TEXT)]  # no tools: the block is text
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    assert _blocks(streamed) == _blocks(whole) and text == CALLER_TEXT
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    expected_input = prompt_tokens([{"role": "system", "content": "You are terse.\nAnswer in English."}, *USER],
                            enable_thinking=False)
    assert whole.usage.input_tokens == streamed.usage.input_tokens == expected_input
    assert whole.usage.output_tokens == streamed.usage.output_tokens == chain_length(caller_model[1], 271)


def test_stop_sequences_and_max_tokens(client):
    whole, streamed, text = _both(client, model="test", max_tokens=100, messages=USER, stop_sequences=["xyz", "check"])
    for m in (whole, streamed):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == "check"
        assert [b.text for b in m.content] == ["I will "]
    whole, streamed, _ = _both(client, model="test", max_tokens=3, messages=USER)
    for m in (whole, streamed):
        assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 3
    assert _blocks(whole) == _blocks(streamed) and CALLER_TEXT.startswith(whole.content[0].text)


def test_thinking_blocks(client):
    kwargs = dict(model="test", max_tokens=100, messages=USER, thinking={"type": "enabled", "budget_tokens": 50})
    whole, streamed, text = _both(client, **kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    thinking = whole.content[0]
    assert thinking.thinking == "Let me think" and isinstance(thinking.signature, str) and thinking.signature
    assert whole.content[1].text == text == "\n\n" + CALLER_TEXT  # what follows </think>, as written
    assert _blocks(streamed) == _blocks(whole)
    assert whole.usage.input_tokens == prompt_tokens(USER, enable_thinking=True)
    off = client.messages.create(**{**kwargs, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"] and off.usage.input_tokens == prompt_tokens(USER,
                                                                                          enable_thinking=False)


def test_the_same_greedy_text_through_the_three_dialects(client, server):
    """Chat completions, the Responses API and Messages give the same reply text, whole and streamed: what
    follows </think>, "\\n\\n" included, as vLLM's qwen3 reasoning parser gives it (issue 30, defect c)."""
    from openai import OpenAI

    expected = "\n\n" + CALLER_TEXT  # the model writes "<think>Let me think</think>\n\n" first
    oc = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    chat = dict(model="test", messages=USER, temperature=0, max_tokens=100)
    whole = oc.chat.completions.create(**chat).choices[0].message
    streamed = "".join(ch.choices[0].delta.content or "" for ch in oc.chat.completions.create(stream=True, **chat)
                       if ch.choices)
    texts = {"chat": whole.content, "chat, streamed": streamed}
    assert whole.model_extra["reasoning_content"] == "Let me think"
    responses = dict(model="test", input=USER[0]["content"], reasoning={"effort": "low"}, temperature=0,
                     max_output_tokens=100)
    texts["responses"] = oc.responses.create(**responses).output_text
    with oc.responses.stream(**responses) as stream:
        texts["responses, streamed"] = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    message, streamed_message, text = _both(client, model="test", max_tokens=100, messages=USER, extra_body=GREEDY,
                                            thinking={"type": "enabled", "budget_tokens": 50})
    texts["messages"] = "".join(b.text for b in message.content if b.type == "text")
    texts["messages, streamed"] = text
    assert [b.thinking for b in message.content if b.type == "thinking"] == ["Let me think"]
    assert texts == dict.fromkeys(texts, expected)


def _offline(model: Path, prompt_ids: list[int], max_tokens: int) -> str:
    """The offline engine's greedy text for these prompt tokens."""
    from mili import LLM, SamplingParams

    (out,) = LLM(str(model), dtype="float32").generate(
        {"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return out.outputs[0].text


@pytest.mark.parametrize("thinking", [False, True])
def test_prefill_continues_the_final_assistant_turn(client, caller_model, thinking):
    """A final assistant turn is continued, as Anthropic's API does (issue 30, defect d): the prompt is the
    template's rendering of it left open, and the reply holds only the continuation, the offline engine's
    greedy text for the same prompt tokens."""
    from transformers import AutoTokenizer

    messages = [*USER, {"role": "assistant", "content": "It is"}]
    kwargs = dict(model="test", max_tokens=8, messages=messages, extra_body=GREEDY)
    if thinking:
        kwargs["thinking"] = {"type": "enabled", "budget_tokens": 4}
    whole, streamed, text = _both(client, **kwargs)
    tok = AutoTokenizer.from_pretrained(caller_model[0])
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                     continue_final_message=True, enable_thinking=thinking)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is")  # Qwen3's template
    ids = tok(prompt, add_special_tokens=False).input_ids
    expected = _offline(caller_model[0], ids, 8)
    assert expected and not expected.startswith("It is")
    assert [b.type for b in whole.content] == ["text"]  # past the thinking: the continuation is text
    assert whole.content[0].text == text == expected and _blocks(streamed) == _blocks(whole)
    assert whole.usage.input_tokens == len(ids)
    assert client.messages.count_tokens(model="test", messages=messages).input_tokens == len(ids)


def test_tool_round_trip(client):
    kwargs = dict(model="test", max_tokens=100, messages=USER, tools=TOOLS, extra_body=GREEDY)
    whole, streamed, text = _both(client, **kwargs)
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    assert _blocks(whole) == _blocks(streamed) == [
        {"type": "text", "text": "I will check."}, {"type": "tool_use", "name": "get_time", "input": {"zone": "CET"}}]
    call = whole.content[1]
    assert call.id.startswith("toolu_") and streamed.content[1].id.startswith("toolu_") and text == "I will check."
    # the reply goes back with the tool's result: the prompt is the template's rendering of the same turns
    messages = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": [{"type": "text", "text": '{"time": "12:00"}'}]}]}]
    again = client.messages.create(**{**kwargs, "messages": messages})
    expected = prompt_tokens([*USER, {"role": "assistant", "content": "I will check.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}], tools=OPENAI_TOOLS,
        enable_thinking=False)
    assert again.usage.input_tokens == expected and again.stop_reason == "tool_use"
    counted = client.messages.count_tokens(model="test", messages=messages, tools=TOOLS)
    assert counted.input_tokens == expected
    # tool_choice none: the tools are in the prompt, the block is plain text
    plain = client.messages.create(**kwargs, tool_choice={"type": "none"})
    assert [(b.type, b.text) for b in plain.content] == [("text", CALLER_TEXT)] and plain.stop_reason == "end_turn"


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather"}])
def test_tool_choice_is_enforced(client, choice):
    schemas = {t["name"]: t["input_schema"] for t in TOOLS}
    kwargs = dict(model="test", max_tokens=200, messages=USER, tools=TOOLS, tool_choice=choice,
                  extra_body={"temperature": 1.0})
    with client.messages.stream(**kwargs) as stream:
        replies = [client.messages.create(**kwargs), client.messages.create(**kwargs), stream.get_final_message()]
    for m in replies:
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
        (call,) = m.content
        jsonschema.validate(call.input, schemas[call.name])
        if choice["type"] == "tool":
            assert call.name == "get_weather"


def test_structured_output(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    m = client.messages.create(model="test", max_tokens=50, messages=USER,
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert m.stop_reason == "end_turn"


def test_bad_requests_are_anthropic_400s(client, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    bad = [
        dict(messages=[{"role": "user", "content": [image]}]),
        dict(messages=USER, thinking={"type": "enabled", "budget_tokens": 100}),  # not below max_tokens
        dict(messages=USER, extra_body={"thinking": {"type": "enabled"}}),
        dict(messages=USER, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}),
        dict(messages=USER, tool_choice={"type": "any"}),
        dict(messages=[*USER, {"role": "assistant", "content": "It is "}]),  # a prefill ending in whitespace
        dict(messages=[*USER, {"role": "assistant", "content": [  # a prefill with a tool call
            {"type": "text", "text": "It is"}, {"type": "tool_use", "id": "t", "name": "get_time", "input": {}}]}]),
        dict(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]},
                       *USER]),
        dict(messages=USER, tools=[{"name": "f", "input_schema": {"type": "nope"}}], tool_choice={"type": "any"}),
        dict(messages=USER, extra_body={"temperature": 1.5}),
        dict(messages=USER, extra_body={"frequency_penalty": 1.0}),
        dict(messages=[]),
        dict(messages=[{"role": "user", "content": []}]),
        dict(messages=USER, tools=TOOLS, tool_choice={"type": "tool"}),
        dict(messages=USER, tools=TOOLS, tool_choice={"type": "any"},
             extra_body={"output_config": {"format": {"type": "json_schema", "schema": TIME}}}),
    ]
    for kwargs in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="test", max_tokens=100, **kwargs)
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", (kwargs, body)
        assert body["error"]["message"]
        if kwargs is bad[0]:  # the image, to a text-only model: the message names the block
            assert body["error"]["message"].startswith("messages[0].content[0]: this model takes no images"), body
    # malformed JSON; no max_tokens (which the SDK would not send)
    no_max_tokens = json.dumps({"model": "test", "messages": USER}).encode()
    for raw in (b'{"model": "test", "messages": []', no_max_tokens):
        r = httpx.post(server.url + "/v1/messages", content=raw, headers={"x-api-key": KEY,
                                                                           "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=10, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert client.messages.create(model="test", max_tokens=3, messages=USER).stop_reason == "max_tokens"  # serving


def test_api_key(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="test", max_tokens=3, messages=USER)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "test", "messages": USER})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER})  # OpenAI's routes: OpenAI's shape
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.create(model="test", max_tokens=2, messages=USER).usage.output_tokens == 2


def test_count_tokens(client):
    counted = client.messages.count_tokens(model="test", messages=USER, system="Be brief.", tools=TOOLS)
    expected = prompt_tokens([{"role": "system", "content": "Be brief."}, *USER], tools=OPENAI_TOOLS,
                      enable_thinking=False)
    assert counted.input_tokens == expected
    created = client.messages.create(model="test", max_tokens=2, messages=USER, system="Be brief.", tools=TOOLS)
    assert created.usage.input_tokens == expected
    thinking = client.messages.count_tokens(model="test", messages=USER, thinking={"type": "enabled",
                                                                                    "budget_tokens": 1024})
    assert thinking.input_tokens == prompt_tokens(USER, enable_thinking=True)
