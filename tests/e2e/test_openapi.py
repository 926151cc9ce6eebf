"""/openapi.json tells the truth: schemathesis (`--checks all`) against a live server reports nothing.

The server runs the offline random demo model, `demo-random` (a byte-level vocabulary of 320: sampling
costs nothing) with a 64-token context and at most 2 sequences a request, so the thousand-odd generated
requests stay cheap.
The one kind of refusal a JSON schema cannot rule out is accepted by schemathesis_hooks.py, by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest


HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")  # Anthropic's error body
KEY = "sekret"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    from mili.model.demo import demo_random_checkpoint

    return demo_random_checkpoint(tmp_path_factory.mktemp("demo-cache"))


@pytest.fixture(scope="module")
def demo_server(serve, demo):
    return serve(demo, "--max-model-len", "64", "--max-num-seqs", "2")


@pytest.fixture(scope="module")
def key_server(serve, demo):
    return serve(demo, "--max-model-len", "64", "--max-num-seqs", "2", "--api-key", KEY)


def schemathesis(url: str, cwd: Path, *args: str) -> str:
    """Run the schemathesis CLI, every check, a fixed seed; returns its report (asserting it found nothing)."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all",
           "--seed", "0", "--no-color", "--generation-database", "none", "--request-timeout", "60",
           # generation is slow on a shared 2-core machine; the default limit is 10 s
           "--max-response-time", "30", "--output-sanitize", "false", *args]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=540,
                       env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)})
    report = r.stdout + r.stderr
    assert r.returncode == 0 and "No issues found" in report, report[-20000:]
    return report


def test_schemathesis_finds_nothing(demo_server, tmp_path):
    doc = httpx.get(demo_server.url + "/openapi.json").json()
    operations = sum(len(ops) for ops in doc["paths"].values())
    report = schemathesis(demo_server.url, tmp_path, "--max-examples", "10")
    assert f"Tested: {operations}" in report, report[-5000:]  # every operation, none skipped


def test_schemathesis_generation_routes_in_depth(demo_server, tmp_path):
    """The generation routes again, with enough examples that extreme values of several sampling fields meet
    in one request (temperature 1e39 with min_tokens stopped the engine once); the core must be the same
    process at the end."""
    pid = httpx.get(demo_server.url + "/health").json()["engine_core_pid"]
    report = schemathesis(demo_server.url, tmp_path, "--max-examples", "60", "--phases", "fuzzing",
                          "--include-path-regex", "^(" + "|".join(GENERATION) + ")$")
    assert f"Tested: {len(GENERATION)}" in report, report[-5000:]
    health = httpx.get(demo_server.url + "/health")
    assert health.status_code == 200 and health.json()["engine_core_pid"] == pid


def test_schemathesis_with_an_api_key(key_server, tmp_path):
    """Every guarded operation answers 401 without the key (the ignored_auth check) and works with it.
    The generation routes, fuzzed above, are left out here (auth is the same middleware for all)."""
    doc = httpx.get(key_server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    operations = sum(len(ops) for path, ops in doc["paths"].items() if path not in GENERATION)
    report = schemathesis(key_server.url, tmp_path, "--max-examples", "3", "-H", f"Authorization: Bearer {KEY}",
                          "--exclude-path-regex", "^(" + "|".join(GENERATION) + ")$")
    assert f"Tested: {operations}" in report, report[-5000:]


def _schema(doc: dict, ref_or_schema: dict) -> dict:
    ref = ref_or_schema.get("$ref", "")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else ref_or_schema


def test_document_says_what_the_server_does(demo_server):
    doc = httpx.get(demo_server.url + "/openapi.json").json()
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in doc["components"]["schemas"]
    schemas = doc["components"]["schemas"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert schemas["AnthropicError"]["required"] == ["type", "error"]
    assert schemas["AnthropicError"]["properties"]["type"]["const"] == "error"
    for path, ops in doc["paths"].items():
        error = "/AnthropicError" if path in ANTHROPIC else "/ErrorResponse"
        for method, op in ops.items():
            responses = op["responses"]
            if path in ("/health", "/metrics", "/ui"):  # open paths: no key asked
                assert "401" not in responses, path
            else:
                assert responses["401"]["content"]["application/json"]["schema"]["$ref"].endswith(error), path
            if method == "post":
                assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(error), path
                body = _schema(doc, op["requestBody"]["content"]["application/json"]["schema"])
                forms = [_schema(doc, form) for form in body.get("oneOf", [body])]  # (/tokenize: two forms)
                assert all(form["additionalProperties"] is False for form in forms), path  # unknown fields: a 400
    for path in GENERATION:
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        busy = "529" if path in ANTHROPIC else "503"  # Anthropic's overloaded_error
        assert busy in responses and "Retry-After" in responses[busy]["headers"], path
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", *ANTHROPIC):
        assert "404" in doc["paths"][path]["post"]["responses"]
    assert "500" in doc["paths"]["/v1/messages"]["post"]["responses"]  # api_error: the engine stopped
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert list(doc["paths"]["/ui"]["get"]["responses"]["200"]["content"]) == ["text/html"]
    # the server's own limits: this one has a 64-token context, 2 sequences a request, 320 token ids
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"type": "integer", "minimum": 1, "maximum": 63} in chat["max_tokens"]["anyOf"]
    assert chat["n"]["maximum"] == 2 and chat["temperature"]["anyOf"][0]["minimum"] == 0
    assert chat["tool_choice"]["anyOf"][0]["enum"] == ["none", "auto", "required"]
    messages = schemas["MessagesRequest"]
    assert messages["properties"]["max_tokens"] == {"type": "integer", "minimum": 1, "maximum": 63,
                                                    "title": "Max Tokens"}
    assert "max_tokens" in messages["required"] and messages["properties"]["temperature"]["anyOf"][0]["maximum"] == 1
    assert {"type": "integer", "minimum": 1, "maximum": 63} in (
        schemas["ResponsesRequest"]["properties"]["max_output_tokens"]["anyOf"])
    tokenize = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {_schema(doc, form)["title"] for form in tokenize["oneOf"]} == {"TokenizeCompletionRequest",
                                                                          "TokenizeChatRequest"}
    assert "add_generation_prompt" not in schemas["TokenizeCompletionRequest"]["properties"]
    assert {"model", "return_token_strs", "tools"} <= set(schemas["TokenizeChatRequest"]["properties"])
    detok = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (detok["minimum"], detok["maximum"]) == (0, 319)
    assert "securitySchemes" not in doc["components"]


def test_api_key_server_documents_its_scheme(key_server):
    assert httpx.get(key_server.url + "/openapi.json").status_code == 401
    doc = httpx.get(key_server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert doc["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer", "description": "--api-key (also accepted as an x-api-key header)"}
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
