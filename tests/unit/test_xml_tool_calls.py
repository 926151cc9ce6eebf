"""The Qwen3.5/3.6 XML tool-call parser: whole answers, the same text cut at every size, typed values."""

from __future__ import annotations

import json

import pytest

from mili.tokenizer.tool_values import ParamType, param_type, typed_value
from mili.tokenizer.xml_tool_calls import XmlToolCallStream, extract_xml_tool_calls

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}, "where": {"type": "object"},
    "ratio": {"type": "number"}, "note": {"type": ["string", "null"]}, "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]

ONE = ('Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
       '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>')
TWO = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nNew "York"\\n\n\n</parameter>\n<parameter=hot>\nTrue\n'
       '</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=where>\n{"lat": 1.5}\n</parameter>\n'
       '</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>')
MULTILINE = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\n  line 2 </function> x\n\n</parameter>\n'
             '<parameter=ratio>\n0.25\n</parameter>\n<parameter=unit>\n C \n</parameter>\n</function>\n</tool_call> after')
NOT_A_CALL = 'I would write <tool_call> like this </tool_call>, or <tool_call>\n<func'
MISSING_ENDS = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</function>\n</tool_call>'
                'then <tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</tool_call>')
CUT = 'Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nOs'
STRAY = ('<tool_call>\n<function=get_weather>\nnoise <parameter=bad\nname> more\n<parameter=days>\n 7 \n</parameter>\n'
         '</function>\nAnd done.')
TEXTS = [ONE, TWO, MULTILINE, NOT_A_CALL, MISSING_ENDS, CUT, STRAY, "plain text", "", "x <tool_ca"]


def test_one_call_whole():
    content, calls = extract_xml_tool_calls(ONE, TOOLS)
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris", "days": 3}')]


def test_values_are_typed_by_the_schema():
    _, calls = extract_xml_tool_calls(TWO, TOOLS)
    assert [name for name, _ in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0][1]) == {"city": 'New "York"\\n\n', "hot": True, "tags": ["a", "b"],
                                       "where": {"lat": 1.5}}
    assert calls[1][1] == "{}"
    _, calls = extract_xml_tool_calls(MULTILINE, TOOLS)  # a literal </function> inside a value stays there
    assert json.loads(calls[0][1]) == {"city": "line 1\n  line 2 </function> x\n", "ratio": 0.25,
                                       "unit": "C"}


def test_text_that_is_not_a_call_stays_content():
    assert extract_xml_tool_calls(NOT_A_CALL, TOOLS) == (NOT_A_CALL, [])
    assert extract_xml_tool_calls("plain text", TOOLS) == ("plain text", [])


def test_forgotten_end_tags_and_a_cut_call():
    content, calls = extract_xml_tool_calls(MISSING_ENDS, TOOLS)
    assert content == "then" and calls == [("get_weather", '{"city": "Rome"}'), ("get_weather", '{"days": 4}')]
    content, calls = extract_xml_tool_calls(CUT, TOOLS)  # max_tokens in a value: still valid JSON
    assert content == "Sure." and calls == [("get_weather", '{"city": "Os"}')]
    content, calls = extract_xml_tool_calls(STRAY, TOOLS)  # text between arguments is not content
    assert content == "And done." and calls == [("get_weather", '{"days": 7}')]


def _stream(text: str, pieces: list[str]) -> tuple[str, list[dict]]:
    s = XmlToolCallStream(TOOLS)
    content, deltas = [], []
    for k, piece in enumerate(pieces):
        c, d = s.feed(piece, final=k == len(pieces) - 1)
        content.append(c)
        deltas += d
    return "".join(content), deltas


def _assemble(deltas: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
        if "id" in d:  # (with the first arguments of the same chunk: one entry per index per chunk)
            assert call["id"] is None and d["id"].startswith("call_") and d["type"] == "function"
            call["id"], call["name"] = d["id"], d["function"]["name"]
        else:
            assert call["id"] is not None, "arguments before the call's id and name"
            assert d["function"]["arguments"], "an empty fragment"
        call["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def _check(text: str, pieces: list[str], well_formed: bool = True) -> None:
    content, deltas = _stream(text, pieces)
    whole_content, whole_calls = extract_xml_tool_calls(text, TOOLS)
    calls = _assemble(deltas)
    assert calls == whole_calls, pieces
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)
    if whole_calls:
        assert content.strip() == (whole_content or "")
        assert not well_formed or not any(t in content for t in ("<function=", "<parameter=", "</parameter>", "</function>"))
    else:
        assert content == text


@pytest.mark.parametrize("text", TEXTS)
def test_stream_cut_at_every_size_matches_the_whole(text):
    for size in range(1, len(text) + 1):
        _check(text, [text[i:i + size] for i in range(0, len(text), size)] or [""])


@pytest.mark.parametrize("text", TEXTS)
def test_stream_cut_at_every_place_matches_the_whole(text):
    for i in range(len(text) + 1):
        _check(text, [text[:i], text[i:]])
    _check(text, [*text, ""])  # a character at a time, then an empty final piece


def test_stream_sends_the_name_and_string_values_early():
    s = XmlToolCallStream(TOOLS)
    _, d = s.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert d == [{"index": 0, "id": d[0]["id"], "type": "function",  # one entry per call index per chunk
                  "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]
    _, d = s.feed("is\n")  # the newline may be the format's: held back
    assert "".join(x["function"]["arguments"] for x in d) == "is"
    _, d = s.feed("</parameter>\n<parameter=days>\n1")
    assert "".join(x["function"]["arguments"] for x in d) == '", "days": '  # a number comes whole
    _, d = s.feed("2\n</parameter>\n</function>\n</tool_call>", final=True)
    assert "".join(x["function"]["arguments"] for x in d) == "12}"


@pytest.mark.parametrize("schema, text, value", [
    ({"type": "string"}, " 42 ", " 42 "),
    ({"type": "string", "maxLength": 4}, " 42 \n", "42"),  # xgrammar's qwen_xml lets whitespace around these
    ({"enum": ["C", "F"]}, "\n C\t", "C"),
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, "4.0", 4),
    ({"type": "integer"}, "four", "four"),
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "7", 7),
    ({"type": "boolean"}, "True", True),  # Qwen3.5's template writes Python's spelling
    ({"type": "boolean"}, "false", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": ["integer", "null"]}, "None", None),
    ({"type": ["string", "null"]}, "null", None),
    ({"type": "string"}, "null", "null"),
    ({"type": "object"}, '{"a": [1, null]}', {"a": [1, None]}),
    ({"type": "object"}, "{'a': True}", {"a": True}),  # a Python repr
    ({"type": "object"}, "{broken", "{broken"),
    ({"type": "array"}, "[1, 2]", [1, 2]),
    ({"type": "array"}, "NaN", "NaN"),
    ({"type": ["integer", "string"]}, "12", 12),
    ({"type": ["integer", "string"]}, "12 apples", "12 apples"),
    ({"type": ["integer", "string"]}, '"x"', '"x"'),
    ({"enum": [1, 2, 3]}, "2", 2),
    ({"anyOf": [{"type": "number"}, {"type": "null"}]}, "1e3", 1000.0),
    ({"anyOf": [{"type": "number"}, {"$ref": "#/x"}]}, "1e3", "1e3"),  # a branch it cannot type: string
    ({"properties": {"a": {}}}, '{"a": 1}', {"a": 1}),
    ({}, "[1]", "[1]"),  # no type: the text
])
def test_typed_value(schema, text, value):
    got = typed_value(text, param_type({"properties": {"p": schema}}, "p"))
    assert got == value and type(got) is type(value)


def test_arguments_the_schema_does_not_know_stay_strings():
    assert param_type({"properties": {"a": {"type": "integer"}}}, "b") == ParamType(None, True)
    assert param_type({"additionalProperties": {"type": "integer"}}, "b") == ParamType(frozenset({"integer"}), False)
    assert param_type(None, "a") == ParamType(None, True)
    _, calls = extract_xml_tool_calls("<tool_call>\n<function=nope>\n<parameter=x>\n1\n</parameter>\n</function>\n"
                                      "</tool_call>", TOOLS)
    assert calls == [("nope", '{"x": "1"}')]


def test_random_texts_of_the_format_pieces_cut_at_random():
    """Texts made of the format's pieces in any order (broken ones too), cut anywhere: the stream always
    agrees with the whole reading, and every call's arguments are a JSON object."""
    import random

    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=ping>", "</function>",
              "<parameter=city>", "<parameter=days>", "<parameter=unit>", "<parameter=x", "</parameter>", "\n", " ",
              "\n\n", "Paris", "12", "True", "[1, 2]", "C", "<", ">", "</", "hello world", "<tool_", "\"q\\"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        _check(text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], well_formed=False)
