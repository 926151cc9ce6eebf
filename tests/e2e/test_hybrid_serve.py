"""`mili serve` on a hybrid Qwen3.5 checkpoint (Gated DeltaNet + full attention, tests/support/hybrid.py)
carrying the released Qwen3.5 chat template and the repository's Qwen3 tokenizer, through the official
openai client: chat completions whole and streamed, the thinking split, /health's recurrent-state fields,
and n past the state slots refused naming "n". One server for the module.

The checkpoint is scripted (random weights never write </think>): the Qwen3.5 template opens <think> in the
prompt (its last token is "\\n"), so with thinking on the model writes "Let me think.</think>\\n\\nHello there!";
with enable_thinking off the prompt ends with "</think>\\n\\n" and the model writes "Hello there!"."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from support.checkpoints import DATA
from support.hybrid import build_scripted_hybrid_checkpoint
from support.scripted import script_text

THINK_END, BLANK = 151668, 271  # </think>, "\n\n"
REASONING, ANSWER = "Let me think.", "Hello there!"
SLOTS, SNAPSHOTS = 2, 4
MSGS = [{"role": "user", "content": "Say hello."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _chain() -> dict[int, int]:
    thinking = script_text(198, REASONING, end=THINK_END, avoid=(BLANK,))
    answer = script_text(BLANK, ANSWER, avoid=(*thinking, THINK_END))
    return {**thinking, THINK_END: BLANK, **answer}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_scripted_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid") / "qwen35_scripted", _chain())
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    (path / "chat_template.jinja").write_text((DATA / "qwen3.5" / "qwen3.5_chat_template.jinja").read_text())
    return path


@pytest.fixture(scope="module")
def server(serve, model):
    return serve(model, "--num-state-slots", str(SLOTS), "--num-state-snapshots", str(SNAPSHOTS))


def _stream(client: OpenAI, **kwargs) -> tuple[str, str, str | None]:
    """(content, reasoning_content, finish_reason) of a streamed chat completion, joined."""
    content, reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, finish


def test_health_reports_the_state_slots(server, model):
    h = httpx.get(f"{server.url}/health").json()
    assert h["status"] == "healthy" and h["model_type"] == "qwen3_5_text" and h["tool_call_parser"] == "qwen3_xml"
    assert (h["recurrent_state_slots"], h["recurrent_state_snapshots"]) == (SLOTS, SNAPSHOTS)
    # one slot: per linear-attention layer, a conv state [2 Hk Dk + Hv Dv, K - 1] in the model's dtype (float32
    # here) and an SSM state [Hv, Dk, Dv] in float32 (mamba_ssm_dtype's default)
    c = json.loads((model / "config.json").read_text())
    conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
        c["linear_num_value_heads"] * c["linear_value_head_dim"]
    per_layer = 4 * conv_dim * (c["linear_conv_kernel_dim"] - 1) + 4 * c["linear_num_value_heads"] * \
        c["linear_key_head_dim"] * c["linear_value_head_dim"]
    per_slot = c["layer_types"].count("linear_attention") * per_layer
    assert h["recurrent_state_bytes"] == (SLOTS + SNAPSHOTS) * per_slot
    assert f"recurrent state: {SLOTS} slots + {SNAPSHOTS} prefix-cache snapshots" in server.output()


def test_chat_whole_and_streamed_with_thinking_split(client):
    kwargs = dict(model="test", messages=MSGS, temperature=0, max_tokens=40)
    c = client.chat.completions.create(**kwargs)
    choice = c.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "\n\n" + ANSWER  # as written
    assert choice.message.model_extra["reasoning_content"] == REASONING  # "</think>" itself is in neither
    assert c.usage.completion_tokens > 0
    content, reasoning, finish = _stream(client, **kwargs)
    assert (content, reasoning, finish) == (choice.message.content, REASONING, "stop")  # greedy: the same text


def test_thinking_off_gives_no_reasoning(client):
    kwargs = dict(model="test", messages=MSGS, temperature=0, max_tokens=40, extra_body=NO_THINK)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == ANSWER and choice.finish_reason == "stop"
    assert not choice.message.model_extra.get("reasoning_content")
    content, reasoning, finish = _stream(client, **kwargs)
    assert (content, reasoning, finish) == (ANSWER, "", "stop")


def test_n_within_the_slots_and_past_them(client, server):
    kwargs = dict(model="test", messages=MSGS, temperature=0, max_tokens=40, extra_body=NO_THINK)
    r = client.chat.completions.create(n=SLOTS, **kwargs)  # forked sequences, one state slot each
    assert [c.message.content for c in r.choices] == [ANSWER] * SLOTS
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(n=SLOTS + 1, stream=stream, **kwargs)
        assert e.value.param == "n" and e.value.code == "invalid_parameter", e.value.body
        assert f"exceeds the {SLOTS} recurrent-state slots" in e.value.message
    # the body as it is on the wire: OpenAI's shape
    body = httpx.post(f"{server.url}/v1/completions", json={"model": "test", "prompt": "Hi", "n": SLOTS + 1,
                                                            "max_tokens": 4}).json()
    assert set(body) == {"error"} and body["error"]["param"] == "n"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_parameter"
    # the server goes on serving
    assert client.chat.completions.create(**kwargs).choices[0].message.content == ANSWER
