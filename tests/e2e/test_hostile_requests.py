"""No request stops the server: every pair of the extreme values that once did, against one `mili serve`
whose engine core must be the same process at the end; and a request that fails in the engine gets its
dialect's error (a 500, or an SSE error event) while the server serves the next one."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from support.engine_state import assert_drained, engine_core, runner_parts
from support.server import Server, metric


def _metric(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))

EXTREMES = {"temperature": 1e39, "top_p": 1e-45, "min_p": 1, "repetition_penalty": 1e39, "presence_penalty": -2,
            "min_tokens": 4, "top_k": 1}


def test_every_pair_of_extreme_values_is_served_by_the_same_core(random_model, tmp_path):
    s = Server(random_model, log_dir=tmp_path)
    try:
        pid = httpx.get(s.url + "/health").json()["engine_core_pid"]
        for (a, va), (b, vb) in itertools.combinations_with_replacement(EXTREMES.items(), 2):
            body = {"model": "test", "prompt": "hi", "max_tokens": 6, a: va, b: vb}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, (a, b, r.text)
            usage = r.json()["usage"]
            assert 1 <= usage["completion_tokens"] <= 6
            if "min_tokens" in (a, b):
                assert usage["completion_tokens"] >= 4, (a, b, r.json())
            if a != b:
                continue
            # each value alone also on the chat route, streamed with logprobs: no NaN or Infinity in the JSON
            chat = httpx.post(s.url + "/v1/chat/completions", json={
                "model": "test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
                "logprobs": True, "top_logprobs": 2, a: va, b: vb}, timeout=60)
            assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]"), (a, b, chat.text[-300:])
            assert '"error"' not in chat.text and "NaN" not in chat.text and "Infinity" not in chat.text
        health = httpx.get(s.url + "/health")
        assert health.status_code == 200 and health.json()["engine_core_pid"] == pid
        assert metric(s.url, "mili:request_failures_total") == 0
    finally:
        assert s.stop() == 0, s.output()


# -- a request that fails in the engine (a fault injected into its sampling): its dialect's error -------------
MARK = 0.123  # the temperature of the requests whose sampling fails


@pytest.fixture(scope="module")
def faulty(qwen3_checkpoint):
    from fastapi.testclient import TestClient

    from mili.config import EngineConfig
    from mili.engine.async_llm import AsyncLLM
    from mili.server.app import build_app

    engine = AsyncLLM(EngineConfig(model=str(qwen3_checkpoint("gqa4_realvocab")), dtype="float32"), core_in_thread=True)
    sampler = runner_parts(engine).sampler

    class Faulty(type(sampler)):
        def __call__(self, logits, meta):
            if meta.temperature is not None and bool((meta.temperature == MARK).any()):
                raise RuntimeError("injected sampling fault")
            return super().__call__(logits, meta)

    runner_parts(engine).sampler = Faulty(sampler.argmax, sampler.apply_bitmask, sampler.draw)
    with TestClient(build_app(engine, "tiny"), raise_server_exceptions=False) as c:
        yield c, engine_core(engine)
    engine.shutdown()


def test_a_failed_request_is_a_500_and_the_server_goes_on(faulty):
    c, core = faulty
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": MARK}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "request_failed" and error["type"] == "server_error"
    assert "injected sampling fault" in error["message"]

    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_failed"

    r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "temperature": MARK,
                                     "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "api_error"

    ok = c.post("/v1/completions", json={**body, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert c.get("/health").status_code == 200
    assert _metric(c.get("/metrics").text, "mili:request_failures_total") == 3
    assert_drained(core)  # (the core in this thread: its stats and invariants)
