"""Server pieces in-process: the reasoning splitter, and an error after a stream has started."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from mili.config import EngineConfig
from mili.engine.client import AsyncLLM
from mili.server.app import build_app
from mili.tokenizer.reasoning import ReasoningStream, split_reasoning


@pytest.mark.parametrize("text,expected", [
    ("<think>\nstep one\n</think>\n\nThe answer.", ("step one\n", "The answer.")),
    ("<think>still going", ("still going", "")),
    ("no tags at all", (None, "no tags at all")),
    ("prompt-opened reasoning</think>\n\nanswer", ("prompt-opened reasoning", "answer")),
    ("<think></think>answer", ("", "answer")),
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
        assert (r_all, c_all) == split_reasoning(text) == ("Let me think.\n", "Hello!")
    opened = ReasoningStream(True, prompt_opened=True)  # the template wrote "<think>" into the prompt
    pieces = ["Let", " me", " think", "</think>", "\n\n", "Hello", "!"]
    deltas = [opened.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    assert "".join(r for r, _ in deltas) == "Let me think" and "".join(c for _, c in deltas) == "Hello!"
    off = ReasoningStream(False)
    assert off.feed("<think>x</think>y", final=True) == ("", "<think>x</think>y")


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    engine = AsyncLLM(EngineConfig(model=str(tiny_checkpoint), dtype="float32"), core_in_thread=True)
    with TestClient(build_app(engine, "tiny"), raise_server_exceptions=False) as c:
        yield c, engine.core
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
    from mili.server.errors import sse

    text = "a\u2028b\x85c\u2029d\r\ne\x0bf\x1cg"
    event = sse({"text": text})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[6:])["text"] == text
