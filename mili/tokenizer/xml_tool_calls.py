"""Qwen3.5/3.6 (Qwen3-Coder) tool calls: ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n
</parameter>\\n</function>\\n</tool_call>`` blocks, each value typed by the tool's schema (tool_values.py).

One state machine reads the text as it grows; ``extract_xml_tool_calls`` is that machine fed the whole
text at once, so a streamed answer and the whole one agree wherever the text is cut. What it sends, as the
hermes parser does (tool_calls.py): content strings, and per call an entry with its id and name (as soon
as ``<function=NAME>`` is complete), then fragments of its ``arguments``: ``{`` and each argument's
``"NAME": `` when its ``<parameter=NAME>`` is complete, a string argument's text as it arrives (JSON
escaped), any other argument's JSON value once its ``</parameter>`` comes, ``}`` at ``</function>``. The
fragments join into ``{"a": 1, "b": "x"}``: valid JSON even when the text ends inside a call.

Decisions, each taken on the text alone (never on where a chunk ends):
- a ``<tool_call>`` not followed (after whitespace) by ``<function=NAME>`` is not a call: its text
  stays content; markup of a call never reaches the content;
- inside a call, text outside ``<parameter=…>…</parameter>`` is dropped, and whitespace or text after
  ``</function>`` up to ``</tool_call>``; text after ``</function>`` that is not ``</tool_call>`` is content;
- one newline after ``<parameter=NAME>`` and one before its end are the format's, not the value's;
- a value ends at ``</parameter>``, at ``</tool_call>``, or at a ``</function>`` that ``</tool_call>`` or
  the end of the text follows (a model that forgot ``</parameter>``); a literal ``</function>`` elsewhere
  stays in the value.
"""

from __future__ import annotations

import json

from mili.tokenizer.reasoning import partial_suffix
from mili.tokenizer.tool_calls import (TOOL_END, TOOL_START, call_json, content_around_calls, new_call_id,
                                      split_parts)
from mili.tokenizer.tool_values import ParamType, param_type, typed_value

FUNC_START, FUNC_END = "<function=", "</function>"
PARAM_START, PARAM_END = "<parameter=", "</parameter>"
_SPACE = " \t\r\n"


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that may still become one of ``tags``."""
    return max(partial_suffix(text, tag) for tag in tags)


class XmlToolCallStream:
    """Turns the growing content of one choice into (content delta, ``delta.tool_calls`` entries).

    ``tools``: the request's tools (OpenAI's shape); their ``parameters`` schemas type the values."""

    def __init__(self, tools: list[dict] | None = None):
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools or []
                        if isinstance(t, dict) and isinstance(t.get("function"), dict)}
        self.buf = ""  # text not yet consumed
        self.state = "text"  # text | head | body | name | value | tail
        self.num_calls = 0
        self._schema: dict | None = None  # the open call's parameters schema
        self._num_args = 0  # arguments of the open call so far
        self._param = ParamType(None, True)  # what the schema says of the open argument
        self._arg_text = ""  # the open value's text so far (its first newline taken off)
        self._sent = 0  # characters of a string value already sent
        self._lead = False  # whether the open value's leading newline has been looked at

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        return split_parts(self.feed_parts(delta, final))

    def feed_parts(self, delta: str, final: bool = False) -> list[str | dict]:
        """The same as ``feed``, in the order the model wrote it: content strings and call entries."""
        self.buf += delta
        parts: list[str | dict] = []
        while getattr(self, "_" + self.state)(parts, final):
            pass
        return [p for p in parts if p != ""]

    # -- the states: each consumes what it can decide on; True when it moved to another state ------
    def _text(self, parts: list, final: bool) -> bool:
        start = self.buf.find(TOOL_START)
        if start == -1:
            keep = 0 if final else partial_suffix(self.buf, TOOL_START)
            parts.append(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        parts.append(self.buf[:start])
        self.buf, self.state = self.buf[start + len(TOOL_START):], "head"
        return True

    def _head(self, parts: list, final: bool) -> bool:
        """After ``<tool_call>``: a call only if ``<function=NAME>`` follows."""
        rest = self.buf.lstrip(_SPACE)
        if rest.startswith(FUNC_START):
            end = rest.find(">", len(FUNC_START))
            name = rest[len(FUNC_START):end if end != -1 else len(rest)]
            if not any(c in name for c in "<\n"):
                if end == -1 and not final:
                    return False
                if end != -1 and name.strip():
                    self.buf, self.state = rest[end + 1:], "body"
                    self._open_call(name.strip(), parts)
                    return True
        elif FUNC_START.startswith(rest) and not final:
            return False
        parts.append(TOOL_START)  # not a call: its text is content
        self.state = "text"
        return True

    def _body(self, parts: list, final: bool) -> bool:
        """Inside ``<function=…>``, between arguments."""
        found = [(i, tag) for tag in (PARAM_START, FUNC_END, TOOL_END) if (i := self.buf.find(tag)) != -1]
        if not found:
            keep = 0 if final else _held(self.buf, (PARAM_START, FUNC_END, TOOL_END))
            self.buf = self.buf[len(self.buf) - keep:]
            if final:
                self._close_call(parts)
                self.state = "text"
            return final
        i, tag = min(found)
        self.buf = self.buf[i + len(tag):]
        if tag == PARAM_START:
            self.state = "name"
        else:
            self._close_call(parts)
            self.state = "tail" if tag == FUNC_END else "text"
        return True

    def _name(self, parts: list, final: bool) -> bool:
        """After ``<parameter=``: the argument's name up to ``>``."""
        end = self.buf.find(">")
        name = self.buf[:end if end != -1 else len(self.buf)]
        if any(c in name for c in "<\n") or (end == -1 and final) or (end != -1 and not name.strip()):
            self.state = "body"  # not an argument: dropped, as other text between arguments
            return True
        if end == -1:
            return False
        self.buf, self.state = self.buf[end + 1:], "value"
        name = name.strip()
        self._param = param_type(self._schema, name)
        self._arg_text, self._sent, self._lead = "", 0, False
        key = ("{" if self._num_args == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self._num_args += 1
        self._arguments(key + ('"' if self._param.free else ""), parts)
        return True

    def _value(self, parts: list, final: bool) -> bool:
        if not self._lead:
            if not self.buf and not final:
                return False
            self.buf, self._lead = self.buf.removeprefix("\n"), True
        end, tag = self._value_end(final)
        if tag is None:  # not ended yet: take what cannot be (the start of) its end
            self._arg_text += self.buf[:end]
            self.buf = self.buf[end:]
            if self._param.free:  # the trailing newline may be the format's: held back
                visible = len(self._arg_text) - self._arg_text.endswith("\n")
                self._arguments(_escaped(self._arg_text[self._sent:visible]), parts)
                self._sent = visible
            return False
        self._arg_text += self.buf[:end]
        self.buf = self.buf[end + len(tag):]
        self._close_value(parts)
        self.state = "body"
        if tag != PARAM_END:
            self._close_call(parts)
            self.state = "tail" if tag == FUNC_END else "text"
        return True

    def _value_end(self, final: bool) -> tuple[int, str | None]:
        """(where the open value ends, the tag that ends it: "" for the end of the text), or (how much of
        the text is surely value, None) while it may go on."""
        ends = [(i, tag) for tag in (PARAM_END, TOOL_END) if (i := self.buf.find(tag)) != -1]
        limit = min(ends)[0] if ends else len(self.buf)
        start = 0
        while (i := self.buf.find(FUNC_END, start, limit)) != -1:
            after = self.buf[i + len(FUNC_END):].lstrip(_SPACE)
            if after.startswith(TOOL_END) or (final and not after):
                return i, FUNC_END
            if not final and TOOL_END.startswith(after):
                return i, None  # a </function> whose meaning is not known yet
            start = i + 1
        if ends:
            return min(ends)
        if final:
            return len(self.buf), ""
        return len(self.buf) - _held(self.buf, (PARAM_END, FUNC_END, TOOL_END)), None

    def _tail(self, parts: list, final: bool) -> bool:
        """After ``</function>``: ``</tool_call>`` ends the block; other text is content."""
        rest = self.buf.lstrip(_SPACE)
        if rest.startswith(TOOL_END):
            self.buf, self.state = rest[len(TOOL_END):], "text"
            return True
        self.buf = rest
        if TOOL_END.startswith(rest):  # (a cut "</tool_call>" at the very end is dropped)
            if not final:
                return False
            self.buf = ""
        self.state = "text"
        return True

    # -- what is sent -------------------------------------------------------------------------------------
    def _open_call(self, name: str, parts: list) -> None:
        self._schema, self._num_args = self.schemas.get(name), 0
        parts.append(call_json(self.num_calls, new_call_id(), name, ""))
        self.num_calls += 1

    def _arguments(self, text: str, parts: list) -> None:
        if text:
            parts.append(call_json(self.num_calls - 1, None, None, text))

    def _close_value(self, parts: list) -> None:
        text = self._arg_text[:-1] if self._arg_text.endswith("\n") else self._arg_text
        if self._param.free:
            self._arguments(_escaped(text[self._sent:]) + '"', parts)
        else:
            self._arguments(json.dumps(typed_value(text, self._param), ensure_ascii=False), parts)

    def _close_call(self, parts: list) -> None:
        self._arguments("}" if self._num_args else "{}", parts)


def extract_xml_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    """(content without the tool-call blocks, or None when nothing else was said; [(name, arguments)])."""
    calls: list[list[str]] = []
    before, after = [], []  # the content before the first call, and after it
    for part in XmlToolCallStream(tools).feed_parts(text, final=True):
        if isinstance(part, str):
            (after if calls else before).append(part)
        elif "id" in part:
            calls.append([part["function"]["name"], part["function"]["arguments"]])
        else:
            calls[-1][1] += part["function"]["arguments"]
    if not calls:
        return text, []
    return content_around_calls("".join(before), after), [(name, arguments) for name, arguments in calls]


def forced_xml_tool_call_tag(tools: list[dict], name: str | None, parallel: bool, max_whitespace: int) -> str:
    """The xgrammar structural tag (JSON) for ``tool_choice`` ``required`` (``name`` None: one or more calls
    of any of ``tools``, one only unless ``parallel``) or a named function (one call of it), in the XML
    form the released templates show: each function's arguments in xgrammar's ``qwen_xml`` style (strings
    raw, other values JSON), constrained by its parameters schema."""
    tags = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        tags.append({"type": "tag", "begin": f"{TOOL_START}\n{FUNC_START}{fn['name']}>\n",
                     "content": {"type": "json_schema", "json_schema": fn.get("parameters") or {"type": "object"},
                                 "style": "qwen_xml", "max_whitespace_cnt": max_whitespace},
                     # the newline before </function> is the arguments' trailing whitespace: a call without
                     # arguments has none, as the templates write it
                     "end": f"{FUNC_END}\n{TOOL_END}"})
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": name is not None or not parallel}
    return json.dumps({"type": "structural_tag", "format": fmt})
