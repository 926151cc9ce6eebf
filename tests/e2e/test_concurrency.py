"""Many streams at once, clients that leave, a full queue, and SIGTERM with requests in flight."""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx

from support.checkpoints import build_checkpoint
from support.server import Server, metric, wait_for


def test_cancelled_streams_free_their_pages(server):
    async def one(client, i, drop):
        body = {"model": "test", "prompt": f"request number {i}", "max_tokens": 48, "ignore_eos": True,
                "temperature": 0.8, "seed": i, "stream": True}
        chunks = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if drop and chunks == 3:
                        return "dropped"  # leaves the context: the connection is closed mid-stream
                if line == "data: [DONE]":
                    return "done"
        return "eof"

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i, drop=i % 4 == 0) for i in range(64)))

    results = asyncio.run(main())
    assert results.count("dropped") == 16 and results.count("done") == 48
    assert wait_for(lambda: metric(server.url, "mili:num_requests_running") == 0)

    def pool_whole():  # every page free, or idle in the prefix cache
        h = httpx.get(server.url + "/health").json()
        return h["kv_cache_pages_free"] + h["kv_cache_pages_cached"] == h["kv_cache_pages"]

    assert wait_for(pool_whole), "KV pages leaked"
    assert metric(server.url, "mili:kv_cache_usage_perc") == 0
    assert metric(server.url, "mili:num_requests_waiting") == 0
    assert metric(server.url, 'mili:request_success_total{finished_reason="length"}') >= 48


def test_full_queue_is_503_with_retry_after(tmp_path):
    """One sequence at a time and room for two waiting: of 16 simultaneous requests that each take about
    a second, the ones that find the queue full get 503 with Retry-After at once; every accepted one
    completes."""
    s = Server(build_checkpoint(tmp_path / "slow", "slow"), "--max-num-seqs", "1", "--max-queued-requests", "2")
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 100, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=120, limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(16)))

    try:
        replies = asyncio.run(main())
        refused = [r for r in replies if r.status_code == 503]
        accepted = [r for r in replies if r.status_code == 200]
        assert refused and len(accepted) >= 2 and len(refused) + len(accepted) == 16
        for r in refused:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        assert all(r.json()["usage"]["completion_tokens"] == 100 for r in accepted)
        assert wait_for(lambda: metric(s.url, "mili:num_requests_running") == 0
                         and metric(s.url, "mili:num_requests_waiting") == 0)
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        assert s.stop() == 0, s.output()


def test_sigterm_lets_in_flight_requests_finish(random_model):
    s = Server(random_model, "--shutdown-timeout", "20")
    received: list[str] = []

    def stream():
        body = {"prompt": "finish me", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    received.append(line)

    t = threading.Thread(target=stream)
    t.start()
    assert wait_for(lambda: len(received) >= 2)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert received[-1] == "data: [DONE]"
    finals = [json.loads(x[6:]) for x in received[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(30) == 0, s.output()
    s.stop()
