"""Server pieces in-process: the reasoning splitter, and an error after a stream has started."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from support.engine_state import engine_core
from mili.config import EngineConfig
from mili.engine.async_llm import AsyncLLM
from mili.server.app import build_app
from mili.tokenizer.reasoning import ReasoningStream, split_reasoning


@pytest.mark.parametrize("text,expected", [  # vLLM's rule: both parts as written, nothing stripped
    ("<think>\nstep one\n</think>\n\nThe answer.", ("\nstep one\n", "\n\nThe answer.")),
    ("<think>still going", ("still going", "")),
    ("no tags at all", (None, "no tags at all")),
    ("prompt-opened reasoning</think>\n\nanswer", ("prompt-opened reasoning", "\n\nanswer")),
    ("<think></think>answer", ("", "answer")),
    ("<think>x</think> answer", ("x", " answer")),
])
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def test_reasoning_stream_never_retracts():
    text = "\n<think>\nLet me think.\n</think>\n\nHello!"
    for cut in range(1, 6):  # the same text, delivered in chunks of various sizes
        stream = ReasoningStream(True)
        pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
        r_all = c_all = ""
        for k, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=k == len(pieces) - 1)
            assert "<think>" not in c and "</think>" not in c and "<think>" not in r
            r_all, c_all = r_all + r, c_all + c
        assert (r_all, c_all) == split_reasoning(text) == ("\nLet me think.\n", "\n\nHello!")
    opened = ReasoningStream(True, prompt_opened=True)  # the template wrote "<think>" into the prompt
    pieces = ["Let", " me", " think", "</think>", "\n\n", "Hello", "!"]
    deltas = [opened.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    assert "".join(r for r, _ in deltas) == "Let me think" and "".join(c for _, c in deltas) == "\n\nHello!"
    off = ReasoningStream(False)
    assert off.feed("<think>x</think>y", final=True) == ("", "<think>x</think>y")


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    engine = AsyncLLM(EngineConfig(model=str(tiny_checkpoint), dtype="float32"), core_in_thread=True)
    with TestClient(build_app(engine, "tiny"), raise_server_exceptions=False) as c:
        yield c, engine_core(engine)
    engine.shutdown()


def test_error_after_stream_started_is_a_final_sse_chunk(client, monkeypatch):
    c, engine = client
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("simulated device failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    body = {"prompt": [1, 2, 3], "max_tokens": 50, "ignore_eos": True, "stream": True}
    with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert error["code"] == "engine_dead" and "simulated device failure" in error["message"]
    assert len(lines) >= 3 and "choices" in json.loads(lines[0][6:])  # text came before the failure
    # the dead engine is reported, and new requests get a clear error rather than hanging
    dead = c.get("/health")
    assert dead.status_code == 503 and dead.json()["status"] == "unhealthy"
    assert "simulated device failure" in dead.json()["reason"]
    r = c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert "engine stopped" in r.json()["error"]["message"]


def test_sse_events_never_contain_a_line_break_a_line_reader_would_split_on():
    from mili.server.sse import EventStream, sse

    text = "a\u2028b\x85c\u2029d\r\ne\x0bf\x1cg"
    for event in (sse({"text": text}), EventStream({"id": "x\u2028"}, "text")(text)):
        event = event.decode()  # (what a client's line reader sees)
        assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
        assert json.loads(event[6:])["text"] == text
    assert json.loads(EventStream({"id": "x\u2028"}, "text")(text)[6:]) == {"id": "x\u2028", "text": text}



@pytest.mark.parametrize("text", ["plain", "", "quote \" and \\ and \n", "日本語 \u2028 \x85 \u2029", "\x00\x1f"])
@pytest.mark.parametrize("finish", [None, "length", "stop"])
def test_completion_chunk_written_by_hand_is_the_encoded_chunk(text, finish):
    """The plain /v1/completions chunk, assembled from bytes made once per choice, is byte for byte what
    encoding the chunk's dict gives."""
    from mili.server.sse import EventStream, json_bytes
    # reach-in: the chunk's bytes made by hand once per choice; no public call streams an arbitrary text
    from mili.server.openai import _NO_FINISH, _Choice, _finish

    event = EventStream({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"})
    for index in (0, 3):
        c = _Choice()
        by_hand = c.text_head(event, index) + json_bytes(text) + (_NO_FINISH if finish is None else _finish(finish))
        assert c.text_head(event, index) is c.head  # made once
        assert by_hand == event([{"index": index, "text": text, "logprobs": None, "finish_reason": finish}])

# -- the dialects' shared pieces ----------------------------------------------------------------------
REPLY = ('<think>\nLet me think.\n</think>\n\nI will check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
         '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n  Done.\n')


def _replay(events) -> list[tuple]:
    """The blocks a client rebuilds from the events, checking each is started, extended, then stopped."""
    built, state = {}, {}
    for kind, block, text in events:
        if kind == "start":
            assert block.index not in state and block.index == len(built) and text == ""
            built[block.index], state[block.index] = [block.kind, block.name, ""], "open"
        elif kind == "delta":
            assert state[block.index] == "open" and text
            built[block.index][2] += text
        else:
            assert state[block.index] == "open"
            state[block.index] = "stopped"
    assert all(s == "stopped" for s in state.values())
    return [tuple(b) for b in built.values()]


@pytest.mark.parametrize("text, thinking, tools, expected", [
    (REPLY, True, True, [("reasoning", None, "\nLet me think.\n"), ("text", None, "\n\nI will check."),
                         ("tool_call", "f", '{"a": 1}'), ("tool_call", "g", "{}"), ("text", None, "Done.\n")]),
    (REPLY[:REPLY.index("check")], True, True,  # cut short: the whitespace at its end is the text's
     [("reasoning", None, "\nLet me think.\n"), ("text", None, "\n\nI will ")]),
    ("<think>x</think> Hi", True, False, [("reasoning", None, "x"), ("text", None, " Hi")]),  # (issue 30, c)
    ("<think>x</think>\n\n", True, True, [("reasoning", None, "x"), ("text", None, "\n\n")]),
    ("\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", False, True, [("tool_call", "f", "{}")]),
    ("Hello <b>world</b>\n\n", False, True, [("text", None, "Hello <b>world</b>\n\n")]),
    ("<think>x</think>y", False, False, [("text", None, "<think>x</think>y")]),
])
def test_reply_blocks_are_the_same_streamed_or_whole(text, thinking, tools, expected):
    from mili.server.chat import ChatPrompt, ReplyBlocks

    prompt = ChatPrompt("", [], thinking, False, tools)
    whole = ReplyBlocks(prompt)
    assert _replay(whole.feed(text, final=True)) == [(b.kind, b.name, b.text) for b in whole.blocks] == expected
    for cut in range(1, 8):
        stream, pieces = ReplyBlocks(prompt), [text[i:i + cut] for i in range(0, len(text), cut)]
        events = [e for k, piece in enumerate(pieces) for e in stream.feed(piece, final=k == len(pieces) - 1)]
        assert _replay(events) == expected
        assert [b.call_id is not None for b in stream.blocks] == [b.kind == "tool_call" for b in stream.blocks]


@pytest.mark.parametrize("text", [REPLY, "<think>x</think> Hi", "<think>x</think>\n\nHi\n", "Hi", " Hi",
                                  "<think>x</think>\n\n", '<think>x</think>\n\n<tool_call>\n{"name": "f", '
                                  '"arguments": {}}\n</tool_call>\n  Bye.'])
def test_the_dialects_split_a_reply_alike(text):
    """Chat completions' content (whole and streamed) is the text of the Anthropic/Responses blocks: what
    follows </think> as written, vLLM's rule (issue 30, defect c)."""
    from mili.server.chat import ChatPrompt, ReplyBlocks

    prompt = ChatPrompt("", [], True, False, True)
    reasoning, content = split_reasoning(text)
    content, calls = prompt.tool_calls(content)
    blocks = ReplyBlocks(prompt)
    blocks.feed(text, final=True)
    texts = [b.text for b in blocks.blocks if b.kind == "text"]
    assert (content or "") == "".join(texts) if len(texts) < 2 else content.startswith(texts[0])
    assert [b.text for b in blocks.blocks if b.kind == "reasoning"] == ([reasoning] if reasoning else [])
    assert [b.name for b in blocks.blocks if b.kind == "tool_call"] == [name for name, _ in calls]
    stream = ReasoningStream(True)
    streamed = "".join(stream.feed(text[i:i + 3], final=i + 3 >= len(text))[1] for i in range(0, len(text), 3))
    assert streamed == split_reasoning(text)[1]


def test_anthropic_error_types():
    from mili.server.errors import APIError, anthropic_error

    def kind(err):
        status, body = anthropic_error(err)
        assert set(body) == {"type", "error"} and body["error"]["message"] == err.message
        return status, body["error"]["type"]

    assert kind(APIError(400, "bad")) == (400, "invalid_request_error")
    assert kind(APIError(401, "key", code="invalid_api_key")) == (401, "authentication_error")
    assert kind(APIError(404, "model", "not_found_error")) == (404, "not_found_error")
    assert kind(APIError(503, "busy", "server_error", code="queue_full")) == (529, "overloaded_error")
    assert kind(APIError(503, "dead", "server_error", code="engine_dead")) == (500, "api_error")


@pytest.fixture
def dying_client(qwen3_checkpoint, monkeypatch):
    """An app whose engine fails on its fourth step."""
    engine = AsyncLLM(EngineConfig(model=str(qwen3_checkpoint("gqa4_realvocab")), dtype="float32"), core_in_thread=True)
    real_step, calls = engine_core(engine).step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("simulated device failure")
        return real_step()

    monkeypatch.setattr(engine_core(engine), "step", failing_step)
    with TestClient(build_app(engine, "tiny"), raise_server_exceptions=False) as c:
        yield c
    engine.shutdown()


def _named_events(r) -> list[tuple[str, dict]]:
    lines = [line for line in r.iter_lines() if line]
    assert all(a.startswith("event: ") and b.startswith("data: ") for a, b in zip(lines[::2], lines[1::2]))
    return [(a[7:], json.loads(b[6:])) for a, b in zip(lines[::2], lines[1::2])]


def test_anthropic_stream_error_then_api_error(dying_client):
    body = {"model": "tiny", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with dying_client.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        events = _named_events(r)
    assert events[0][0] == "message_start" and "content_block_delta" in [name for name, _ in events]
    name, error = events[-1]
    assert name == "error" and error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "simulated device failure" in error["error"]["message"]
    r = dying_client.post("/v1/messages", json={**body, "stream": False})
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"


def test_responses_stream_fails(dying_client):
    body = {"model": "tiny", "max_output_tokens": 50, "input": "hi", "stream": True}
    with dying_client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = _named_events(r)
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]
    name, failed = events[-1]
    assert name == failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert "simulated device failure" in failed["response"]["error"]["message"]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    r = dying_client.post("/v1/responses", json={**body, "stream": False})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_no_base_http_middleware_on_any_path(tiny_checkpoint):
    """Streams cross no ``BaseHTTPMiddleware`` (which relays each chunk through a memory stream): the API key
    check is pure ASGI, installed only with a key, and answers 401 in the dialect's shape."""
    from starlette.middleware.base import BaseHTTPMiddleware

    from mili.server.app import ApiKeyMiddleware

    engine = AsyncLLM(EngineConfig(model=str(tiny_checkpoint), dtype="float32"), core_in_thread=True)
    try:
        plain, keyed = build_app(engine, "tiny"), build_app(engine, "tiny", api_key="k")
        for app in (plain, keyed):
            assert not any(m.cls is BaseHTTPMiddleware for m in app.user_middleware)
        assert [m.cls for m in keyed.user_middleware] == [ApiKeyMiddleware] and not plain.user_middleware
        with TestClient(keyed) as c:
            assert c.get("/v1/models").json()["error"]["code"] == "invalid_api_key"
            assert c.post("/v1/messages", json={}).json()["error"]["type"] == "authentication_error"
            assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
            assert c.get("/v1/models", headers={"x-api-key": "k"}).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        engine.shutdown()


def test_observe_each_is_observe_per_value():
    """metrics.observe_each (a step's inter-token latencies at once) leaves a histogram as observe() one by one
    does: the same buckets, count and sum, including values on a bound, below the first and past the last."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from mili.server.metrics import observe_each

    buckets = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1, 2.5)  # (the ITL's)
    rng = random.Random(0)
    values = [rng.uniform(0, 2 * buckets[-1]) for _ in range(500)] + list(buckets) + [0.0, 1e9]
    registries = [CollectorRegistry(), CollectorRegistry()]
    one, each = (Histogram("itl", "x", buckets=buckets, registry=r) for r in registries)
    for v in values:
        one.observe(v)
    observe_each(each, values[:250])
    observe_each(each, values[250:])
    observe_each(each, [])
    assert generate_latest(registries[0]) == generate_latest(registries[1])

