"""Embeddings and reranking through a real server: the ``openai`` client's ``embeddings.create`` against
sentence-transformers, ``httpx`` on ``/v1/rerank`` (and Jina's and Cohere's paths) and vLLM's ``/score`` against
Qwen3-Reranker's recipe on transformers; what each server says of its task; and bad input answered with a 4xx
that leaves the engine serving."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch

from support.pooling import QUERY_PROMPT, hf_rerank_scores, st_embeddings
from support.server import metric, openai_client

TEXTS = ["The quick brown fox jumps over the lazy dog.", "敏捷的棕色狐狸跳过了懒狗。", "short"]
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other.",
        "北京是中华人民共和国的首都。", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def embed_server(serve, retrieval_model):
    return serve(retrieval_model("embed"), "--page-size", "4")


@pytest.fixture(scope="module")
def rerank_server(serve, retrieval_model):
    return serve(retrieval_model("rerank"), "--task", "rerank", "--page-size", "4")


def test_embeddings_through_the_openai_client(embed_server, retrieval_model):
    path = retrieval_model("embed")
    client = openai_client(embed_server)
    ref = st_embeddings(path, TEXTS)
    out = client.embeddings.create(model="test", input=TEXTS)  # (the client asks for base64 and decodes it)
    got = torch.tensor([d.embedding for d in out.data])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert [d.index for d in out.data] == [0, 1, 2] and out.usage.prompt_tokens == out.usage.total_tokens > 0
    one = client.embeddings.create(model="test", input=TEXTS[0], encoding_format="float", dimensions=32)
    torch.testing.assert_close(torch.tensor(one.data[0].embedding),
                               torch.nn.functional.normalize(ref[0, :32], dim=0), atol=1e-5, rtol=0)
    queries = httpx.post(f"{embed_server.url}/v1/embeddings", json={
        "input": TEXTS, "instruction": INSTRUCTION, "encoding_format": "base64"}).json()
    raw = [struct.unpack(f"<{64}f", base64.b64decode(d["embedding"])) for d in queries["data"]]
    torch.testing.assert_close(torch.tensor(raw), st_embeddings(path, TEXTS, prompt=QUERY_PROMPT), atol=1e-5, rtol=0)
    ids = client.embeddings.create(model="test", input=[[9707, 1879, 151643]], encoding_format="float")
    assert len(ids.data[0].embedding) == 64


def test_an_embed_server_says_its_task_and_refuses_chat(embed_server):
    url = embed_server.url
    assert httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}).status_code == 200  # (counted below)
    assert httpx.get(f"{url}/health").json()["task"] == "embed"
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["task"] == "embed"
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "runs the embed task" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", json={"model": "test", "max_tokens": 8,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "--task generate" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", json={"prompt": "hi"})
    assert r.status_code == 400 and "embed task" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "--task rerank" in r.json()["error"]["message"]
    assert metric(url, 'mili:pooling_requests_total{task="embed"}') >= 1
    assert metric(url, 'mili:pooling_inputs_total{task="embed"}') >= 3


def test_bad_embedding_input_is_a_400_and_the_engine_goes_on(embed_server, retrieval_model):
    url = embed_server.url
    cases = [({"input": []}, "input"), ({"input": ""}, "input"), ({"input": "a", "dimensions": 0}, "dimensions"),
             ({"input": "a", "dimensions": 65}, "dimensions"), ({"input": "word " * 1100}, "input"),
             ({"input": ["a"] * 10_000}, "input"), ({"input": "a", "truncate_prompt_tokens": 2000},
                                                    "truncate_prompt_tokens"),
             ({"input": [[-1]]}, "input"), ({"input": "a", "encoding_format": "int8"}, "encoding_format")]
    for body, param in cases:
        r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "word " * 1100, "truncate_prompt_tokens": -1,
                                                 "encoding_format": "float"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1024
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "healthy"
    ref = st_embeddings(retrieval_model("embed"), TEXTS[:1])
    r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"}).json()
    torch.testing.assert_close(torch.tensor(r["data"][0]["embedding"]), ref[0], atol=1e-5, rtol=0)


def test_rerank_and_score_match_the_official_recipe(rerank_server, retrieval_model):
    url = rerank_server.url
    ref = hf_rerank_scores(retrieval_model("rerank"), QUERY, DOCS).tolist()
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(f"{url}{path}", json={"model": "test", "query": QUERY, "documents": DOCS}).json()
        results = r["results"]
        assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
        for x in results:
            assert x["relevance_score"] == pytest.approx(ref[x["index"]], abs=1e-5)
            assert x["document"] == {"text": DOCS[x["index"]]}
        assert r["usage"]["total_tokens"] > 0
    # the system prompt, instruction and query are computed once per server: later requests find them cached
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40 * len(DOCS)
    top = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                               "top_n": 2, "return_documents": False}).json()["results"]
    assert len(top) == 2 and "document" not in top[0] and top[0]["relevance_score"] >= top[1]["relevance_score"]
    for path in ("/score", "/v1/score"):
        data = httpx.post(f"{url}{path}", json={"text_1": QUERY, "text_2": DOCS}).json()["data"]
        assert [d["index"] for d in data] == list(range(len(DOCS)))
        assert [d["score"] for d in data] == pytest.approx(ref, abs=1e-5)
    one = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS[0]}).json()["data"]
    assert [d["score"] for d in one] == pytest.approx(ref[:1], abs=1e-5)
    instructed = hf_rerank_scores(retrieval_model("rerank"), QUERY, DOCS[:2], "Find the capital").tolist()
    pairs = httpx.post(f"{url}/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2],
                                             "instruction": "Find the capital"}).json()["data"]
    assert [d["score"] for d in pairs] == pytest.approx(instructed, abs=1e-5)


def test_a_rerank_server_refuses_bad_input_and_other_tasks(rerank_server):
    url = rerank_server.url
    assert httpx.get(f"{url}/health").json()["task"] == "rerank"
    assert httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS[0]}).status_code == 200  # (counted below)
    cases = [("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
             ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
             ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
             ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 10_000}, "documents"),
             ("/v1/rerank", {"query": QUERY, "documents": ["word " * 1100]}, "documents"),
             ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS[:3]}, "text_1"),
             ("/v1/embeddings", {"input": "a"}, "model"),
             ("/v1/completions", {"prompt": "a"}, "model")]
    for path, body, param in cases:
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.text)
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "a"})
    assert "--task embed" in r.json()["error"]["message"]
    cut = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": ["word " * 1100],
                                               "truncate_prompt_tokens": -1}).json()
    assert cut["usage"]["prompt_tokens"] == 1024 and 0 < cut["results"][0]["relevance_score"] < 1
    assert httpx.get(f"{url}/health").json()["status"] == "healthy"
    assert metric(url, 'mili:pooling_requests_total{task="rerank"}') >= 1
