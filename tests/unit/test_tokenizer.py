"""Tokenizer helpers and incremental detokenization, against the real Qwen3 tokenizer."""

from __future__ import annotations

import random

import pytest

from support.checkpoints import QWEN3_TOKENIZER
from transformers.convert_slow_tokenizer import bytes_to_unicode
from mili.errors import InvalidRequest
from mili.tokenizer.detokenizer import TextStream
from mili.tokenizer.tokenizer import (apply_chat_template, encode_prompt, load_eos_token_ids,
                                      load_tokenizer)


QWEN3_DIR = QWEN3_TOKENIZER  # tests/data/qwen3-tokenizer

IM_END, ENDOFTEXT, THINK = 151645, 151643, 151667
EMOJI = "Hi 👋🏽 family: 👨‍👩‍👧 ok"
CJK = "你好，世界。日本語のテキスト"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(QWEN3_DIR))


def stream_all(tok, ids, stop=(), skip=True, finish=True):
    """Feed ids one by one, taking a delta after each; returns (stream, deltas, stopped_at)."""
    s = TextStream(tok, [1, 2, 3], list(stop), skip)
    deltas, stopped_at = [], None
    for i, t in enumerate(ids):
        hit = s.append(t)
        deltas.append(s.take_delta())
        taken = "".join(deltas)
        if not hit:  # text taken so far is never retracted
            assert s.text.startswith(taken)
        if hit:
            stopped_at = i
            break
    if finish:
        s.finish()
        deltas.append(s.take_delta())
    return s, deltas, stopped_at


# -- incremental detokenization -------------------------------------------------------------------
@pytest.mark.parametrize("text", [EMOJI, CJK, "plain ascii, with  spaces\nand lines", ""])
def test_stream_matches_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    if text:
        assert len(ids) > 1
    s, deltas, _ = stream_all(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == s.text == tok.decode(ids) == text


def test_multibyte_split_over_tokens_is_held(tok):
    # Single-byte tokens force one character over several tokens: nothing until it is whole.
    vocab = tok.backend_tokenizer.get_vocab()
    b2id = {b: vocab[c] for b, c in bytes_to_unicode().items()}  # GPT-2's byte <-> symbol table
    ids = [b2id[b] for b in "👋🏽你".encode()]
    s = TextStream(tok, [], [])
    deltas = []
    for t in ids:
        s.append(t)
        deltas.append(s.take_delta())
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[3] == "👋" and deltas[7] == "🏽" and deltas[10] == "你"
    assert "".join(deltas) == "👋🏽你"
    # A dangling partial character is released as U+FFFD on finish, like decode().
    s = TextStream(tok, [], [])
    for t in ids[:2]:
        s.append(t)
    assert s.take_delta() == "" and s.text == ""
    s.finish()
    assert s.take_delta() == s.text == tok.decode(ids[:2]) == "\ufffd"


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_decode(tok, skip):
    rng = random.Random(1234)
    specials = [IM_END, ENDOFTEXT, 151644, THINK, 151668, 151657]
    for trial in range(60):
        n = rng.randint(1, 40)
        ids = []
        for _ in range(n):
            r = rng.random()
            if r < 0.08:
                ids.append(rng.choice(specials))
            elif r < 0.5:
                ids.append(rng.randint(0, 255))  # low ids: many single bytes, often partial chars
            else:
                ids.append(rng.randint(0, 151642))
        s, deltas, _ = stream_all(tok, ids, skip=skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == s.text
        assert s.text == expected, (trial, ids)


def test_unknown_ids_are_ignored(tok):
    ids = tok.encode("ok", add_special_tokens=False) + [151900]  # an embedding row with no token
    s, deltas, _ = stream_all(tok, ids)
    assert s.text == "".join(deltas) == tok.decode(ids) == "ok"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = tok.encode("<think>\nhm\n</think>\n\nDone.", add_special_tokens=False) + [IM_END]
    assert THINK in ids
    s, deltas, _ = stream_all(tok, ids, skip=skip)
    assert s.text == "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    if skip:
        assert s.text == "<think>\nhm\n</think>\n\nDone."  # <think> is not special in Qwen3
    else:
        assert s.text.endswith("Done.<|im_end|>")


# -- stop strings -----------------------------------------------------------------------------------
def test_stop_spanning_tokens(tok):
    text = "The story goes on. THE END OF the story. More text."
    ids = tok.encode(text, add_special_tokens=False)
    s, deltas, at = stream_all(tok, ids, stop=["END OF"])
    assert at is not None and at < len(ids) - 1
    assert s.finished and s.stop_string == "END OF"
    assert s.text == "The story goes on. THE "
    assert "".join(deltas) == s.text
    # the stop string spans several tokens
    pieces = [tok.decode([t]) for t in ids]
    assert not any("END OF" in p for p in pieces)


def test_stop_inside_a_word(tok):
    text = "unbelievable results"
    ids = tok.encode(text, add_special_tokens=False)
    s, deltas, _ = stream_all(tok, ids, stop=["liev"])
    assert s.text == "unbe" == "".join(deltas)
    assert s.stop_string == "liev"


def test_earliest_stop_wins(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text, add_special_tokens=False)
    s, deltas, _ = stream_all(tok, ids, stop=["delta", "beta", "gamma"])
    assert s.text == "alpha " == "".join(deltas)
    assert s.stop_string == "beta"
    # Two stops completing in the same token: the one that starts first wins.
    s2 = TextStream(tok, [], ["lo world", "world"])
    for t in tok.encode("hello world", add_special_tokens=False):
        if s2.append(t):
            break
    assert s2.text == "hel" and s2.stop_string == "lo world"


def test_held_back_prefix_released_on_finish(tok):
    text = "Answer: 42 END"
    ids = tok.encode(text, add_special_tokens=False)
    s = TextStream(tok, [], ["END OF"])
    deltas = []
    for t in ids:
        assert not s.append(t)
        deltas.append(s.take_delta())
        assert s.text.startswith("".join(deltas))
    assert "".join(deltas) == "Answer: 42 "  # "END" could still become "END OF": held back
    assert s.text == text
    s.finish()
    deltas.append(s.take_delta())
    assert "".join(deltas) == text == s.text
    assert s.stop_string is None


def test_hold_shrinks_when_prefix_breaks(tok):
    s = TextStream(tok, [], ["abcd"])
    taken = ""
    for piece in ["xa", "b", "c", "X", "ab"]:
        for t in tok.encode(piece, add_special_tokens=False):
            assert not s.append(t)
        taken += s.take_delta()
        assert s.text.startswith(taken)
    assert taken == "xabcX"
    s.finish()
    taken += s.take_delta()
    assert taken == s.text == "xabcXab"


def test_stop_with_special_token_text(tok):
    ids = tok.encode("Hi there", add_special_tokens=False) + [IM_END] + tok.encode(
        "tail", add_special_tokens=False)
    s, deltas, at = stream_all(tok, ids, stop=["<|im_end|>"], skip=False)
    assert s.text == "Hi there" == "".join(deltas) and s.stop_string == "<|im_end|>"
    s, deltas, at = stream_all(tok, ids, stop=["<|im_end|>"], skip=True)
    assert at is None and s.text == "Hi theretail"


def test_random_stop_strings_prefix_property(tok):
    rng = random.Random(7)
    base = "the quick brown fox jumps over the lazy dog, 你好世界 👋🏽 again and again"
    ids = tok.encode(base, add_special_tokens=False)
    for _ in range(100):
        i = rng.randrange(len(base))
        stop = base[i:i + rng.randint(1, 8)]
        other = rng.choice(["zzz", "ov", "again", "dog,"])
        s, deltas, _ = stream_all(tok, ids, stop=[stop, other])
        # reference: after each token, the earliest stop found in the whole text so far ends it
        for k in range(1, len(ids) + 1):
            text = tok.decode(ids[:k])
            found = [text.find(x) for x in (stop, other) if x in text]
            if found:
                break
        assert s.text == text[:min(found)] == "".join(deltas)


def test_append_after_finish_is_ignored(tok):
    s = TextStream(tok, [], None)
    for t in tok.encode("abc", add_special_tokens=False):
        s.append(t)
    s.finish()
    assert not s.append(tok.encode("d", add_special_tokens=False)[0])
    assert s.text == "abc"


# -- tokenizer helpers --------------------------------------------------------------------------
def test_load_eos_token_ids(tok, tmp_path):
    from types import SimpleNamespace

    assert load_eos_token_ids(str(QWEN3_DIR), tok, None) == [IM_END, ENDOFTEXT]
    # no generation_config.json: the model config, then the tokenizer
    assert load_eos_token_ids(str(tmp_path), tok, SimpleNamespace(eos_token_id=7)) == [7]
    assert load_eos_token_ids(str(tmp_path), tok, SimpleNamespace(eos_token_id=[7, 8, 7])) == [7, 8]
    assert load_eos_token_ids(str(tmp_path), tok, SimpleNamespace(eos_token_id=None)) == [IM_END]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 5}')
    assert load_eos_token_ids(str(tmp_path), tok, SimpleNamespace(eos_token_id=7)) == [5]


def test_chat_template_thinking(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    off = apply_chat_template(tok, messages, True, {"enable_thinking": False})
    on = apply_chat_template(tok, messages, True, {"enable_thinking": True})
    default = apply_chat_template(tok, messages)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    assert default == on
    assert off.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    no_gen = apply_chat_template(tok, messages, add_generation_prompt=False)
    assert no_gen.endswith("Hi<|im_end|>\n")
    # text content parts are accepted and flattened
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert apply_chat_template(tok, parts) == apply_chat_template(tok, [{"role": "user", "content": "Hi"}])


def test_continue_final_message(tok):
    """vLLM's continue_final_message: the template renders the final assistant message, cut at its end."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
    for kwargs in ({}, {"enable_thinking": False}):
        text = apply_chat_template(tok, messages, False, kwargs, continue_final_message=True)
        assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nWell, "
    rules = [(dict(add_generation_prompt=True), "add_generation_prompt"),  # both: vLLM's 400
             (dict(messages=messages[:1]), "messages")]  # the final message must be the assistant's
    for change, param in rules:
        args = {"messages": messages, "add_generation_prompt": False, **change}
        with pytest.raises(InvalidRequest) as e:
            apply_chat_template(tok, args["messages"], args["add_generation_prompt"], continue_final_message=True)
        assert e.value.param == param


@pytest.mark.parametrize("messages", [
    "hello", [], [1, 2], [{"content": "no role"}], [{"role": 3, "content": "x"}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
    {"role": "user", "content": "x"},
])
def test_malformed_messages(tok, messages):
    with pytest.raises(InvalidRequest) as e:
        apply_chat_template(tok, messages)
    assert e.value.param == "messages" and e.value.code == "invalid_parameter"


def test_chat_template_errors(tok):
    with pytest.raises(InvalidRequest) as e:
        apply_chat_template(tok, [{"role": "user", "content": "x"}], True, {"tokenize": True})
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequest) as e:
        apply_chat_template(tok, [{"role": "user", "content": "x"}], True, "nope")
    assert e.value.param == "chat_template_kwargs"

    class NoTemplate:
        chat_template = None

    with pytest.raises(InvalidRequest) as e:
        apply_chat_template(NoTemplate(), [{"role": "user", "content": "x"}])
    assert e.value.param == "messages"


def test_template_exception_is_invalid_request(tok):
    # Qwen3's template raises for a conversation with no user query when a tool turn is last.
    try:
        original = tok.chat_template
        tok.chat_template = "{{ raise_exception('bad conversation') }}"
        with pytest.raises(InvalidRequest) as e:
            apply_chat_template(tok, [{"role": "user", "content": "x"}])
        assert e.value.param == "messages" and "bad conversation" in str(e.value)
        assert e.value.code == "chat_template_error"  # (a malformed message is an invalid_parameter)
    finally:
        tok.chat_template = original


def test_encode_prompt(tok):
    text = apply_chat_template(tok, [{"role": "user", "content": "Hi"}])
    ids = encode_prompt(tok, text, add_special_tokens=False)
    assert ids[0] == 151644 and ids == tok.encode(text, add_special_tokens=False)
    assert encode_prompt(tok, "Hello world") == tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode(encode_prompt(tok, EMOJI)) == EMOJI


# -- the repository's copy of the tokenizer (tests/data/qwen3-tokenizer) is the one it replaced ------------------
# Recorded from Qwen/Qwen3-0.6B's published tokenizer files (vocab.json, merges.txt and all) before the copy
# kept only tokenizer.json, tokenizer_config.json and generation_config.json.
MULTILINGUAL = "Hello, wörld! 你好，世界。 Привет, мир! 🌍👨‍👩‍👧 こんにちは العربية <think>x</think>\t\n  def f(): return 1"
MULTILINGUAL_IDS = [9707, 11, 289, 9416, 507, 0, 220, 108386, 3837, 99489, 1773, 79484, 26991, 8178, 11, 137144, 0,
                    11162, 234, 235, 145367, 378, 235, 145233, 378, 235, 145665, 220, 89015, 129071, 220, 151667, 87,
                    151668, 1572, 220, 707, 282, 4555, 470, 220, 16]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "Thanks"}]
# enable_thinking -> (sha256 of the rendered prompt, its token count)
CHAT_RENDERED = {True: ("5a120074017368bc6e1600245476995fe1f43c74e320987b1a1aecb06485d624", 197),
                 False: ("8a206de386d5138552c9d383cccf912b2af2da3a96025e5681acf306bcabbcd0", 201)}


def test_repository_tokenizer_is_the_published_one(tok):
    import hashlib

    assert sorted(p.name for p in QWEN3_DIR.iterdir()) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert tok.encode(MULTILINGUAL, add_special_tokens=False) == MULTILINGUAL_IDS
    assert tok.decode(MULTILINGUAL_IDS) == MULTILINGUAL
    for thinking, (digest, n_tokens) in CHAT_RENDERED.items():
        text = tok.apply_chat_template(CHAT, tools=CHAT_TOOLS, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=thinking)
        assert hashlib.sha256(text.encode()).hexdigest() == digest
        assert len(tok.encode(text, add_special_tokens=False)) == n_tokens


def test_a_folder_s_tokenizer_loads_once_until_its_files_change(tmp_path):
    """Engines built again from one folder in a process share its tokenizer (Qwen's tokenizer.json takes about a
    second to parse); a file changed since (its size or time) loads afresh, as does another folder with the same
    files."""
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(QWEN3_TOKENIZER, folder)
    first = load_tokenizer(str(folder))
    assert load_tokenizer(str(folder) + "/") is first
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")  # (one byte more)
    again = load_tokenizer(str(folder))
    assert again is not first and again.encode("Hello") == first.encode("Hello")
    other = tmp_path / "copy"
    shutil.copytree(folder, other)
    assert load_tokenizer(str(other)) is not again
