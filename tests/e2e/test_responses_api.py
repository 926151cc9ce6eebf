"""OpenAI's Responses API (stateless) through a real `mili serve`, with the official openai client.

The server runs the scripted checkpoint of scripted.build_caller_checkpoint (tests/support): it thinks when asked ("Let me
think"), says "I will check." and writes a get_time `<tool_call>` block.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from support.scripted import CALLER_TEXT, chain_length, prompt_tokens

QUESTION = "What time is it in Paris?"
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
        "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": TIME},
         {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["parameters"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def server(serve, caller_model):
    return serve(caller_model[0])


def _items(response) -> list[dict]:
    """The output items without the ids each response makes afresh."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in response.output]


def _both(client, **kwargs):
    """One request non-streamed, then streamed: (response, the stream's final response, its events)."""
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    return whole, streamed, events


def _check_sequence(events) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]


def test_create_and_stream_agree(client, caller_model):
    kwargs = dict(model="test", input=QUESTION, instructions="Be brief.", temperature=0)
    whole, streamed, events = _both(client, **kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.status == "completed"
    assert whole.output_text == CALLER_TEXT and [i.type for i in whole.output] == ["message"]
    assert whole.output[0].content[0].type == "output_text" and whole.output[0].status == "completed"
    assert whole.incomplete_details is None and whole.model_extra["store"] is False
    assert streamed.output_text == CALLER_TEXT and _items(streamed) == _items(whole) and streamed.status == "completed"
    _check_sequence(events)
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CALLER_TEXT
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == CALLER_TEXT
    n_in = prompt_tokens([{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
                  enable_thinking=False)
    n_out = chain_length(caller_model[1], 271)
    for r in (whole, streamed):
        u = r.usage
        assert (u.input_tokens, u.output_tokens, u.total_tokens) == (n_in, n_out, n_in + n_out)
        assert u.output_tokens_details.reasoning_tokens == 0
    # the same prompt again: all its full KV pages (16 tokens) come from the prefix cache
    again = client.responses.create(**kwargs)
    assert again.usage.input_tokens_details.cached_tokens == (n_in - 1) // 16 * 16 > 0


def test_max_output_tokens_is_incomplete(client):
    whole = client.responses.create(model="test", input=QUESTION, max_output_tokens=3)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3 and CALLER_TEXT.startswith(whole.output_text) and whole.output_text
    assert whole.output[-1].status == "incomplete"
    events = list(client.responses.create(model="test", input=QUESTION, max_output_tokens=3, stream=True))
    _check_sequence(events)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == whole.output_text and last.response.usage.output_tokens == 3


def test_reasoning_items(client):
    whole, streamed, events = _both(client, model="test", input=QUESTION, reasoning={"effort": "low"})
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Let me think")]
    assert whole.output_text == "\n\n" + CALLER_TEXT and _items(streamed) == _items(whole)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me think"
    # "<think>", "Let", " me", " think", "</think>"
    assert whole.usage.output_tokens_details.reasoning_tokens == 5
    assert whole.usage.input_tokens == prompt_tokens([{"role": "user", "content": QUESTION}], enable_thinking=True)
    minimal = client.responses.create(model="test", input=QUESTION, reasoning={"effort": "minimal"})
    assert [i.type for i in minimal.output] == ["message"] and minimal.usage.output_tokens_details.reasoning_tokens == 0


def test_function_tool_round_trip(client):
    kwargs = dict(model="test", input=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                  reasoning={"effort": "high"})
    whole, streamed, events = _both(client, **kwargs)
    assert _items(whole) == _items(streamed) == [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Let me think"}],
         "status": "completed"},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "\n\nI will check.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "name": "get_time", "arguments": '{"zone":"CET"}', "status": "completed"}]
    call = whole.output[2]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == ("get_time", call.arguments)
    # the output goes back as input with the call's result: the template's rendering of the same turns
    again = client.responses.create(**{**kwargs, "input": [*kwargs["input"], *whole.output, {
        "type": "function_call_output", "call_id": call.call_id, "output": '{"time": "12:00"}'}]})
    expected = prompt_tokens([
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "I will check.", "reasoning_content": "Let me think", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_time", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"time": "12:00"}'}],
        tools=OPENAI_TOOLS, enable_thinking=True)
    assert again.usage.input_tokens == expected and again.output[-1].type == "function_call"


def test_forced_tool_call_and_json_output(client):
    for _ in range(2):
        r = client.responses.create(model="test", input=QUESTION, tools=TOOLS, temperature=1.0,
                                    tool_choice={"type": "function", "name": "get_weather"})
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.responses.create(model="test", input=QUESTION, reasoning={"effort": "low"},
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert [i.type for i in r.output] == ["reasoning", "message"]  # the grammar starts after </think>
    jsonschema.validate(json.loads(r.output_text), schema)


def test_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="test", input=QUESTION, previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="test", input=QUESTION, store=True)
    assert e.value.body["param"] == "store" and "store: false" in e.value.body["message"]
    unstored = client.responses.create(model="test", input=QUESTION, store=False, max_output_tokens=2)
    assert unstored.status == "incomplete" and unstored.model_extra["store"] is False
    bad = [
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
         "input[0].content[0]"),  # (a text-only model: no images)
        (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input"),
        (dict(input=QUESTION, tools=[{"type": "web_search"}]), "tools.0.type"),
        (dict(input=QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
        (dict(input=QUESTION, text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}),
         "text.format"),
        (dict(input=QUESTION, max_output_tokens=0), "max_output_tokens"),
        (dict(input=QUESTION, max_output_tokens=10**6), "max_output_tokens"),  # past the context
        (dict(input=[{"type": "reasoning", "summary": []}]), "input"),  # nothing but reasoning
        (dict(input=QUESTION, text={"format": {"type": "json_schema", "name": "x"}}), "text.format"),
    ]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="test", **kwargs)
        body = e.value.body
        assert body["param"] == param and body["type"] == "invalid_request_error", (kwargs, body)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input=QUESTION)
