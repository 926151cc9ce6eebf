"""Raw HTTP against a real server: every client error in OpenAI's shape, the native API, metrics."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest

from support.checkpoints import QWEN3_TOKENIZER
from support.server import Server, metric


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def _png() -> str:
    """A 32×32 PNG as a data: URL."""
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), "teal").save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


PNG = _png()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [  # a text-only model: no images
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": PNG}}]}]}, "messages[0].content[1]"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]},
     "messages[0].content[0]"),
    ("/generate", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/generate", {"prompt": ""}, "prompt"),
])
def test_invalid_parameters_are_400(server, path, body, param):
    _error(httpx.post(server.url + path, json=body, timeout=30), 400, param)


def test_malformed_json_and_non_object_bodies(server):
    err = _error(httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",',
                            headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    _error(httpx.post(server.url + "/v1/chat/completions", content=b"[1, 2]",
                      headers={"content-type": "application/json"}), 400)
    _error(httpx.post(server.url + "/v1/completions", content=b"prompt=x"), 400)


def test_context_overflow_names_the_numbers(server):
    long_prompt = [100] * 1000
    err = _error(httpx.post(server.url + "/v1/completions",
                            json={"prompt": long_prompt, "max_tokens": 100}), 400, "max_tokens")
    assert "maximum context length is 1024 tokens" in err["message"]
    assert "1000 prompt tokens" in err["message"] and "100 completion tokens" in err["message"]
    assert err["code"] == "context_length_exceeded"
    _error(httpx.post(server.url + "/v1/completions", json={"prompt": [100] * 1100}), 400, "prompt")


def test_unknown_model_and_route(server):
    err = _error(httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    _error(httpx.get(server.url + "/v1/nothing-here"), 404)
    _error(httpx.get(server.url + "/v1/completions"), 405)


def test_no_input_breaks_the_server(server):
    weird = [{"prompt": {"a": 1}}, {"prompt": [[1, 2], "x"]}, {"prompt": "x", "n": 10**6},
             {"prompt": "x", "stop": [""]}, {"prompt": "x", "seed": "abc"}, {"prompt": "x", "top_k": -5},
             {"prompt": "x", "stop_token_ids": [-1]}, {"prompt": "x", "min_tokens": 99, "max_tokens": 2},
             {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "prompt_logprobs": 1, "stream": True},
             {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": -1}, {"prompt": "x", "repetition_penalty": 0}]
    for body in weird:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        _error(r, 400)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "still alive", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    assert metric(server.url, "mili:num_requests_running") == 0


def test_tokenize_detokenize_version(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["tokens"] == [9707, 1879] and ids["count"] == 2 and ids["max_model_len"] == 1024
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"][0] == 151644  # <|im_start|>
    assert httpx.post(server.url + "/detokenize", json={"tokens": [9707, 1879]}).json()["prompt"] == "Hello world"
    _error(httpx.post(server.url + "/detokenize", json={"tokens": [-3]}), 400, "tokens")
    assert httpx.get(server.url + "/version").json()["version"]


def test_tokenize_and_detokenize_take_vllms_requests(server):
    """vLLM's /tokenize and /detokenize bodies as its clients send them (``model`` included), answered in its
    shape; each form's fields only with that form."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    out = httpx.post(server.url + "/tokenize", json={"model": "test", "prompt": "Hello world",
                                                     "return_token_strs": True}).json()
    assert out == {"count": 2, "max_model_len": 1024, "tokens": [9707, 1879], "token_strs": ["Hello", "Ġworld"]}
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}).json()["token_strs"] is None
    tools = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Rain in Paris?"}]
    chat = httpx.post(server.url + "/tokenize", json={"model": "test", "messages": messages, "tools": tools,
                                                      "add_generation_prompt": True,
                                                      "chat_template_kwargs": {"enable_thinking": False}}).json()
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert '"weather"' in text and chat["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert chat["count"] == len(chat["tokens"]) and chat["token_strs"] is None
    assert httpx.post(server.url + "/detokenize", json={"model": "test", "tokens": [9707, 1879]}).json() == {
        "prompt": "Hello world"}
    # a chat form's option with a prompt (schemathesis found it accepted, against the document), both forms at once,
    # neither, and a model the server does not serve
    _error(httpx.post(server.url + "/tokenize", json={"prompt": "x", "add_generation_prompt": True,
                                                      "continue_final_message": True}), 400, "add_generation_prompt")
    _error(httpx.post(server.url + "/tokenize", json={"prompt": "x", "messages": messages}), 400, "prompt")
    _error(httpx.post(server.url + "/tokenize", json={}), 400, "prompt")
    _error(httpx.post(server.url + "/tokenize", json={"messages": messages + [{"role": "assistant", "content": "It"}],
                                                      "continue_final_message": True}), 400)
    _error(httpx.post(server.url + "/tokenize", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    _error(httpx.post(server.url + "/detokenize", json={"model": "gpt-4", "tokens": [1]}), 404, "model")


def test_metrics_exposition(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "count me", "max_tokens": 4, "ignore_eos": True},
               timeout=30)
    text = httpx.get(server.url + "/metrics").text
    for name in ["mili:num_requests_running", "mili:num_requests_waiting", "mili:kv_cache_usage_perc",
                 "mili:prefix_cache_queries_total", "mili:prefix_cache_hits_total", "mili:num_preemptions_total",
                 "mili:prompt_tokens_total", "mili:generation_tokens_total",
                 'mili:request_success_total{finished_reason="length"}',
                 "mili:time_to_first_token_seconds_bucket", "mili:inter_token_latency_seconds_bucket",
                 "mili:e2e_request_latency_seconds_count", "mili:request_queue_time_seconds_sum"]:
        assert name in text, name
    assert metric(server.url, "mili:generation_tokens_total") >= 4


def test_api_key(random_model):
    s = Server(random_model, "--api-key", "sekret")
    try:
        err = _error(httpx.post(s.url + "/v1/completions", json={"prompt": "x"}), 401)
        assert err["code"] == "invalid_api_key"
        _error(httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        _error(httpx.get(s.url + "/"), 401)
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
    finally:
        assert s.stop() == 0


def test_prefix_cache_hits_are_reported(server):
    long_prompt = list(range(1000, 1200))  # 200 tokens: 12 full pages
    body = {"prompt": long_prompt, "max_tokens": 2}
    hits_before = metric(server.url, "mili:prefix_cache_hits_total")
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["usage"]
    second = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == 192  # all full pages but the last token's
    assert metric(server.url, "mili:prefix_cache_hits_total") - hits_before == 192


def test_demo_model_serves(tmp_path):
    """The README's main command: `mili serve` on the trained demo model, shipped in the package (nothing is
    built or downloaded), answering the openai client in English that ends by itself."""
    from openai import OpenAI

    words = set((Path(__file__).resolve().parents[1] / "data" / "demo" / "words.txt").read_text().split())
    from mili.kernels import cpu

    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    if cpu.available():  # the kernels this machine has built (the engine's cache): the server finds them, not a compile
        shutil.copy(cpu.library(cpu.isa()), tmp_path / "cache" / "kernels")
    s = Server("demo", env={"MILI_CACHE_DIR": str(tmp_path / "cache")}, log_dir=tmp_path)
    try:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["test"]
        for thinking in (False, True):
            r = client.chat.completions.create(
                model="test", messages=[{"role": "user", "content": "Hello!"}], max_tokens=100, temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            reply = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 100, reply
            said = re.findall(r"[a-z]+", reply.lower())
            assert said and sum(w in words for w in said) >= 0.9 * len(said), reply  # the corpus's English
        r = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "Tell me about love."}],
                                           max_tokens=60, seed=1)  # sampled, the checkpoint's defaults
        assert r.choices[0].message.content.strip()
        assert not list((tmp_path / "cache").glob("demo*"))  # nothing built
    finally:
        assert s.stop() == 0, s.output()
