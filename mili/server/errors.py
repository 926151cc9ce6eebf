"""Every error a client can cause, in OpenAI's shape, mapped to its HTTP status in one place."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from mili.errors import EngineDeadError, MiliError

log = logging.getLogger("mili")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """The body of every error response (OpenAI's shape)."""

    error: ErrorDetail


# What each status means in MILI's API: the OpenAPI document's error responses (never FastAPI's 422).
ERRORS = {
    400: "Invalid request: a parameter out of range or of the wrong type, an unknown field, malformed JSON, a "
         "prompt longer than the context. `param` names the field.",
    401: "Missing or wrong API key (only when the server was started with `--api-key`).",
    404: "The model named in the request is not the one served.",
    503: "The server is busy (`queue_full`, with `Retry-After`) or its engine has stopped (`engine_dead`).",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying (queue_full only)",
                                "schema": {"type": "integer"}}}


def error_responses(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict:
    """The ``responses=`` of a route or an APIRouter: the errors it can send, each with ``model`` as its body."""
    return {status: {"model": model, "description": ERRORS[status],
                     **({"headers": _RETRY_AFTER} if status == 503 else {})} for status in statuses}


def streamed() -> dict:
    """``responses=`` of a route that streams with ``stream: true``: its 200 is JSON or server-sent events."""
    return {200: {"description": "The reply; with `stream: true`, server-sent events (`data: {...}` chunks, then "
                                 "`data: [DONE]`)",
                  "content": {"text/event-stream": {"itemSchema": {
                      "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}}}


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def to_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, f"{e}; the server cannot serve requests until it is restarted", "server_error",
                        None, e.code)
    if isinstance(e, MiliError):
        return APIError(400, str(e), "invalid_request_error", e.param, e.code)
    return APIError(500, f"internal error: {type(e).__name__}", "internal_server_error", None, "internal_error")


# Characters JSON leaves raw that line readers built on str.splitlines() (httpx's among them) take for
# line breaks, cutting an SSE event in two: escaped, as JSON allows.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


def sse_error(e: BaseException) -> str:
    """An error after a stream has started: one final SSE chunk."""
    err = to_api_error(e)
    return sse(error_body(err.message, err.type, err.param, err.code))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status, headers=e.headers)

    @app.exception_handler(MiliError)
    async def mili_error(_: Request, e: MiliError):
        err = to_api_error(e)
        return JSONResponse(error_body(err.message, err.type, err.param, err.code), err.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
            return JSONResponse(error_body(msg, "invalid_request_error", None, "invalid_json"), 400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
            msg = "the request body must be a JSON object (send Content-Type: application/json)"
            return JSONResponse(error_body(msg, "invalid_request_error", None, "invalid_json"), 400)
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":
            msg = f"unknown field {param!r}: MILI does not implement it (see the API reference in the README)"
            return JSONResponse(error_body(msg, "invalid_request_error", param, "unsupported_parameter"), 400)
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
        return JSONResponse(error_body(msg, "invalid_request_error", param, "invalid_parameter"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind, None, e.status_code), e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception):
        log.exception("unexpected error while serving a request")
        err = to_api_error(e)
        return JSONResponse(error_body(err.message, err.type, err.param, err.code), err.status)
