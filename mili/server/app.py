"""The FastAPI app, assembled: the server's state (``state.py``), auth, the OpenAPI document, and the routers of
the dialects and the utility endpoints. Nothing under ``mili.server`` imports this module: the routers import
down (``state``, ``chat``, ``errors``, ``protocol``), and only ``mili serve`` builds the app."""

from __future__ import annotations

import contextlib
import hmac
import logging

from fastapi import FastAPI, Request

import mili
from mili.engine.client import AsyncLLM
from mili.server import anthropic, native, openai, responses, utility
from mili.server.errors import APIError, error_response, install_error_handlers
from mili.server.openapi import document
from mili.server.state import ServerState

log = logging.getLogger("mili")
OPEN_PATHS = {"/health", "/metrics", "/ui"}  # no API key needed (the chat page asks for one itself)


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

    for module in (utility, openai, anthropic, responses, native):
        app.include_router(module.router)
    return app
