"""Qwen3 (Hermes-style) tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks.

``extract_tool_calls`` splits a finished answer into its content and its calls; ``ToolCallStream`` does
the same while the answer streams, sending a call's name as soon as it is complete and then its
arguments as they grow, and never letting ``<tool_call>`` markup into the content. Both give a call's
``arguments`` as the JSON text the model wrote (not re-serialised), so the fragments a stream sends join
into exactly the string the non-streamed answer has. A block that is not a JSON object with a string
``name`` and an ``arguments`` object stays in the content as text.

``forced_tool_call_tag`` is the xgrammar structural tag that makes the model call a tool (``tool_choice``
``required`` or a named function): the same block format, each function's arguments constrained by
its parameter schema.
"""

from __future__ import annotations

import json
import re
import uuid

from mili.tokenizer.reasoning import partial_suffix

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
# a block's start up to its arguments (the lookahead: whitespace still arriving is not yet the arguments)
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_BLOCK = re.compile(re.escape(TOOL_START) + r"(.*?)(?:" + re.escape(TOOL_END) + r"|\Z)", re.DOTALL)
_ARGS_TAIL = re.compile(r"\s*\}?\s*\Z")  # what may still close the block's object after the arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_block(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's body, or None when it is not a tool call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    header = _HEADER.match(body)
    if header is not None:  # name first: the arguments as written
        try:
            _, end = json.JSONDecoder().raw_decode(body, header.end())
            if body[end:].strip() == "}":
                return obj["name"], body[header.end():end]
        except ValueError:
            pass
    return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)


def extract_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content without the tool-call blocks, or None when nothing else was said; [(name, arguments)])."""
    calls, kept, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = parse_block(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return (content_around_calls(kept[0], kept[1:]), calls) if calls else (text, calls)


def content_around_calls(before: str, after: list[str]) -> str | None:
    """A reply's content once its calls are out: the text before the first call, then the text after them,
    its leading whitespace kept as the model wrote it (after ``</think>``: vLLM's rule, reasoning.py) unless
    only whitespace precedes the first call, and the whitespace at its end dropped; None when it is empty."""
    text = (before + "".join(after)).rstrip()
    return (text if before.strip() else text.lstrip()) or None


def call_json(index: int | None, call_id: str | None, name: str | None, arguments: str) -> dict:
    """One OpenAI tool call (``index`` given: a streamed ``delta.tool_calls`` entry)."""
    out: dict = {} if index is None else {"index": index}
    if call_id is not None:
        out.update(id=call_id, type="function")
    out["function"] = {"name": name, "arguments": arguments} if name is not None else {"arguments": arguments}
    return out


def merge_entries(entries: list[dict]) -> list[dict]:
    """One ``delta.tool_calls`` entry per call index, as OpenAI streams them: entries of the same index (the
    call's id and name, then its first arguments) joined, arguments concatenated. A client reading
    ``delta.tool_calls[0]`` then sees the whole chunk."""
    merged: dict[int, dict] = {}
    for entry in entries:
        into = merged.get(entry["index"])
        if into is None:
            merged[entry["index"]] = {**entry, "function": dict(entry["function"])}
        else:
            into["function"]["arguments"] += entry["function"]["arguments"]
    return list(merged.values())


def split_parts(parts: list[str | dict]) -> tuple[str, list[dict]]:
    """``feed_parts``' output as (the content, the merged call entries)."""
    return "".join(p for p in parts if isinstance(p, str)), merge_entries([p for p in parts if isinstance(p, dict)])


class ToolCallStream:
    """Turns the growing content of one choice into (content delta, ``delta.tool_calls`` entries)."""

    def __init__(self):
        self.pending = ""  # content not yet sent (may be the start of "<tool_call>")
        self.call: str | None = None  # the open block's text so far, None outside a block
        self.num_calls = 0
        self._header_end = 0  # where the open block's arguments start (0: its name not sent yet)
        self._args_sent = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        return split_parts(self.feed_parts(delta, final))

    def feed_parts(self, delta: str, final: bool = False) -> list[str | dict]:
        """The same as ``feed``, in the order the model wrote it: content strings and call entries."""
        parts: list[str | dict] = []
        text = delta
        while True:
            if self.call is None:
                self.pending += text
                start = self.pending.find(TOOL_START)
                if start == -1:
                    keep = 0 if final else partial_suffix(self.pending, TOOL_START)
                    parts.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                parts.append(self.pending[:start])
                text, self.pending = self.pending[start + len(TOOL_START):], ""
                self.call, self._header_end, self._args_sent = "", 0, 0
                continue
            self.call += text
            end = self.call.find(TOOL_END)
            if end == -1 and not final:
                parts += self._progress()
                break
            body, text = (self.call[:end], self.call[end + len(TOOL_END):]) if end != -1 else (self.call, "")
            self.call = None
            closed = self._close(body)
            if closed is None:  # not a tool call: its text is content (or lost if its name went out)
                parts.append(TOOL_START + body + (TOOL_END if end != -1 else ""))
            else:
                parts += closed
            if not text and end == -1:
                break
        return [p for p in parts if p != ""]

    def _progress(self) -> list[dict]:
        """The open block's name once it is complete, then each new piece of its arguments."""
        out = []
        if not self._header_end:
            header = _HEADER.match(self.call)
            if header is None:
                return out
            name = json.loads(f'"{header.group(1)}"')
            self._header_end = header.end()
            out.append(call_json(self.num_calls, new_call_id(), name, ""))
            self.num_calls += 1
        visible = self.call[:len(self.call) - partial_suffix(self.call, TOOL_END)]
        args = visible[self._header_end:]
        args = args[:_ARGS_TAIL.search(args).start()]
        if len(args) > self._args_sent:
            out.append(call_json(self.num_calls - 1, None, None, args[self._args_sent:]))
            self._args_sent = len(args)
        return out

    def _close(self, body: str) -> list[dict] | None:
        parsed = parse_block(body)
        if parsed is None:
            return [] if self._header_end else None
        name, arguments = parsed
        if not self._header_end:  # the whole call at once (it did not start with its name)
            self.num_calls += 1
            return [call_json(self.num_calls - 1, new_call_id(), name, arguments)]
        rest = arguments[self._args_sent:] if arguments.startswith(body[self._header_end:][:self._args_sent]) else ""
        return [call_json(self.num_calls - 1, None, None, rest)] if rest else []


def forced_tool_call_tag(tools: list[dict], name: str | None, parallel: bool, max_whitespace: int) -> str:
    """The xgrammar structural tag (JSON) for ``tool_choice`` ``required`` (``name`` None: one or more
    calls of any of ``tools``, one only unless ``parallel``) or a named function (one call of it)."""
    tags = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        tags.append({"type": "tag", "begin": f'{TOOL_START}\n{{"name": {json.dumps(fn["name"])}, "arguments": ',
                     "content": {"type": "json_schema", "json_schema": fn.get("parameters") or {"type": "object"},
                                 "max_whitespace_cnt": max_whitespace},
                     "end": "}\n" + TOOL_END})
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": name is not None or not parallel}
    return json.dumps({"type": "structural_tag", "format": fmt})
