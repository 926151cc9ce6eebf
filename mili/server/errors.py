"""Every error a client can cause, mapped to its HTTP status and body in one place: OpenAI's shape
(``{"error": {...}}``) everywhere but Anthropic's routes (``/v1/messages``), which answer in Anthropic's
(``{"type": "error", "error": {"type", "message"}}``)."""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mili.errors import EngineDeadError, MiliError, RequestFailed
from mili.server.fields import BRANCH_TAGS

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


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """The body of an error on Anthropic's routes (``/v1/messages``)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# What each status means in MILI's API: the OpenAPI document's error responses (never FastAPI's 422).
ERRORS = {
    400: "Invalid request: a parameter out of range or of the wrong type, an unknown field, malformed JSON, a "
         "prompt longer than the context. The error names the field (OpenAI's shape: `param`).",
    401: "Missing or wrong API key (only when the server was started with `--api-key`).",
    404: "The model named in the request is not the one served.",
    500: "This request failed while it ran (`request_failed`; the server goes on serving others), or, on "
         "Anthropic's routes, the engine has stopped (`api_error`).",
    503: "The server is busy (`queue_full`, with `Retry-After`) or its engine has stopped (`engine_dead`).",
    529: "The server is busy (`overloaded_error`, with `Retry-After`): `--max-queued-requests` are waiting.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying (a full queue only)",
                                "schema": {"type": "integer"}}}


def error_responses(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict:
    """The ``responses=`` of a route or an APIRouter: the errors it can send, each with ``model`` as its body."""
    return {status: {"model": model, "description": ERRORS[status],
                     **({"headers": _RETRY_AFTER} if status in (503, 529) else {})} for status in statuses}


_SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
              "required": ["data"]}


def streamed(events: str = "`data: {...}` chunks, then `data: [DONE]`") -> dict:
    """``responses=`` of a route that streams with ``stream: true``: its 200 is JSON or server-sent ``events``."""
    return {200: {"description": f"The reply; with `stream: true`, server-sent events ({events})",
                  "content": {"text/event-stream": {"itemSchema": _SSE_EVENT}}}}


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def to_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, f"{e}; the server cannot serve requests until it is restarted", "server_error",
                        None, e.code)
    if isinstance(e, RequestFailed):
        return APIError(500, f"this request failed (the server goes on serving others): {e}", "server_error", None,
                        e.code)
    if isinstance(e, MiliError):
        return APIError(400, str(e), "invalid_request_error", e.param, e.code)
    if isinstance(e, ValidationError):  # a body a route built itself (a dialect's request, translated)
        return _validation_error(e.errors())
    return APIError(500, f"internal error: {type(e).__name__}", "internal_server_error", None, "internal_error")


ANTHROPIC_PATHS = "/v1/messages"  # these paths (and those below them) answer in Anthropic's error shape
# Anthropic's error types by status (docs.anthropic.com, "Errors"): a full queue is its 529
# overloaded_error, any other server-side failure (a dead engine too) its 500 api_error.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 529: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


def anthropic_error(err: APIError) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's shape."""
    status = 529 if err.code == "queue_full" else 500 if err.status >= 500 else err.status
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(path: str, e: BaseException) -> JSONResponse:
    """The response for an error raised while serving ``path``, in that API's shape."""
    err = to_api_error(e)
    if is_anthropic(path):
        status, body = anthropic_error(err)
        return JSONResponse(body, status, headers=err.headers)
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), err.status, headers=err.headers)


def _validation_error(errors: list) -> APIError:
    """pydantic's errors as one 400 naming the wrong field (never FastAPI's 422): the first of the deepest
    ones, the most specific where a union's branches each failed, its location without branch labels."""
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    if first.get("type") == "json_invalid":
        msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        return APIError(400, msg, code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and "[" not in str(x) and x not in BRANCH_TAGS]
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return APIError(400, "the request body must be a JSON object (send Content-Type: application/json)",
                        code="invalid_json")
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}: MILI does not implement it (see "
                        "docs/serving/errors.md)", param=param, code="unsupported_parameter")
    msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
    return APIError(400, msg, param=param, code="invalid_parameter")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return error_response(request.url.path, _validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        err = APIError(e.status_code, str(e.detail), kind, None, e.status_code, getattr(e, "headers", None))
        return error_response(request.url.path, err)

    async def client_error(request: Request, e: Exception):
        return error_response(request.url.path, e)

    for kind in (APIError, MiliError, ValidationError):  # ours, answered where they are raised
        app.add_exception_handler(kind, client_error)

    @app.exception_handler(Exception)  # anything else (Starlette answers it, then re-raises it)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error while serving a request")
        return error_response(request.url.path, e)
