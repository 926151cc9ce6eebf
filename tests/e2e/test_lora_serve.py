"""LoRA adapters through a real server: the ``openai`` client names an adapter in ``model`` and gets PEFT's greedy
tokens; every dialect takes the name; ``/v1/models`` lists adapters with their parent; adapters load and unload at
run time (vLLM's routes), and a missing, corrupt or mismatched one is a 400 that leaves the server serving."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from support.lora import build_adapter
from support.parity import hf_greedy
from support.server import openai_client

PROMPT = [5, 17, 99, 3, 250, 40, 11]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, qwen3_checkpoint):
    base = qwen3_checkpoint("gqa4_realvocab")  # (the real vocabulary: chat prompts are in range)
    root = tmp_path_factory.mktemp("lora-serve")
    refs = {"a": build_adapter(base, root / "a", 1),
            "b": build_adapter(base, root / "b", 2, rank=8, targets=("q_proj", "v_proj", "down_proj"))}
    other = build_adapter(qwen3_checkpoint("gqa_untied"), root / "other", 3)  # made for another base
    del other
    return base, root, refs


@pytest.fixture(scope="module")
def lora_server(serve, lora_setup):
    base, root, _ = lora_setup
    return serve(base, "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"a={root / 'a'}",
                 '{"name": "b", "path": "' + str(root / "b") + '"}', "--allow-runtime-lora-updating")


def test_adapters_through_the_openai_client(lora_server, lora_setup):
    """Each adapter's greedy completion is PEFT's (its tokens' text), the base model's is the base's."""
    base, _, refs = lora_setup
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    client = openai_client(lora_server)
    for model, ref in (("a", refs["a"]), ("b", refs["b"]), ("test", plain)):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True, "skip_special_tokens": False})
        expected, _ = hf_greedy(ref, [PROMPT], 10)[0]
        assert out.model == model and out.choices[0].text == tokenizer.decode(expected), model
    models = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("test", None), ("a", "test"), ("b", "test")]


def test_every_dialect_takes_an_adapter_name(lora_server):
    url = lora_server.url
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "a", "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "a"
    messages = httpx.post(f"{url}/v1/messages", json={"model": "b", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 200 and messages.json()["model"] == "b"
    responses = httpx.post(f"{url}/v1/responses", json={"model": "a", "input": "hi", "max_output_tokens": 4})
    assert responses.status_code == 200
    generate = httpx.post(f"{url}/generate", json={"model": "a", "prompt": "hi", "max_tokens": 4})
    assert generate.status_code == 200
    unknown = httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{url}/generate", json={"model": "nope", "prompt": "hi"}).status_code == 404


def test_adapters_load_and_unload_at_run_time(lora_server, lora_setup, tmp_path):
    _, root, refs = lora_setup
    url = lora_server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a")})
    assert r.status_code == 200, r.text
    same = [httpx.post(f"{url}/v1/completions", json={"model": m, "prompt": PROMPT, "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
            for m in ("a", "a2")]
    assert same[0] == same[1]
    corrupt = tmp_path / "corrupt"
    shutil.copytree(root / "a", corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"nonsense")
    for path, match in ((tmp_path / "missing", "no adapter_config.json"), (corrupt, "cannot be read"),
                        (root / "other", "do not fit the base's layer")):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "a")})
    assert r.status_code == 400 and "taken" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"model": "a2", "prompt": "hi"}).status_code == 404
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
    assert httpx.get(f"{url}/health").json()["status"] == "healthy"
