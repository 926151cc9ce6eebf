"""The pooling APIs, on a server run with ``--task embed`` or ``--task rerank`` (mili/engine/pooling.py):

- ``POST /v1/embeddings``: OpenAI's shape (``input`` texts or token ids, ``encoding_format`` float or base64,
  ``dimensions``), with vLLM's ``truncate_prompt_tokens`` and a query ``instruction``;
- ``POST /v1/rerank``, ``/rerank``, ``/v2/rerank``: Jina's and Cohere's shape (``query``, ``documents``, ``top_n``,
  ``return_documents``), results sorted by ``relevance_score``;
- ``POST /score``, ``/v1/score``: vLLM's (``text_1`` against ``text_2``; ``data`` holds ``{index, score}``).

Each input (or pair) is one engine request, computed like a prefill and batched with whatever else runs; the
prefix cache shares what they share. On a server running another task these answer 400, naming it."""

from __future__ import annotations

import base64
import struct
import time

from fastapi import APIRouter, Request

from mili.engine.pooling import PoolingInputs, check_dimensions, embedding
from mili.outputs import RequestOutput
from mili.sampling_params import SamplingParams
from mili.server.errors import APIError, error_responses
from mili.server.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from mili.server.state import ServerState, merge, new_id, state_of, until_disconnect

router = APIRouter()
POOLING_ERRORS = error_responses(400, 404, 500, 503)


async def _collect(streams) -> list[RequestOutput]:
    finals: list = [None] * len(streams)
    async for i, out in merge(streams):
        finals[i] = out
    return finals


async def _pool(http: Request, st: ServerState, prompts: list[list[int]], prefix: str) -> tuple[str, list[RequestOutput]]:
    """Run one engine request per prompt; (the response id, their final outputs in order)."""
    params = SamplingParams(max_tokens=0, pooling=st.engine.inputs.task.pooling)
    rid = new_id(prefix)
    finals = await until_disconnect(http, _collect(await st.start(prompts, [params] * len(prompts), rid)))
    for out in finals:
        if out.pooled is None:  # (failed while running: the engine ended it and went on)
            raise APIError(500, f"request {out.request_id} failed: {out.error or 'no result'}", "server_error",
                           code="request_failed")
    return rid, finals


def _inputs(st: ServerState) -> PoolingInputs:
    engine = st.engine
    return PoolingInputs(engine.tokenizer, engine.inputs.task, engine.max_model_len)


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    return {"prompt_tokens": prompt, "total_tokens": prompt,
            "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)}}


def _check_task(st: ServerState, task: str) -> None:
    """A 400 before any tokenizing when the server runs another task (the engine would refuse it too)."""
    st.engine.inputs.check_task(task)


@router.post("/v1/embeddings", responses=POOLING_ERRORS)
async def embeddings(body: EmbeddingRequest, http: Request):
    st = state_of(http)
    st.check_model(body.model)
    _check_task(st, "embed")
    check_dimensions(body.dimensions, st.engine.model_config.hidden_size)
    prompts = _inputs(st).embed(body.inputs(), body.instruction, body.truncate_prompt_tokens)
    rid, finals = await _pool(http, st, prompts, "embd")
    normalize = st.engine.inputs.task.normalize
    data = []
    for i, out in enumerate(finals):
        vector = embedding(out.pooled, body.dimensions, normalize)
        if body.encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    st.metrics.count_pooling("embed", finals)
    return {"id": rid, "object": "list", "created": int(time.time()), "model": st.model_name, "data": data,
            "usage": _usage(finals)}


async def _scores(http: Request, st: ServerState, pairs: list[tuple[str, str]], instruction: str | None,
                  truncate: int | None, param: str, prefix: str) -> tuple[str, list[float], list[RequestOutput]]:
    _check_task(st, "rerank")
    prompts = _inputs(st).score(pairs, instruction, truncate, param)
    rid, finals = await _pool(http, st, prompts, prefix)
    st.metrics.count_pooling("rerank", finals)
    return rid, [out.pooled[0] for out in finals], finals


@router.post("/v1/rerank", responses=POOLING_ERRORS)
@router.post("/rerank", responses=POOLING_ERRORS, include_in_schema=False)
@router.post("/v2/rerank", responses=POOLING_ERRORS, include_in_schema=False)
async def rerank(body: RerankRequest, http: Request):
    """Jina's and Cohere's rerank; MILI builds the reranker's prompt (Qwen3-Reranker's) from the query and each
    document."""
    st = state_of(http)
    st.check_model(body.model)
    texts = body.texts()
    rid, scores, finals = await _scores(http, st, [(body.query, t) for t in texts], body.instruction,
                                        body.truncate_prompt_tokens, "documents", "rerank")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}}
                                                              if body.return_documents else {})} for i in order]
    return {"id": rid, "model": st.model_name, "results": results, "usage": _usage(finals)}


@router.post("/score", responses=POOLING_ERRORS)
@router.post("/v1/score", responses=POOLING_ERRORS, include_in_schema=False)
async def score(body: ScoreRequest, http: Request):
    """vLLM's score: each (text_1, text_2) pair's relevance, in order."""
    st = state_of(http)
    st.check_model(body.model)
    rid, scores, finals = await _scores(http, st, body.pairs(), body.instruction, body.truncate_prompt_tokens,
                                        "text_2", "score")
    return {"id": rid, "object": "list", "created": int(time.time()), "model": st.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(finals)}
