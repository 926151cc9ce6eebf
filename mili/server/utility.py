"""The server's utility endpoints: /metrics, /ui (the chat page), /version, /tokenize, /detokenize."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response

import mili
from mili.server.errors import APIError, error_responses
from mili.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest, template_messages
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


@router.post("/tokenize", responses=error_responses(400, 404))
async def tokenize(body: TokenizeRequest, http: Request):
    """vLLM's ``/tokenize``: a prompt's token ids, or a conversation's as ``/v1/chat/completions`` renders it."""
    st = state_of(http)
    st.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        kwargs = body.chat_template_kwargs or {}
        messages, images = template_messages(body.messages)
        text, _ = encode_chat(st.tokenizer, messages, body.add_generation_prompt,
                              {**kwargs, "tools": body.tools} if body.tools else kwargs, body.continue_final_message)
        ids = await st.with_images(encode_prompt(st.tokenizer, text, body.add_special_tokens), images)
    else:
        ids = encode_prompt(st.tokenizer, body.prompt, body.add_special_tokens)
    out = {"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = st.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize", responses=error_responses(400, 404))
async def detokenize(body: DetokenizeRequest, http: Request):
    st = state_of(http)
    st.check_model(body.model)
    vocab = st.engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": st.tokenizer.decode(body.tokens)}
