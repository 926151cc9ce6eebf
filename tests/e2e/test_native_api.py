"""The original design's API, exactly: its curl and Python examples against a real server, and --config."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import requests

from support.server import Server


def curl(*args: str) -> dict:
    out = subprocess.run(["curl", "-s", *args], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_generate_with_only_a_prompt(server):
    """curl -X POST http://localhost:8000/generate -H "Content-Type: application/json" -d '{"prompt": ...}'"""
    result = curl("-X", "POST", f"{server.url}/generate", "-H", "Content-Type: application/json",
                  "-d", '{"prompt": "The future of artificial intelligence is"}')
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": "The future of artificial intelligence is"}
                            ).json()["tokens"]
    assert isinstance(result["tokens"], list) and result["tokens"][:len(prompt_ids)] == prompt_ids
    assert result["prompt_tokens"] == len(prompt_ids)
    assert result["total_tokens"] == len(result["tokens"]) == result["prompt_tokens"] + result["completion_tokens"]
    assert 1 <= result["completion_tokens"] <= 50  # the original's default max_tokens
    assert result["finish_reason"] in ("stop", "length") and result["request_id"]
    assert isinstance(result["generated_text"], str)
    assert httpx.post(server.url + "/detokenize", json={"tokens": result["tokens"][len(prompt_ids):]}
                      ).json()["prompt"] == result["generated_text"]


def test_generate_with_all_parameters_python_example(server):
    """The original's Python example: requests.post(...) then len(result['tokens'])."""
    response = requests.post(f"{server.url}/generate", json={
        "prompt": "Once upon a time",
        "max_tokens": 100,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 40,
        "stream": False,
    })
    result = response.json()
    print(f"Generated: {result['generated_text']}")
    print(f"Tokens: {len(result['tokens'])}")
    assert response.status_code == 200
    assert len(result["tokens"]) == result["total_tokens"] <= result["prompt_tokens"] + 100
    status = requests.get(f"{server.url}/status/{result['request_id']}").json()
    assert status == {"request_id": result["request_id"], "status": "completed",
                      "tokens_generated": result["completion_tokens"], "tokens_remaining": 0}


def test_generate_defaults_are_the_originals(server):
    """Unset: temperature 1.0, top_p 0.95, top_k 50 (so a seed reproduces the same draw either way)."""
    body = {"prompt": "Hello", "max_tokens": 12, "seed": 7}
    implicit = httpx.post(server.url + "/generate", json=body, timeout=30).json()
    explicit = httpx.post(server.url + "/generate", timeout=30,
                          json={**body, "temperature": 1.0, "top_p": 0.95, "top_k": 50}).json()
    other = httpx.post(server.url + "/generate", timeout=30,
                       json={**body, "temperature": 1.0, "top_p": 1.0, "top_k": -1}).json()
    assert implicit["tokens"] == explicit["tokens"]
    assert implicit["tokens"] != other["tokens"]  # the defaults do restrict the draw


def test_generate_streamed(server):
    """curl -N ... -d '{"prompt": ..., "stream": true}': SSE events, then the full reply, then [DONE]."""
    proc = subprocess.run(["curl", "-s", "-N", "-X", "POST", f"{server.url}/generate", "-H",
                           "Content-Type: application/json", "-d",
                           '{"prompt": "Tell me a story", "max_tokens": 20, "temperature": 0, "stream": true}'],
                          capture_output=True, text=True, timeout=60, check=True)
    events = [line[6:] for line in proc.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    final = chunks[-1]
    assert final["finished"] and isinstance(final["tokens"], list) and final["total_tokens"] == len(final["tokens"])
    assert "".join(c["text"] for c in chunks[:-1]) == final["generated_text"]
    streamed_ids = [t for c in chunks[:-1] for t in c["token_ids"]]
    assert final["tokens"] == final["tokens"][:final["prompt_tokens"]] + streamed_ids
    whole = httpx.post(server.url + "/generate", timeout=30,
                       json={"prompt": "Tell me a story", "max_tokens": 20, "temperature": 0}).json()
    assert whole["tokens"] == final["tokens"] and whole["generated_text"] == final["generated_text"]


def test_health_and_root(server):
    health = curl(f"{server.url}/health")
    assert health["status"] == "healthy"
    assert health["model_loaded"] is True and health["tokenizer_ready"] is True and health["scheduler_ready"] is True
    assert health["model_type"] == "qwen3" and health["vocab_size"] == 151936 and health["max_seq_length"] == 1024
    assert health["model"] == "test" and health["kv_cache_pages"] >= 1  # MILI's extras stay
    assert health["quantization"] == "unquantized" and health["kv_cache_dtype"] == "float32"
    plan = health["execution_plan"]  # the plan the core made (mili/runtime/plan.py), in words
    assert plan["dtype"] == "float32" and plan["attention"] == "torch" and plan["weights"] == "unquantized"
    # the batch limits the core runs (auto: sized by the device, the CPU's 256 / 2048), reached over its Ready message
    assert (health["max_num_seqs"], health["max_num_batched_tokens"]) == (256, 2048)
    assert health["batch_limits_from"] == {"max_num_seqs": "device", "max_num_batched_tokens": "device"}
    assert plan["batch"] == "256 sequences (by the device), 2048 tokens a step (by the device)"
    root = curl(f"{server.url}/")
    assert {"message", "version", "docs", "health", "generate"} <= set(root)
    assert root["health"] == "/health" and root["generate"] == "/generate" and "POST /generate" in root["endpoints"]
    assert httpx.get(server.url + root["docs"]).status_code == 200


def test_status_while_processing(server):
    with httpx.stream("POST", server.url + "/generate", timeout=60,
                      json={"prompt": "Hi", "max_tokens": 400, "temperature": 0, "stream": True}) as s:
        lines = s.iter_lines()
        first = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        status = httpx.get(f"{server.url}/status/{first['request_id']}").json()
        assert status["status"] in ("processing", "completed")
        if status["status"] == "processing":
            assert status["tokens_generated"] + status["tokens_remaining"] == 400 and status["tokens_generated"] >= 1
        for _ in lines:
            pass
    assert httpx.get(f"{server.url}/status/{first['request_id']}").json()["status"] == "completed"
    assert httpx.get(f"{server.url}/status/no-such-id").json() == {"request_id": "no-such-id", "status": "not_found"}


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 4097}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.01}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "beam_width": 4}, "beam_width"),
    ({"max_tokens": 5}, "prompt"),
])
def test_generate_out_of_range_is_4xx(server, body, param):
    r = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "guided_decoding_backend": "outlines"},
     "guided_decoding_backend"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"50": 10}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_unimplemented_fields_are_400_naming_them(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                          "response_format": {"type": "text"}}, timeout=30)
    assert ok.status_code == 200


# -- mili serve --config -------------------------------------------------------------------------
CONFIG = """
inference:
  device: cpu
  dtype: float32
  max_batch_size: 8
kv_cache:
  page_size: 16
  num_pages: 100
sampling:
  temperature: 0
  top_p: 1.0
  top_k: 50
max_model_len: 512
"""


def test_config_file_layout_and_flag_override(random_model, tmp_path):
    (tmp_path / "mili.yaml").write_text(CONFIG)
    # support.server.Server passes --max-model-len 1024 on the command line: it overrides the file's 512
    s = Server(random_model, "--config", str(tmp_path / "mili.yaml"), log_dir=tmp_path)
    try:
        health = httpx.get(s.url + "/health").json()
        assert health["kv_cache_pages"] == 100  # kv_cache.num_pages: the pool, exactly
        assert health["max_seq_length"] == 1024 and health["dtype"] == "float32" and health["device"] == "cpu"
        # sampling.temperature 0 is the default for requests that leave it unset: greedy, so repeatable
        first, second = (httpx.post(s.url + "/generate", json={"prompt": "Hello", "max_tokens": 8}, timeout=30).json()
                         for _ in range(2))
        greedy = httpx.post(s.url + "/generate", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0},
                            timeout=30).json()
        assert first["tokens"] == second["tokens"] == greedy["tokens"]
        chat = [httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=30).json()
                ["choices"][0]["text"] for _ in range(2)]
        assert chat[0] == chat[1] == greedy["generated_text"]
        # inference.max_batch_size is max_num_seqs: n above it is refused
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "n": 9, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and "max_num_seqs (8)" in r.json()["error"]["message"]
    finally:
        assert s.stop() == 0


def test_config_file_json_sizes_the_pool(random_model, tmp_path):
    (tmp_path / "mili.json").write_text(json.dumps({"kv_cache": {"num_pages": 70}, "no_prefix_cache": True}))
    s = Server(random_model, "--config", str(tmp_path / "mili.json"), log_dir=tmp_path)
    try:
        health = httpx.get(s.url + "/health").json()
        assert health["kv_cache_pages"] == 70 and health["prefix_caching"] is False
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("text, named", [
    ("inference:\n  max_batch_sise: 4\n", "inference.max_batch_sise"),
    ("kv_cache:\n  num_pages: lots\n", "kv_cache.num_pages"),
    ("kv_cache:\n  num_pages: 0\n", "kv_cache.num_pages"),
    ("sampling:\n  top_p: 2\n", "sampling.top_p"),
    ("max_modle_len: 4096\n", "max_modle_len"),
    ("inference:\n  dtype: int4\n", "inference.dtype"),
])
def test_config_file_mistakes_exit_nonzero_naming_the_key(random_model, tmp_path, text, named):
    (tmp_path / "bad.yaml").write_text(text)
    proc = subprocess.run([sys.executable, "-m", "mili.cli", "serve", str(random_model), "--config",
                           str(tmp_path / "bad.yaml")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and named in proc.stderr, proc.stderr
    assert "Loading weights" not in proc.stderr and "Uvicorn running" not in proc.stderr


def test_example_config_in_the_repo_is_valid():
    from pathlib import Path

    from mili.cli import build_parser
    from mili.config_file import read_config_file

    parser = build_parser()
    values, sampling = read_config_file(str(Path(__file__).parents[2] / "examples" / "mili.yaml"),
                                        parser.serve_parser)
    assert values["num_kv_pages"] == 2048 and values["max_num_seqs"] == 64 and sampling["top_k"] == 50


def test_log_level_warning_silences_the_request_lines(server, random_model, tmp_path):
    """--log-level is MILI's as well as uvicorn's: at the default (info) each request leaves a line, at warning
    none does."""
    def one_request(s: Server) -> None:
        assert httpx.post(s.url + "/generate", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200

    one_request(server)
    assert "completion tokens, ttft" in server.output()
    quiet = Server(random_model, "--log-level", "warning", log_dir=tmp_path)
    try:
        one_request(quiet)
    finally:
        assert quiet.stop() == 0, quiet.output()
    assert "completion tokens, ttft" not in quiet.output()
