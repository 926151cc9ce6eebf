"""docs/reference/http.md's route table is the served OpenAPI document's routes, both ways: a route added to the
server without a row, or a row for a route that is gone, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "http.md"


def test_the_route_table_is_the_served_document(docs_server):
    """(The docs' server generates text: the table's rows for the other tasks' routes and the run-time LoRA routes,
    which its document leaves out, are set aside.)"""
    from mili.server.app import unserved_paths

    served = {(method.upper(), path)
              for path, operations in httpx.get(docs_server.url + "/openapi.json").json()["paths"].items()
              for method in operations}
    table = set(re.findall(r"^\| (GET|POST|PUT|PATCH|DELETE) \| `([^`]+)` \|", PAGE.read_text(), re.MULTILINE))
    table = {(method, path) for method, path in table if path not in unserved_paths("generate", False)}
    assert served - table == set(), "routes the server has but docs/reference/http.md does not list"
    assert table - served == set(), "routes docs/reference/http.md lists but the server does not have"
