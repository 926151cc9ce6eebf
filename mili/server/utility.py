"""The server's utility endpoints: /metrics, /ui (the chat page), /version, /tokenize, /detokenize."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response

import mili
from mili.server.errors import APIError, error_responses
from mili.server.protocol import DetokenizeRequest, TokenizeRequest, template_messages
from mili.server.state import state_of
from mili.tokenizer.tokenizer import encode_chat, encode_prompt

router = APIRouter()
UI_PAGE = Path(__file__).parent / "static" / "ui.html"


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition format (version 0.0.4)"}})
async def metrics(http: Request):
    return Response(state_of(http).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/ui", response_class=HTMLResponse, responses={200: {"description": "A chat page for this server"}})
async def ui():
    return FileResponse(UI_PAGE, media_type="text/html")


@router.get("/version")
async def version():
    return {"version": mili.__version__}


@router.post("/tokenize", responses=error_responses(400))
async def tokenize(body: TokenizeRequest, http: Request):
    st = state_of(http)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        messages, images = template_messages(body.messages)
        _, ids = encode_chat(st.tokenizer, messages, body.add_generation_prompt, body.chat_template_kwargs,
                             body.continue_final_message)
        ids = await st.with_images(ids, images)
    else:
        ids = encode_prompt(st.tokenizer, body.prompt, body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": st.engine.max_model_len}


@router.post("/detokenize", responses=error_responses(400))
async def detokenize(body: DetokenizeRequest, http: Request):
    st = state_of(http)
    vocab = st.engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": st.tokenizer.decode(body.tokens)}
