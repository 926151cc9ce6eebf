"""The thinking budget over HTTP, on a scripted model that would think forever: every dialect's way of asking
(vLLM's thinking_token_budget, OpenAI's reasoning_effort and Responses' reasoning.effort, Anthropic's
thinking.budget_tokens, /generate's field) and the server's default (--reasoning-budget), streamed and not: the
reasoning is the budget's tokens and the forced message, the answer follows in the content, and the usage counts
the reasoning."""

from __future__ import annotations

import json

import httpx
import pytest

from support.scripted import build_scripted_checkpoint

THINK, END, NL = 151667, 151668, 198
A, B = 10061, 752  # "Let", " me"
FOREVER = {NL: THINK, THINK: A, A: B, B: A, END: 271, 271: 9707, 9707: 0, 0: 151645}
MESSAGE = " Time is up."
FORCED = 5  # its tokens, " Time", " is", " up", ".", then </think>
USER = [{"role": "user", "content": "Think about it."}]


def _thought(n: int) -> str:
    return "Let me" * (n // 2) + "Let" * (n % 2)


@pytest.fixture(scope="module")
def server(serve, tmp_path_factory):
    path = build_scripted_checkpoint(tmp_path_factory.mktemp("think") / "forever", FOREVER)
    return serve(path, "--reasoning-budget", "8", "--reasoning-budget-message", MESSAGE,
                 "--reasoning-effort-budgets", "low=4,medium=12")


def _chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": USER, "max_tokens": 300, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("asked, budget", [({"thinking_token_budget": 64}, 64), ({}, 8),
                                           ({"reasoning_effort": "low"}, 4), ({"reasoning_effort": "medium"}, 12),
                                           ({"reasoning_effort": "high"}, None)])
def test_chat_completions_think_within_the_budget(server, asked, budget):
    if budget is None:  # an effort the server's list leaves out: no limit, so the model thinks to max_tokens
        out = _chat(server, max_tokens=40, **asked)
        assert out["choices"][0]["message"]["reasoning_content"] == _thought(39)
        assert not out["choices"][0]["message"]["content"] and out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 40
        return
    out = _chat(server, **asked)
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == _thought(budget) + MESSAGE
    assert message["content"] == "\n\nHello!" and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1 + budget + FORCED


def test_a_streamed_chat_sends_the_same(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "messages": USER, "max_tokens": 300, "temperature": 0, "stream": True, "thinking_token_budget": 16,
            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == (_thought(16) + MESSAGE, "\n\nHello!")
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1 + 16 + FORCED


def test_a_budget_of_zero_is_no_thinking(server):
    """0 renders the template with thinking off (never a broken template), as enable_thinking: false does."""
    out = _chat(server, thinking_token_budget=0)
    assert out["choices"][0]["message"]["content"] == "Hello!"
    assert out["choices"][0]["message"].get("reasoning_content") is None
    assert _chat(server, reasoning_effort="none")["choices"][0]["message"]["content"] == "Hello!"


def test_anthropic_budget_tokens_is_enforced(server):
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "test", "max_tokens": 200, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 20}})
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"] == _thought(20) + MESSAGE and blocks[1]["text"].strip() == "Hello!"


def test_responses_reasoning_effort_is_a_budget(server):
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "Think about it.", "max_output_tokens": 200, "reasoning": {"effort": "low"}})
    assert r.status_code == 200, r.text
    body = r.json()
    reasoning = next(item for item in body["output"] if item["type"] == "reasoning")
    assert reasoning["content"][0]["text"] == _thought(4) + MESSAGE
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 1 + 4 + FORCED


def test_generate_takes_a_budget(server):
    r = httpx.post(server.url + "/generate", timeout=60,
                   json={"prompt": "Go\n", "max_tokens": 100, "temperature": 0, "thinking_token_budget": 6})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == "<think>" + _thought(6) + MESSAGE + "</think>\n\nHello!"


def test_bad_budgets_are_a_400(server):
    for body in ({"thinking_token_budget": -1}, {"thinking_token_budget": "many"}, {"reasoning_effort": "lots"}):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, **body}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("thinking_token_budget", "reasoning_effort")
