"""The Qwen3 tool-call parser: whole answers, streams cut anywhere, and the forcing structural tag."""

from __future__ import annotations

import json

import pytest

from mili.tokenizer.tool_calls import ToolCallStream, extract_tool_calls, forced_tool_call_tag

ONE = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TWO = ('<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}\n</tool_call>\n'
       '<tool_call>\n{"name": "b\\"q", "arguments": {}}\n</tool_call>')
BROKEN = 'Here: <tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call> done'
ARGS_FIRST = '<tool_call>{"arguments": {"k": "v"}, "name": "f"}</tool_call>'


def test_extract_one_call():
    content, calls = extract_tool_calls(ONE)
    assert content == "Let me look."
    assert calls == [("get_weather", '{"city": "Paris", "days": 3}')]


def test_extract_keeps_arguments_as_written_and_parallel_calls():
    content, calls = extract_tool_calls(TWO)
    assert content is None
    assert calls == [("a", '{"x": [1, {"y": "}"}]}'), ('b"q', "{}")]


def test_a_block_that_is_not_a_call_stays_content():
    content, calls = extract_tool_calls(BROKEN)
    assert calls == [] and content == BROKEN
    assert extract_tool_calls("no calls here") == ("no calls here", [])


def test_unclosed_final_block_and_arguments_first():
    content, calls = extract_tool_calls('ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert (content, calls) == ("ok", [("f", '{"a": 1}')])
    assert extract_tool_calls(ARGS_FIRST) == (None, [("f", '{"k": "v"}')])


def _stream(text: str, size: int) -> tuple[str, list[dict]]:
    s = ToolCallStream()
    content, deltas = [], []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        c, d = s.feed(piece, final=k == len(pieces) - 1)
        content.append(c)
        deltas += d
    return "".join(content), deltas


def _assemble(deltas: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
        if "id" in d:
            assert call["id"] is None and d["id"].startswith("call_") and d["type"] == "function"
            call["id"], call["name"] = d["id"], d["function"]["name"]
        else:
            assert call["id"] is not None, "arguments before the call's id and name"
        call["arguments"] += d["function"]["arguments"]
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("text", [ONE, TWO, ARGS_FIRST, "plain <tool text", "x <tool_call", "<tool_call>{not json}"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_stream_matches_the_whole_answer(text, size):
    content, deltas = _stream(text, size)
    whole_content, whole_calls = extract_tool_calls(text)
    assert _assemble(deltas) == whole_calls
    assert "<tool_call>" not in content or not whole_calls
    assert content.strip() == (whole_content or "").strip()


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_stream_of_a_broken_block(size):
    """A block that turns out not to be JSON after its name went out cannot be taken back: the stream
    has sent a call with the arguments written so far, and keeps the markup out of the content (an
    unforced call from a weak model; tool_choice required or named makes this impossible)."""
    content, deltas = _stream(BROKEN, size)
    if size < 1000:  # cut mid-block: the name was sent before the block ended
        assert "tool_call" not in content and content.split() == ["Here:", "done"]
        assert _assemble(deltas) == [("a", '{"x": 1')]
    else:  # seen whole: not a call, so it stays content, as in the whole answer
        assert deltas == [] and content == BROKEN


def test_stream_sends_the_name_before_the_arguments_end():
    """The name goes out as soon as it is complete; a chunk carries one entry per call index (OpenAI's shape:
    a client reading ``delta.tool_calls[0]`` gets the id, the name and the first arguments together)."""
    s = ToolCallStream()
    _, deltas = s.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    (first,) = deltas
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'} and first["index"] == 0
    assert first["id"].startswith("call_") and first["type"] == "function"
    _, more = s.feed('ty": "Paris"}}\n</tool_call>', final=True)
    assert "".join(d["function"]["arguments"] for d in deltas + more) == '{"city": "Paris"}'


def test_two_calls_in_one_chunk_keep_one_entry_each():
    _, deltas = ToolCallStream().feed('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                                      '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', final=True)
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == \
        [(0, "a", '{"x": 1}'), (1, "b", "{}")]


def test_forced_tag_names_only_the_chosen_function():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    tag = json.loads(forced_tool_call_tag(tools, "b", True, 4))
    assert [t["begin"] for t in tag["format"]["tags"]] == ['<tool_call>\n{"name": "b", "arguments": ']
    assert tag["format"]["stop_after_first"] is True
    tag = json.loads(forced_tool_call_tag(tools, None, True, 4))
    assert len(tag["format"]["tags"]) == 2 and tag["format"]["stop_after_first"] is False
    assert json.loads(forced_tool_call_tag(tools, None, False, 4))["format"]["stop_after_first"] is True
