"""Which tool-call form a checkpoint writes, and that form's parser, stream and forcing grammar.

Two forms: ``hermes`` (Qwen3, Qwen3-Next: a JSON object in ``<tool_call>``, tool_calls.py) and
``qwen3_xml`` (Qwen3.5, Qwen3.6, Qwen3-Coder: ``<function=NAME>`` and ``<parameter=ARG>`` in
``<tool_call>``, xml_tool_calls.py). ``auto`` reads the checkpoint's chat template: one that renders
``<function=`` asks for the XML form. ``mili serve --tool-call-parser`` overrides it.

The templates differ in how they read an assistant turn's earlier calls as well: Qwen3's writes
``arguments`` as it is (the JSON text OpenAI clients send), the XML ones iterate ``arguments|items`` and
need a mapping, so ``messages_for_template`` gives such templates the parsed object (as vLLM does).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mili.errors import InvalidRequest
from mili.tokenizer.tool_calls import ToolCallStream, extract_tool_calls, forced_tool_call_tag
from mili.tokenizer.xml_tool_calls import XmlToolCallStream, extract_xml_tool_calls, forced_xml_tool_call_tag

TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3_xml")
_XML_MARK = "<function="
_MAPPING_ARGUMENTS = re.compile(r"arguments\s*\|\s*items")


def _template_text(tokenizer_or_template: Any) -> str:
    template = getattr(tokenizer_or_template, "chat_template", tokenizer_or_template)
    if isinstance(template, dict):  # named templates: the default one, else all of them
        template = template.get("default") or "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def resolve_tool_call_parser(choice: str, tokenizer_or_template: Any) -> str:
    """``hermes`` or ``qwen3_xml``: ``choice`` itself, or for ``auto`` the form the chat template renders."""
    if choice not in TOOL_CALL_PARSERS:
        raise InvalidRequest(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {choice!r}",
                             param="tool_call_parser")
    if choice != "auto":
        return choice
    return "qwen3_xml" if _XML_MARK in _template_text(tokenizer_or_template) else "hermes"


def tool_call_stream(parser: str, tools: list[dict] | None) -> ToolCallStream | XmlToolCallStream:
    """A fresh streaming parser for one reply."""
    return XmlToolCallStream(tools) if parser == "qwen3_xml" else ToolCallStream()


def extract_calls(parser: str, text: str, tools: list[dict] | None) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, or None when the reply is only calls; [(name, arguments JSON text)]) of a whole reply."""
    return extract_xml_tool_calls(text, tools) if parser == "qwen3_xml" else extract_tool_calls(text)


def forced_tag(parser: str, tools: list[dict], name: str | None, parallel: bool, max_whitespace: int) -> str:
    """The structural tag forcing ``tool_choice`` required / a named function in the parser's form."""
    build = forced_xml_tool_call_tag if parser == "qwen3_xml" else forced_tool_call_tag
    return build(tools, name, parallel, max_whitespace)


def messages_for_template(tokenizer_or_template: Any, messages: list[dict]) -> list[dict]:
    """``messages`` with earlier calls' JSON-text ``arguments`` parsed into objects, for templates that
    iterate them (the XML ones); unchanged for the others. Text that is not a JSON object is a 400."""
    if not _MAPPING_ARGUMENTS.search(_template_text(tokenizer_or_template)):
        return messages
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if isinstance(calls, list) and any(isinstance(c, dict) and isinstance((c.get("function") or {}).get(
                "arguments"), str) for c in calls):
            message = {**message, "tool_calls": [_with_mapping(c, i) for c in calls]}
        out.append(message)
    return out


def _with_mapping(call: Any, index: int) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"messages[{index}].tool_calls: function.arguments must be a JSON object "
                             f"(this model's template renders each argument)", param="messages")
    return {**call, "function": {**fn, "arguments": arguments}}
