"""The native API of the original design: /generate, /status/{id}, /health, /."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

import mili
from mili.server.state import final_output, new_id, state_of, until_disconnect
from mili.server.errors import error_responses, streamed
from mili.server.sse import DONE, sse, sse_error
from mili.server.protocol import GenerateRequest

router = APIRouter()

ENDPOINTS = ["GET /", "GET /health", "GET /version", "GET /metrics", "POST /generate", "GET /status/{request_id}",
             "POST /tokenize", "POST /detokenize", "GET /v1/models", "POST /v1/completions",
             "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages", "POST /v1/messages/count_tokens",
             "POST /v1/embeddings", "POST /v1/rerank", "POST /rerank", "POST /v2/rerank", "POST /score", "POST /v1/score",
             "GET /ui"]


@router.get("/")
async def root():
    """The original design's keys (message, version, docs, health, generate), then MILI's."""
    return {"message": "MILI: an inference server for Qwen3 models", "version": mili.__version__, "docs": "/docs",
            "health": "/health", "generate": "/generate", "name": "MILI", "endpoints": ENDPOINTS}


@router.get("/health", responses={503: {"description": "The engine cannot serve: the same fields, with status "
                                                      "\"unhealthy\" and a reason"}})
async def health(http: Request):
    """The original design's fields with status "healthy"; 503 "unhealthy" with the reason otherwise."""
    st = state_of(http)
    engine = st.engine
    reason = None if engine.error is None else str(engine.error)
    body = {"status": "healthy" if reason is None else "unhealthy", "model_loaded": True, "tokenizer_ready": True,
            "scheduler_ready": reason is None, "model_type": engine.model_config.hf_config.model_type,
            "model": st.model_name, "vocab_size": engine.model_config.vocab_size,
            "max_seq_length": engine.max_model_len, "device": engine.info.device, "dtype": engine.info.dtype,
            "quantization": engine.info.quantization, "kv_cache_dtype": engine.info.kv_cache_dtype,
            "prefix_caching": engine.info.prefix_caching, "tool_call_parser": st.tool_call_parser,
            "task": engine.inputs.task.name,
            "execution_plan": engine.info.plan,
            # the batch limits the core runs, and for each whether the device (auto) or the user set it
            "max_num_seqs": engine.config.max_num_seqs, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "batch_limits_from": engine.info.sized_by,
            "engine_core_pid": engine.core_pid, "api_server_pid": os.getpid(),
            # every API process (mili serve --api-server-count): their CPU is the server's
            "api_server_pids": st.api_servers.pids() if st.api_servers else [os.getpid()],
            **({"recurrent_state_slots": engine.info.state_slots, "recurrent_state_snapshots":
                engine.info.state_snapshots, "recurrent_state_bytes": engine.info.state_bytes}
               if engine.info.state_slots else {}),
            # the engine core's counters, from its latest step message
            **st.metrics.snapshot}
    if reason is not None:
        body["reason"] = reason
    return JSONResponse(body, status_code=200 if reason is None else 503)


@router.get("/status/{request_id}")
async def status(request_id: str, http: Request):
    st = state_of(http)
    entry = st.statuses.get(request_id)
    entry = entry.as_dict() if entry is not None else None
    if entry is None and st.api_servers is not None:  # served by another API process?
        entry = await st.api_servers.find_status(request_id)
    return {"request_id": request_id, **(entry or {"status": "not_found"})}


@router.post("/generate", responses={**error_responses(400, 404, 500, 503), **streamed()})
async def generate(body: GenerateRequest, http: Request):
    """The original design's reply: ``tokens`` are the prompt's ids then the generated ones."""
    st = state_of(http)
    budget = st.reasoning.budget(body.thinking_token_budget, None)
    params = body.sampling_params(st.sampling_defaults, budget, st.reasoning.message)
    rid = new_id("gen")

    def reply(out) -> dict:
        o = out.outputs[0]
        tokens = list(out.prompt_token_ids) + list(o.token_ids)
        return {"request_id": rid, "generated_text": o.text, "tokens": tokens, "total_tokens": len(tokens),
                "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(o.token_ids),
                "finish_reason": o.finish_reason}

    lora = st.check_model(body.model)
    if not body.stream:
        (stream,) = await st.start([body.prompt], [params], rid, lora=lora)
        return reply(await until_disconnect(http, final_output(stream)))
    return await st.start_stream([body.prompt], [params], rid, _GenerateEvents(rid, reply), lora=lora)


class _GenerateEvents:
    """A streamed /generate's events (server/step_stream.py's Events): the new text and token ids as they come,
    then the whole reply with ``finished: true``, then ``[DONE]``; an error event in their place if it fails."""

    def __init__(self, rid: str, reply):
        self.rid, self.reply = rid, reply
        self.sent = 0  # token ids sent so far
        self.last = None

    def feed(self, _: int, out) -> bytes:
        self.last = out
        o = out.outputs[0]
        if not (o.delta or len(o.token_ids) > self.sent):
            return b""
        data = sse({"request_id": self.rid, "text": o.delta, "token_ids": list(o.token_ids[self.sent:]),
                    "completion_tokens": len(o.token_ids), "finished": False, "finish_reason": None})
        self.sent = len(o.token_ids)
        return data

    def end(self) -> bytes:
        return sse({**self.reply(self.last), "finished": True}) + DONE

    def fail(self, error: BaseException) -> bytes:
        return sse_error(error) + DONE
