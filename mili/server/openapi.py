"""The OpenAPI document (/openapi.json): FastAPI's, plus what FastAPI cannot see from the routes.

- MILI never answers 422: errors.py turns every validation error into a 400 in its API's shape, so
  FastAPI's 422 and its HTTPValidationError schema are dropped;
- the API-key middleware (app.py) guards every path but ``OPEN_PATHS``: those paths document its 401
  (in Anthropic's shape on Anthropic's paths), and when the server has a key, a bearer security scheme;
- limits that only the running server knows (vocabulary, context, batch width) fill the maxima the
  request models mark with ``fields.runtime_maximum``, the served model's name the ``model`` fields' enum;
  integer bounds are written as integers (FastAPI's models hold them as floats, and 2**63 - 2 is not a float).

Routes document their own errors with ``errors.error_responses`` and their streams with ``errors.streamed``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from mili.server.errors import ERRORS, AnthropicError, ErrorResponse, is_anthropic
from mili.server.fields import RUNTIME_ENUM, RUNTIME_MAXIMUM

DESCRIPTION = """MILI's OpenAI-compatible, Anthropic-compatible and native APIs. A chat page for this
server is at [/ui](/ui). Every error is `{"error": {"message", "type", "param", "code"}}`, but on
Anthropic's paths (`/v1/messages`), `{"type": "error", "error": {"type", "message"}}`; invalid input is
a 400 naming the field (never a 422)."""


def document(app: FastAPI, open_paths: set[str], api_key: bool, limits: dict) -> dict:
    """The document for ``app``; ``limits``: the values of the runtime maxima (token_id, max_tokens, n) and
    enums (model)."""
    doc = get_openapi(title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes)
    for path, operations in doc["paths"].items():
        body = (AnthropicError if is_anthropic(path) else ErrorResponse).__name__
        unauthorized = {"description": ERRORS[401], "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body}"}}}}
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if path not in open_paths:
                operation["responses"]["401"] = unauthorized
                if api_key:
                    operation["security"] = [{"apiKey": []}]
    schemas = doc["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if api_key:
        doc["components"]["securitySchemes"] = {"apiKey": {
            "type": "http", "scheme": "bearer", "description": "--api-key (also accepted as an x-api-key header)"}}
    _fill_maxima(doc, limits)
    return doc


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _fill_maxima(node, limits: dict) -> None:
    """Fill the runtime maxima and enums; an integer's bounds as integers (FastAPI's models make them floats)."""
    if isinstance(node, dict):
        if RUNTIME_MAXIMUM in node:
            node["maximum"] = limits[node.pop(RUNTIME_MAXIMUM)]
        if RUNTIME_ENUM in node:
            node["enum"] = limits[node.pop(RUNTIME_ENUM)]
        if node.get("type") == "integer":
            node.update({k: int(node[k]) for k in _BOUNDS if isinstance(node.get(k), float)})
        for value in node.values():
            _fill_maxima(value, limits)
    elif isinstance(node, list):
        for value in node:
            _fill_maxima(value, limits)
