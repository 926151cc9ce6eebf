"""`mili serve model.gguf`: the three API dialects, tool calls, structured outputs and n > 1 on a GGUF model, through
the real clients; /health names the file's types."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from support.server import openai_client


@pytest.fixture(scope="module")
def gguf_server(serve, gguf_model):
    path, _ = gguf_model("q4_k_m")
    return serve(path, "--dtype", "bfloat16", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')


def test_health_names_the_files_types(gguf_server):
    health = httpx.get(f"{gguf_server.url}/health").json()
    assert health["quantization"].startswith("gguf Q4_K_M (") and "Q6_K" in health["quantization"]
    assert "gguf" in health["execution_plan"]["weights"] and health["execution_plan"]["speculative"] == "ngram"


def test_openai_chat_tools_structured_outputs_and_n(gguf_server):
    client = openai_client(gguf_server)
    reply = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=8, n=2, temperature=0.8, seed=1)
    assert len(reply.choices) == 2 and all(c.message.content is not None for c in reply.choices)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"]}}}
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}  # (a random model may think to the end)
    forced = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "Time?"}],
                                            tools=[tool], tool_choice={"type": "function",
                                                                       "function": {"name": "get_time"}},
                                            max_tokens=300, extra_body=no_thinking)
    assert forced.choices[0].message.tool_calls, forced.choices[0]
    call = forced.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    structured = client.chat.completions.create(
        model="test", messages=[{"role": "user", "content": "A number"}], max_tokens=300, extra_body=no_thinking,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert 0 <= json.loads(structured.choices[0].message.content)["n"] <= 9
    stream = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1


def test_anthropic_and_the_native_api(gguf_server):
    client = anthropic.Anthropic(base_url=gguf_server.url, api_key="unused")
    message = client.messages.create(model="test", max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    assert message.usage.output_tokens == 6 or message.stop_reason == "end_turn"
    native = httpx.post(f"{gguf_server.url}/generate", json={"prompt": "Once upon a time", "max_tokens": 5},
                        timeout=60)
    result = native.json()
    assert native.status_code == 200 and result["completion_tokens"] == 5 and isinstance(result["generated_text"], str)
