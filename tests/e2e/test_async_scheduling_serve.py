"""`mili serve --async-scheduling on`: the engine core process schedules each step before it reads the last one's
tokens (on the CPU nothing overlaps, but the loop is the one a GPU runs). Streams, stop strings that end
sequences from the API side one step late, and clients that leave mid-stream give what the in-turn loop gives,
and every page comes back."""

from __future__ import annotations

import asyncio
import json

import httpx

from mili import LLM, SamplingParams

from support.server import metric, wait_for


def test_async_server_streams_equal_the_in_turn_engine(serve, random_model):
    server = serve(random_model, "--async-scheduling", "on")
    assert httpx.get(f"{server.url}/health").json()["execution_plan"]["scheduling"] == "ahead of the device"
    prompts = [f"request number {i} asks" for i in range(12)]
    reference = LLM(str(random_model), dtype="float32", max_model_len=1024, async_scheduling="off")
    texts = [o.outputs[0].text for o in reference.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    stops = [t[6:9] for t in texts]  # (each request's own text: it ends on that stop string)
    expected = [o.outputs[0] for o in reference.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s]) for s in stops],
        use_tqdm=False)]

    async def one(client, i):
        body = {"model": "test", "prompt": prompts[i], "max_tokens": 24, "ignore_eos": True, "temperature": 0,
                "stop": [stops[i]], "stream": True}
        text, finish, chunks = "", None, 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
                    chunks += 1
                    if i % 5 == 4 and chunks == 2:
                        return None  # this client leaves mid-stream
        return text, finish

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    results = asyncio.run(main())
    for i, (got, want) in enumerate(zip(results, expected)):
        if got is not None:
            assert got == (want.text, want.finish_reason), i
    assert sum(r is None for r in results) == 2
    assert wait_for(lambda: metric(server.url, "mili:num_requests_running") == 0)
    assert wait_for(lambda: metric(server.url, "mili:kv_cache_usage_perc") == 0)  # (idle cached pages count as free)
