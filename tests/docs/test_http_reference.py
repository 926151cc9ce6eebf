"""docs/reference/http.md's route table is the served OpenAPI document's routes, both ways: a route added to the
server without a row, or a row for a route that is gone, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "http.md"


def test_the_route_table_is_the_served_document(docs_server):
    served = {(method.upper(), path)
              for path, operations in httpx.get(docs_server.url + "/openapi.json").json()["paths"].items()
              for method in operations}
    table = set(re.findall(r"^\| (GET|POST|PUT|PATCH|DELETE) \| `([^`]+)` \|", PAGE.read_text(), re.MULTILINE))
    assert served - table == set(), "routes the server has but docs/reference/http.md does not list"
    assert table - served == set(), "routes docs/reference/http.md lists but the server does not have"
