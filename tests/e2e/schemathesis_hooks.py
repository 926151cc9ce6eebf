"""Schemathesis hooks for test_openapi.py (loaded through SCHEMATHESIS_HOOKS).

The document states every rule a JSON schema can state (between two fields too, as if/then), so
schemathesis's positive_data_acceptance check holds it to them: a schema-valid request must not be
refused. A few of MILI's rules cannot be stated in JSON Schema: a field bounded by another field's value,
a value that must compile or fit the context.
A 400 for one of those, naming its field (and, where given, its code; on Anthropic's routes, whose errors
name neither, with the message that rule's check writes), is not a failure; every other refusal of
schema-valid data still is.
"""

from __future__ import annotations

import re

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData

# (param, the error code it must carry; None: any) -> the rule no schema can state
BEYOND_SCHEMA = {
    ("max_tokens", "context_length_exceeded"): "prompt tokens + max_tokens must fit the context",
    ("prompt", "context_length_exceeded"): "the prompt's tokens must fit the context",
    ("messages", "chat_template_error"): "the chat template decides which conversations it renders",
    ("messages", "final_message_not_continuable"):
        "continue_final_message: the last message is the assistant's (JSON Schema cannot name an array's last item)",
    ("min_tokens", None): "at most max_tokens; not with a structured output",
    ("best_of", None): "equal to n",
    ("tool_choice", None): "a named function must be in tools; not with another constraint",
    ("tools", None): "forced calls: each function's parameters must be a schema the grammar engine compiles",
    ("response_format", None): "the JSON schema must compile; at most one constraint",
    ("structured_outputs", None): "exactly one kind, which must compile; at most one constraint",
    ("guided_json", None): "the JSON schema must compile; at most one constraint",
    ("guided_regex", None): "the regex must compile; at most one constraint",
    ("guided_choice", None): "the choices must make a grammar; at most one constraint",
    ("guided_grammar", None): "the grammar must compile; at most one constraint",
    # the same rules under the Responses API's names
    ("max_output_tokens", "context_length_exceeded"): "prompt tokens + max_output_tokens must fit the context",
    ("input", "context_length_exceeded"): "the prompt's tokens must fit the context",
    ("input", "chat_template_error"): "the chat template decides which conversations it renders",
    ("text.format", None): "the JSON schema must compile; not with a forced tool call",
}

# Anthropic's errors carry no param or code: the same rules, known by how their message starts
ANTHROPIC_BEYOND_SCHEMA = {
    "This model's maximum context length is": "prompt tokens + max_tokens must fit the context",
    "the chat template could not render these messages": "the chat template decides which conversations it renders",
    # a final assistant turn (prefill) as Anthropic takes it: JSON Schema cannot name an array's last item
    "final assistant content cannot end with trailing whitespace": "a prefill ends with no whitespace",
    "a final assistant turn (prefill) cannot hold tool_use blocks": "a prefill is text (and thinking)",
    "thinking.budget_tokens must be less than max_tokens": "budget_tokens below max_tokens",
    "tool_choice names the function": "a named tool must be in tools",
    "invalid JSON schema": "output_config.format's schema must compile",
    "invalid structural tag": "forced calls: each tool's input_schema must be a schema the grammar engine compiles",
}

# an image part (OpenAI's and the Responses API's param; Anthropic's message starts with it): it must decode to an
# image within the limits, come from an allowed source, and go to a model that takes images
IMAGE_PART = re.compile(r"(messages|input)\[\d+\]\.content\[\d+\]")


def beyond_schema(status: int, body) -> bool:
    if status != 400 or not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    if body.get("type") == "error":  # Anthropic's shape
        message = error.get("message") or ""
        return (any(message.startswith(start) for start in ANTHROPIC_BEYOND_SCHEMA)
                or IMAGE_PART.fullmatch(message.partition(": ")[0]) is not None)
    param, code = error.get("param"), error.get("code")
    return ((param, code) in BEYOND_SCHEMA or (param, None) in BEYOND_SCHEMA
            or IMAGE_PART.fullmatch(param or "") is not None)


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    if isinstance(failure, RejectedPositiveData):
        try:
            body = response.json()
        except ValueError:
            return True
        return not beyond_schema(response.status_code, body)
    return True
