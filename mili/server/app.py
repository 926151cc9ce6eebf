"""The FastAPI app, assembled: the server's state (``state.py``), auth, the OpenAPI document, and the routers of
the dialects and the utility endpoints. Nothing under ``mili.server`` imports this module: the routers import
down (``state``, ``chat``, ``errors``, ``protocol``), and only ``mili serve`` builds the app."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI
from starlette.datastructures import Headers

import mili
from mili.engine.async_llm import AsyncLLM
from mili.server import adapters, anthropic, native, openai, pooling, responses, utility
from mili.server.errors import APIError, error_response, install_error_handlers
from mili.server.openapi import document
from mili.server.state import ReasoningBudgets, ServerState

log = logging.getLogger("mili")
OPEN_PATHS = {"/health", "/metrics", "/ui"}  # no API key needed (the chat page asks for one itself)


class ApiKeyMiddleware:
    """The API key check as pure ASGI middleware: a request that passes goes to the app with its scope,
    receive and send untouched, so a stream's chunks are not relayed through a memory stream as
    Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) relays them; one that fails gets the
    dialect's 401 body. Only installed when the server has a key."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        auth = headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        if hmac.compare_digest(token.encode(), self.key):
            return await self.app(scope, receive, send)
        response = error_response(scope["path"], APIError(
            401, "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
            code="invalid_api_key"))
        await response(scope, receive, send)


# the routes a server answers only with a 400 unless its task (or a flag) serves them: left out of its document
_TASK_PATHS = {"generate": ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/generate"),
               "embed": ("/v1/embeddings",), "rerank": ("/v1/rerank", "/score")}
RUNTIME_LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def unserved_paths(task: str, runtime_lora_updating: bool) -> list[str]:
    """The document's paths this server does not serve: other tasks' routes, and the LoRA routes unless on."""
    paths = [p for other, ps in _TASK_PATHS.items() if other != task for p in ps]
    return paths + ([] if runtime_lora_updating else list(RUNTIME_LORA_PATHS))


def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None,
              max_queued_requests: int = 1024, sampling_defaults: dict | None = None,
              tool_call_parser: str = "auto", api_servers=None, lora_modules: list[tuple[str, str]] = (),
              runtime_lora_updating: bool = False, reasoning: ReasoningBudgets | None = None) -> FastAPI:
    """``api_servers`` (mili.server.api_servers.ApiServers): this is one of several API processes. ``lora_modules``:
    (name, path) of the LoRA adapters served from the start; ``runtime_lora_updating``: /v1/load_lora_adapter on."""
    state = ServerState(engine, model_name, api_key, max_queued_requests, sampling_defaults, tool_call_parser,
                        api_servers, reasoning)
    state.runtime_lora_updating = runtime_lora_updating
    for name, path in lora_modules:
        state.add_lora(name, path)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()  # read the engine core's step messages on this event loop
        if api_servers is None:
            yield
            return
        # the other API processes ask this one for the status of the requests it served
        statuses = asyncio.get_running_loop().create_task(
            api_servers.serve_statuses(api_servers.status_socket(), state.statuses))
        yield
        statuses.cancel()

    app = FastAPI(title="MILI", version=mili.__version__, lifespan=lifespan)
    app.state.mili = state
    install_error_handlers(app)

    def openapi() -> dict:
        if app.openapi_schema is None:
            limits = {"token_id": engine.model_config.vocab_size - 1, "max_tokens": engine.max_model_len - 1,
                      "n": engine.config.max_num_seqs, "model": [model_name, *state.loras]}
            doc = document(app, OPEN_PATHS, bool(api_key), limits)
            for path in unserved_paths(engine.inputs.task.name, state.runtime_lora_updating):
                doc["paths"].pop(path, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    for module in (utility, openai, anthropic, responses, native, pooling, adapters):
        app.include_router(module.router)
    return app
