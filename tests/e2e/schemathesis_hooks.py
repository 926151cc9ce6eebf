"""Schemathesis hooks for test_openapi.py (loaded through SCHEMATHESIS_HOOKS).

The document states every rule a JSON schema can state (between two fields too, as if/then), so
schemathesis's positive_data_acceptance check holds it to them: a schema-valid request must not be
refused. A few of MILI's rules cannot be stated in JSON Schema: a field bounded by another field's value,
a value that must compile or fit the context.
A 400 for one of those, naming its field (and, where given, its code), is not a failure; every other
refusal of schema-valid data still is.
"""

from __future__ import annotations

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData

# param: the error code it must carry (None: any), and the rule no schema can state
BEYOND_SCHEMA = {
    "max_tokens": ("context_length_exceeded", "prompt tokens + max_tokens must fit the context"),
    "prompt": ("context_length_exceeded", "the prompt's tokens must fit the context"),
    "messages": ("chat_template_error", "the chat template decides which conversations it renders"),
    "min_tokens": (None, "at most max_tokens; not with a structured output"),
    "best_of": (None, "equal to n"),
    "tool_choice": (None, "a named function must be in tools; not with another constraint"),
    "tools": (None, "forced calls: each function's parameters must be a schema the grammar engine compiles"),
    "response_format": (None, "the JSON schema must compile; at most one constraint"),
    "structured_outputs": (None, "exactly one kind, which must compile; at most one constraint"),
    "guided_json": (None, "the JSON schema must compile; at most one constraint"),
    "guided_regex": (None, "the regex must compile; at most one constraint"),
    "guided_choice": (None, "the choices must make a grammar; at most one constraint"),
    "guided_grammar": (None, "the grammar must compile; at most one constraint"),
}


def beyond_schema(status: int, body) -> bool:
    if status != 400 or not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    rule = BEYOND_SCHEMA.get(error.get("param"))
    return rule is not None and rule[0] in (None, error.get("code"))


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    if isinstance(failure, RejectedPositiveData):
        try:
            body = response.json()
        except ValueError:
            return True
        return not beyond_schema(response.status_code, body)
    return True
