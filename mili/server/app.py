"""The FastAPI app: state shared by the routes, auth, the utility endpoints, and `mili serve`."""

from __future__ import annotations

import contextlib
import hmac
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response

import mili
from mili.engine.client import AsyncLLM
from mili.server.errors import APIError, error_response, error_responses, install_error_handlers
from mili.server.openapi import document
from mili.server import anthropic, native, openai, responses
from mili.server.protocol import DetokenizeRequest, TokenizeRequest
from mili.server.state import ServerState
from mili.tokenizer.tokenizer import encode_chat, encode_prompt

log = logging.getLogger("mili")
OPEN_PATHS = {"/health", "/metrics", "/ui"}  # no API key needed (the chat page asks for one itself)
UI_PAGE = Path(__file__).parent / "static" / "ui.html"
def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None,
              max_queued_requests: int = 1024, sampling_defaults: dict | None = None,
              tool_call_parser: str = "auto") -> FastAPI:
    state = ServerState(engine, model_name, api_key, max_queued_requests, sampling_defaults, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()  # read the engine core's step messages on this event loop
        yield

    app = FastAPI(title="MILI", version=mili.__version__, lifespan=lifespan)
    app.state.mili = state
    install_error_handlers(app)

    def openapi() -> dict:
        if app.openapi_schema is None:
            limits = {"token_id": engine.model_config.vocab_size - 1, "max_tokens": engine.max_model_len - 1,
                      "n": engine.config.max_num_seqs, "model": [model_name]}
            app.openapi_schema = document(app, OPEN_PATHS, bool(api_key), limits)
        return app.openapi_schema

    app.openapi = openapi

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if state.api_key and request.url.path not in OPEN_PATHS:
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                return error_response(request.url.path, APIError(
                    401, "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
                    code="invalid_api_key"))
        return await call_next(request)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format (version 0.0.4)"}})
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/ui", response_class=HTMLResponse, responses={200: {"description": "A chat page for this server"}})
    async def ui():
        return FileResponse(UI_PAGE, media_type="text/html")

    @app.get("/version")
    async def version():
        return {"version": mili.__version__}

    @app.post("/tokenize", responses=error_responses(400))
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            _, ids = encode_chat(state.tokenizer, [m.for_template() for m in body.messages],
                                 body.add_generation_prompt, body.chat_template_kwargs, body.continue_final_message)
        else:
            ids = encode_prompt(state.tokenizer, body.prompt, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", responses=error_responses(400))
    async def detokenize(body: DetokenizeRequest):
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.include_router(native.router)
    return app
