"""Qwen3.5/3.6's released chat templates through MILI's chat path: tools and earlier calls render, the XML
parser reads the rendered calls back, thinking opens in the prompt, the forcing grammar takes the form."""

from __future__ import annotations

import copy
import functools
import json

import pytest
from transformers import AutoTokenizer

from support.checkpoints import DATA, QWEN3_TOKENIZER
from mili.server.chat import ChatPrompt, ReplyBlocks
from mili.server.protocol import ChatCompletionRequest
from mili.structured import build_grammar
from mili.tokenizer.reasoning import split_reasoning
from mili.tokenizer.tokenizer import apply_chat_template
from mili.tokenizer.tool_parsers import resolve_tool_call_parser
from mili.tokenizer.xml_tool_calls import extract_xml_tool_calls

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}, "where": {"type": "object"},
    "ratio": {"type": "number"}, "note": {"type": ["string", "null"]}, "code": {"type": "string"}},
    "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
ARGS = {"city": "Paris", "days": 3, "hot": True, "tags": ["a", "b"], "where": {"lat": 48.8, "n": None},
        "ratio": 0.5, "note": None, "code": "42"}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "I should look it up.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}},
        {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "pong"},
    {"role": "assistant", "content": "Sunny, 21.", "reasoning_content": "Easy."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]


@functools.cache
def _tokenizer(version: str):
    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)  # Qwen3.5's special tokens have the same names
    tok.chat_template = (DATA / "qwen3.5" / f"qwen{version}_chat_template.jinja").read_text()
    return tok


def _render(version: str, messages=CONVERSATION, **kwargs) -> ChatPrompt:
    body = ChatCompletionRequest(messages=copy.deepcopy(messages), tools=TOOLS, chat_template_kwargs=kwargs or None)
    return ChatPrompt.render(_tokenizer(version), body, "qwen3_xml")


@pytest.mark.parametrize("version", ["3.5", "3.6"])
def test_the_parser_reads_back_the_calls_the_template_renders(version):
    text = _render(version).text
    assert "<tools>" in text and '"name": "get_weather"' in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in turn
    # 3.5 writes scalars through Jinja's | string (Python's True/None), 3.6 as JSON
    assert ("<parameter=hot>\nTrue\n" if version == "3.5" else "<parameter=hot>\ntrue\n") in turn
    reasoning, content = split_reasoning(turn)
    content, calls = extract_xml_tool_calls(content, TOOLS)
    assert content == "Checking."
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", ARGS), ("ping", {})]


@pytest.mark.parametrize("version", ["3.5", "3.6"])
def test_thinking_opens_in_the_prompt(version):
    on, off = _render(version), _render(version, enable_thinking=False)
    assert on.text.endswith("<|im_start|>assistant\n<think>\n") and on.thinking and on.opened
    assert off.text.endswith("<think>\n\n</think>\n\n") and not off.thinking
    # the reply holds only </think>: reasoning, then the call, whole or a character at a time
    reply = "Tomorrow too.\n</think>\n\nLet me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n" \
            "</parameter>\n<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>"
    whole = ReplyBlocks(on)
    whole.feed(reply, final=True)
    pieces = ReplyBlocks(on)
    for i, ch in enumerate(reply):
        pieces.feed(ch, final=i == len(reply) - 1)
    for blocks in (whole, pieces):
        assert [(b.kind, b.text, b.name) for b in blocks.blocks] == [
            ("reasoning", "Tomorrow too.\n", None), ("text", "\n\nLet me see.", None),
            ("tool_call", '{"city": "Paris", "days": 1}', "get_weather")]
    content, calls = on.tool_calls("Let me see.\n<tool_call>\n<function=ping>\n</function>\n</tool_call>")
    assert (content, calls) == ("Let me see.", [("ping", "{}")])


def test_preserve_thinking_passes_through_to_3_6():
    assert "I should look it up." not in _render("3.6").text
    assert "I should look it up." in _render("3.6", preserve_thinking=True).text
    assert "I should look it up." not in _render("3.5", preserve_thinking=True).text  # 3.5 has no such switch


def test_arguments_that_are_not_an_object_are_a_400():
    from mili.errors import InvalidRequest

    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ping", "arguments": "[1]"}}]},
        {"role": "user", "content": "again"}]
    with pytest.raises(InvalidRequest) as e:
        apply_chat_template(_tokenizer("3.5"), bad)
    assert e.value.param == "messages"
    # Qwen3's template writes the JSON text as it is: nothing is parsed for it
    qwen3 = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    assert '"arguments": [1]' in apply_chat_template(qwen3, bad)


def test_the_parser_setting_on_the_command_line_and_in_a_config_file(tmp_path):
    from mili.cli import build_parser
    from mili.config_file import ConfigFileError, read_config_file

    parser = build_parser()
    assert parser.parse_args(["serve", "m"]).tool_call_parser == "auto"
    assert parser.parse_args(["serve", "m", "--tool-call-parser", "qwen3_xml"]).tool_call_parser == "qwen3_xml"
    (tmp_path / "a.yaml").write_text("tool_call_parser: hermes\n")
    assert read_config_file(str(tmp_path / "a.yaml"), parser.serve_parser)[0] == {"tool_call_parser": "hermes"}
    (tmp_path / "b.yaml").write_text("tool_call_parser: xml\n")
    with pytest.raises(ConfigFileError) as e:
        read_config_file(str(tmp_path / "b.yaml"), parser.serve_parser)
    assert e.value.param == "tool_call_parser" and "qwen3_xml" in str(e.value)


def test_the_parser_is_picked_from_the_template():
    assert resolve_tool_call_parser("auto", _tokenizer("3.5")) == "qwen3_xml"
    assert resolve_tool_call_parser("auto", _tokenizer("3.6")) == "qwen3_xml"
    assert resolve_tool_call_parser("auto", AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)) == "hermes"
    assert resolve_tool_call_parser("auto", {"default": "x <function=y>", "tool_use": "z"}) == "qwen3_xml"
    assert resolve_tool_call_parser("hermes", _tokenizer("3.5")) == "hermes"
    with pytest.raises(Exception) as e:
        resolve_tool_call_parser("json", None)
    assert e.value.param == "tool_call_parser"


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_forced_choice_is_a_grammar_over_the_xml_form(choice, parallel):
    import xgrammar

    def accepts(grammar, text: str) -> bool:  # (a string-only matcher: xgrammar's public pieces)
        compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]), cache_enabled=False)
        matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(grammar), terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=choice,
                                 parallel_tool_calls=parallel)
    params = _render("3.6", enable_thinking=False).params(_tokenizer("3.6"), body, 100, None, {})
    kind, tag = params.structured_outputs.spec()
    assert kind == "structural_tag" and '"style": "qwen_xml"' in tag
    grammar = build_grammar(kind, tag)
    # what the 3.6 template renders for an earlier call is what the grammar lets the model write
    turn = _render("3.6").text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    one = turn[turn.index("<tool_call>"):turn.index("</tool_call>") + len("</tool_call>")]
    assert accepts(grammar, one)
    both = one + "\n" + one
    assert accepts(grammar, both) == (parallel and isinstance(choice, str))
    ping = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    assert accepts(grammar, ping) == isinstance(choice, str)
    assert not accepts(grammar, one.replace("<parameter=days>\n3", "<parameter=days>\nthree"))
