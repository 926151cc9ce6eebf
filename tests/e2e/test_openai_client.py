"""The official `openai` Python client against a real `mili serve`: the wire format as clients see it."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest
from openai import OpenAI

from support.server import Server, openai_client

MSGS = [{"role": "user", "content": "Say hello."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module", params=["tp1", "tp2", "api2"])
def server(request, random_model):
    """The whole suite against one rank, against two (tensor parallelism over gloo on the CPU), and through two
    API processes (--api-server-count 2)."""
    s = Server(random_model, *{"tp1": [], "tp2": ["--tensor-parallel-size", "2"],
                               "api2": ["--api-server-count", "2"]}[request.param])
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def scripted(scripted_server) -> OpenAI:
    return openai_client(scripted_server)


def _count(server, **body) -> int:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"])
    return out["count"]


def _extra(obj, name):
    """A field the client's models do not declare (kept in model_extra)."""
    return (obj.model_extra or {}).get(name, getattr(obj, name, None))


# -- /v1/models ---------------------------------------------------------------------------------
def test_models_list(client, server):
    models = list(client.models.list())
    assert [m.id for m in models] == ["test"]
    m = models[0]
    assert m.object == "model" and m.owned_by == "mili"
    assert isinstance(m.created, int) and m.created > 0
    assert _extra(m, "max_model_len") == 1024
    page = client.models.list()
    assert page.object == "list"


# -- /v1/completions ----------------------------------------------------------------------------
def test_completion_usage_and_length(client, server):
    prompt = "The quick brown fox jumps over"
    r = client.completions.create(model="test", prompt=prompt, max_tokens=9, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == "test" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason == "length" and isinstance(c.text, str) and c.logprobs is None
    assert r.usage.prompt_tokens == _count(server, prompt=prompt)
    assert r.usage.completion_tokens == 9
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9


def test_completion_prompt_forms(client, server):
    # a list of strings: one choice per prompt, indexed in prompt order
    prompts = ["Once upon a time", "In a galaxy far away, there", "1 2 3"]
    r = client.completions.create(model="test", prompt=prompts, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == sum(_count(server, prompt=p) for p in prompts)
    assert r.usage.completion_tokens == 15
    # each choice is what the prompt gives on its own
    for p, c in zip(prompts, r.choices):
        alone = client.completions.create(model="test", prompt=p, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert alone.choices[0].text == c.text, p

    # token ids give the same as the text they encode
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompts[1]}).json()["tokens"]
    by_ids = client.completions.create(model="test", prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == r.choices[1].text

    # a list of token-id lists, with n=2: index = prompt * n + choice
    two = client.completions.create(model="test", prompt=[ids, ids[:3]], max_tokens=3, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.usage.prompt_tokens == len(ids) + 3  # each prompt counted once, whatever n
    assert two.usage.completion_tokens == 12
    assert two.choices[0].text == two.choices[1].text  # greedy: both choices agree


def test_completion_stream_matches_non_stream(client):
    kw = dict(model="test", prompt="Streaming should not change the text", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks and all(ch.object == "text_completion" and ch.id == chunks[0].id for ch in chunks)
    assert all(ch.usage is None for ch in chunks)  # no include_usage: usage nowhere
    assert all(len(ch.choices) == 1 and ch.choices[0].index == 0 for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason]
    assert finishes == ["length"] and chunks[-1].choices[0].finish_reason == "length"

    # seeded sampling streams the same text as the non-streamed request
    seeded = dict(kw, temperature=1.0, seed=1234)
    full = client.completions.create(**seeded)
    assert "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **seeded)) \
        == full.choices[0].text


def test_completion_stream_include_usage(client, server):
    prompt = "Count the tokens of this prompt"
    chunks = list(client.completions.create(model="test", prompt=prompt, max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    with_usage = [ch for ch in chunks if ch.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == _count(server, prompt=prompt)
    assert last.usage.completion_tokens == 7
    assert last.usage.total_tokens == last.usage.prompt_tokens + 7
    assert all(ch.choices for ch in chunks[:-1])


def test_completion_stream_multi_prompt_n(client):
    kw = dict(model="test", prompt=["Alpha beta", "Gamma delta epsilon"], max_tokens=6, temperature=1.0, n=2,
              seed=7, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    texts: dict[int, str] = {}
    finish: dict[int, list] = {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish.setdefault(c.index, []).append(c.finish_reason)
    assert sorted(texts) == [0, 1, 2, 3]
    assert {c.index: c.text for c in full.choices} == texts
    assert finish == {i: ["length"] for i in range(4)}


def test_cached_tokens_present(client):
    r = client.completions.create(model="test", prompt="Zyxwvut unique prefix for cached tokens 48151623",
                                  max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    c = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "Qwxz unique chat 9"}],
                                       max_tokens=2, temperature=0)
    assert c.usage.prompt_tokens_details is not None
    assert isinstance(c.usage.prompt_tokens_details.cached_tokens, int)
    assert 0 <= c.usage.prompt_tokens_details.cached_tokens < c.usage.prompt_tokens


# -- n and seeds ----------------------------------------------------------------------------------
def test_n_and_seed_reproducibility(client):
    kw = dict(model="test", prompt="Random words follow:", max_tokens=16, temperature=1.0, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=42, **kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert a.usage.completion_tokens == 48
    b = client.completions.create(seed=42, **kw)
    assert [(c.index, c.text) for c in a.choices] == [(c.index, c.text) for c in b.choices]
    other = client.completions.create(seed=43, **kw)
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    one = client.completions.create(**dict(kw, n=1), seed=42)
    two = client.completions.create(**dict(kw, n=1), seed=4242)
    assert one.choices[0].text != two.choices[0].text

    chat_kw = dict(model="test", messages=MSGS, max_tokens=16, temperature=1.0, n=3,
                   extra_body={"ignore_eos": True, **NO_THINK})
    x = client.chat.completions.create(seed=5, **chat_kw)
    y = client.chat.completions.create(seed=5, **chat_kw)
    assert [c.index for c in x.choices] == [0, 1, 2]
    assert [c.message.content for c in x.choices] == [c.message.content for c in y.choices]
    z = client.chat.completions.create(seed=6, **chat_kw)
    assert [c.message.content for c in x.choices] != [c.message.content for c in z.choices]


# -- stop strings ---------------------------------------------------------------------------------
def _pick_stop(text: str) -> tuple[str, int]:
    """A 3-character stop string from the middle of ``text`` whose first occurrence is where it was taken."""
    for start in range(5, len(text) - 3):
        s = text[start:start + 3]
        if s.strip() and text.find(s) == start:
            return s, start
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string(client):
    kw = dict(model="test", prompt="Tell me a long story about a dragon", temperature=0,
              extra_body={"ignore_eos": True})
    base = client.completions.create(max_tokens=24, **kw).choices[0].text
    assert len(base) > 12, base
    stop, at = _pick_stop(base)
    r = client.completions.create(max_tokens=24, stop=[stop], **kw)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == base[:at]
    assert r.usage.completion_tokens <= 24
    # also as a bare string, and among stops that never match
    r2 = client.completions.create(max_tokens=24, stop=stop, **kw)
    assert r2.choices[0].text == base[:at] and r2.choices[0].finish_reason == "stop"
    r3 = client.completions.create(max_tokens=24, stop=["\x00never\x00", stop], **kw)
    assert r3.choices[0].text == base[:at]

    chunks = list(client.completions.create(max_tokens=24, stop=[stop], stream=True, **kw))
    pieces = [ch.choices[0].text for ch in chunks if ch.choices]
    streamed = "".join(pieces)
    assert streamed == base[:at]
    assert stop not in streamed
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]


def test_stop_string_chat(client):
    kw = dict(model="test", messages=MSGS, temperature=0, max_tokens=24,
              extra_body={"ignore_eos": True, **NO_THINK})
    base = client.chat.completions.create(**kw).choices[0].message.content
    stop, at = _pick_stop(base)
    r = client.chat.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == base[:at]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       client.chat.completions.create(stop=[stop], stream=True, **kw) if ch.choices)
    assert streamed == base[:at] and stop not in streamed


# -- /v1/chat/completions -----------------------------------------------------------------------
def test_chat_non_stream_and_stream(client, server):
    kw = dict(model="test", messages=MSGS, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(max_completion_tokens=10, **kw)
    assert full.object == "chat.completion" and full.model == "test" and full.id.startswith("chatcmpl-")
    (c,) = full.choices
    assert c.index == 0 and c.message.role == "assistant" and c.finish_reason == "length"
    assert full.usage.prompt_tokens == _count(server, messages=MSGS)
    assert full.usage.completion_tokens == 10  # max_completion_tokens is honoured
    assert full.usage.total_tokens == full.usage.prompt_tokens + 10
    # max_tokens (the older name) too
    assert client.chat.completions.create(max_tokens=4, **kw).usage.completion_tokens == 4

    chunks = list(client.chat.completions.create(max_completion_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [ch for ch in chunks if ch.choices]
    content = "".join(ch.choices[0].delta.content or "" for ch in body)
    reasoning = "".join(_extra(ch.choices[0].delta, "reasoning_content") or "" for ch in body)
    assert content == (c.message.content or "")
    assert reasoning == (_extra(c.message, "reasoning_content") or "")
    assert [ch.choices[0].finish_reason for ch in body if ch.choices[0].finish_reason] == ["length"]
    assert [ch for ch in chunks if ch.usage is not None] == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 10

    # thinking off: everything is content
    off = client.chat.completions.create(max_completion_tokens=10, **dict(kw, extra_body={"ignore_eos": True,
                                                                                           **NO_THINK}))
    assert off.usage.prompt_tokens == _count(server, messages=MSGS, **NO_THINK)
    assert off.usage.prompt_tokens != full.usage.prompt_tokens  # the template closes the think block
    assert _extra(off.choices[0].message, "reasoning_content") is None
    streamed = list(client.chat.completions.create(max_completion_tokens=10, stream=True,
                                                   **dict(kw, extra_body={"ignore_eos": True, **NO_THINK})))
    assert all(ch.usage is None for ch in streamed)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == off.choices[0].message.content


@functools.cache
def _offline_text(model: str, prompt_ids: tuple[int, ...], max_tokens: int) -> str:
    """The offline engine's greedy text for these prompt tokens (ignoring EOS)."""
    from mili import LLM, SamplingParams

    (out,) = LLM(model, dtype="float32").generate({"prompt_token_ids": list(prompt_ids)}, SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return out.outputs[0].text


def test_continue_final_message(client, server, random_model):
    """vLLM's continue_final_message (issue 30, defect d): the final assistant message is left open and the
    reply continues it, the offline engine's greedy text for the same prompt tokens (HF's rendering of it)."""
    from transformers import AutoTokenizer

    messages = [*MSGS, {"role": "assistant", "content": "Hello, my friend"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    kw = dict(model="test", messages=messages, temperature=0, max_tokens=8, extra_body=extra)
    tok = AutoTokenizer.from_pretrained(random_model)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                     continue_final_message=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHello, my friend")
    ids = tok(prompt, add_special_tokens=False).input_ids
    expected = _offline_text(str(random_model), tuple(ids), 8)
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == len(ids) == _count(server, messages=messages, add_generation_prompt=False,
                                                       continue_final_message=True)
    message = r.choices[0].message
    assert message.content == expected and _extra(message, "reasoning_content") is None  # past the thinking
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == expected
    # add_generation_prompt false alone: the prompt ends after the final message's turn, as vLLM renders it
    closed = client.chat.completions.create(**{**kw, "extra_body": {"add_generation_prompt": False}})
    no_header = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert closed.usage.prompt_tokens == len(tok(no_header, add_special_tokens=False).input_ids)
    # vLLM's 400s: with add_generation_prompt (true by default), and with a final turn that is not the assistant's
    for body in ({**kw, "extra_body": {"continue_final_message": True}},
                 {**kw, "extra_body": {**extra, "add_generation_prompt": True}},
                 {**kw, "messages": MSGS}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**body)
        assert e.value.body["param"] in ("add_generation_prompt", "messages"), e.value.body


# -- logprobs -------------------------------------------------------------------------------------
def test_completion_logprobs(client):
    r = client.completions.create(model="test", prompt="Logprobs please", max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    n = r.usage.completion_tokens
    assert n == 8
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(tok, str) and val <= 0.0
        assert 1 <= len(top) <= 3
        assert all(v <= 0.0 for v in top.values())
        assert val == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the top one
        assert top.get(tok) == pytest.approx(val, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    streamed = list(client.completions.create(model="test", prompt="Logprobs please", max_tokens=8, temperature=0,
                                              logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    vals = [v for ch in streamed if ch.choices and ch.choices[0].logprobs
            for v in ch.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens
    assert vals == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_completion_stream_text_offset(client):
    kw = dict(model="test", prompt="Offsets please", max_tokens=8, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].logprobs.text_offset
    assert full[0] == 0 and full == sorted(full) and len(set(full)) > 1
    streamed = [o for ch in client.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for o in ch.choices[0].logprobs.text_offset]
    assert streamed == full


def test_chat_logprobs(client):
    kw = dict(model="test", messages=MSGS, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True, **NO_THINK})
    r = client.chat.completions.create(**kw)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens == 6
    for it in items:
        assert isinstance(it.token, str) and it.logprob <= 0.0
        assert it.bytes == list(it.token.encode())
        assert len(it.top_logprobs) == 2
        assert it.top_logprobs[0].logprob >= it.top_logprobs[1].logprob
        assert it.logprob == pytest.approx(it.top_logprobs[0].logprob, abs=1e-5)  # greedy
        assert it.top_logprobs[0].token == it.token
    # logprobs without top_logprobs: the sampled token's only
    plain = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert [i.token for i in plain.choices[0].logprobs.content] == [i.token for i in items]
    assert all(i.top_logprobs == [] for i in plain.choices[0].logprobs.content)

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = [it for ch in chunks if ch.choices and ch.choices[0].logprobs
                for it in ch.choices[0].logprobs.content]
    assert len(streamed) == chunks[-1].usage.completion_tokens == 6
    assert [i.token for i in streamed] == [i.token for i in items]
    assert all(len(i.top_logprobs) == 2 for i in streamed)



def _long_prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 150000) for _ in range(n)]


def test_completion_echo_logprobs(client, server):
    """lm-eval's request: echo + logprobs over a token-id prompt (300 tokens: the real vocabulary's logits come
    in two slices), then the generated token's; max_tokens 0 scores alone; the stream echoes it first."""
    prompt = _long_prompt(300, 1)
    kw = dict(model="test", prompt=prompt, echo=True, logprobs=2, temperature=0)
    r = client.completions.create(max_tokens=1, **kw)
    (c,) = r.choices
    text = httpx.post(server.url + "/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert c.text.startswith(text) and len(c.text) > len(text) and c.finish_reason == "length"
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 301
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert "".join(lp.tokens[:300]) == text and lp.text_offset == sorted(lp.text_offset)
    for tok, val, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert val < 0 and 2 <= len(top) <= 3 and top[tok] == pytest.approx(val, abs=1e-6)
        assert max(top.values()) >= val
    prompt_lps = _extra(c, "prompt_logprobs")  # vLLM's field: the same scores, by token id
    assert len(prompt_lps) == 300 and prompt_lps[0] is None
    for i in range(1, 300):
        entry = prompt_lps[i][str(prompt[i])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-6) and entry["rank"] >= 1
    assert r.usage.prompt_tokens == 300 and r.usage.completion_tokens == 1

    zero = client.completions.create(max_tokens=0, **kw)
    (z,) = zero.choices
    assert z.text == text and z.finish_reason == "length" and zero.usage.completion_tokens == 0
    assert z.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:300], abs=1e-5)

    chunks = list(client.completions.create(max_tokens=3, stream=True, extra_body={"ignore_eos": True}, **kw))
    first = chunks[0].choices[0]
    assert first.text.startswith(text) and first.logprobs.token_logprobs[0] is None
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    assert len(streamed) == 303 and streamed[1:301] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_prompt_scores_agree_with_sampling(client):
    """Two code paths, one distribution: the most likely next token after a prompt, as the prefill scores it
    (prompt_logprobs' rank 1 at the position after the prompt), is what greedy sampling picks, with the
    logprob the sampler reports."""
    prompt = _long_prompt(40, 2)
    scored = client.completions.create(model="test", prompt=prompt + [prompt[0]], max_tokens=0,
                                       extra_body={"prompt_logprobs": 1})
    best = min(_extra(scored.choices[0], "prompt_logprobs")[-1].values(), key=lambda e: e["rank"])
    assert best["rank"] == 1
    r = client.completions.create(model="test", prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    assert r.choices[0].logprobs.tokens[0] == best["decoded_token"]
    assert r.choices[0].logprobs.token_logprobs[0] == pytest.approx(best["logprob"], abs=1e-4)


def test_prompt_logprobs_extra(client, server):
    """vLLM's prompt_logprobs: on completions' choices (top N and the prompt token), on chat's response;
    refused with stream, as vLLM does; max_tokens 0 asks for them."""
    prompt = _long_prompt(12, 3)
    r = client.completions.create(model="test", prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    (c,) = r.choices
    assert c.logprobs is None and len(c.text) > 0
    entries = _extra(c, "prompt_logprobs")
    assert len(entries) == 12 and entries[0] is None
    for token, entry in zip(prompt[1:], entries[1:]):
        assert list(entry)[0] == str(token)  # the prompt token first, then the top 3
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(token))
        assert len(entry) in (3, 4) and ranks[:3] == [1, 2, 3][:len(ranks)]
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values())

    chat = client.chat.completions.create(model="test", messages=MSGS, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0, **NO_THINK})
    plp = _extra(chat, "prompt_logprobs")
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None and all(len(e) == 1 for e in plp[1:])

    for body in ({"model": "test", "prompt": prompt, "prompt_logprobs": 1, "stream": True},
                 {"model": "test", "prompt": prompt, "max_tokens": 0},
                 {"model": "test", "prompt": prompt, "max_tokens": 0, "echo": True},
                 {"model": "test", "prompt": prompt, "prompt_logprobs": 21}):
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] in ("prompt_logprobs", "max_tokens")
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                      json={"model": "test", "messages": MSGS, "prompt_logprobs": 1, "stream": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"

# -- thinking (the scripted checkpoint) ---------------------------------------------------------
def test_thinking_non_stream(scripted, scripted_server):
    r = scripted.chat.completions.create(model="test", messages=MSGS, temperature=0, max_tokens=32)
    (c,) = r.choices
    assert c.finish_reason == "stop"
    assert c.message.content == "\n\nHello!"  # what follows </think>, as written (vLLM's rule)
    assert _extra(c.message, "reasoning_content") == "Let me think"
    assert _extra(c.message, "reasoning") == "Let me think"
    # <think> Let me think </think> \n\n Hello ! and <|im_end|>
    assert r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens == _count(scripted_server, messages=MSGS)

    off = scripted.chat.completions.create(model="test", messages=MSGS, temperature=0, max_tokens=32,
                                          extra_body=NO_THINK)
    (c,) = off.choices
    assert c.finish_reason == "stop" and c.message.content == "Hello!"
    assert _extra(c.message, "reasoning_content") is None and _extra(c.message, "reasoning") is None
    assert off.usage.completion_tokens == 3  # Hello ! <|im_end|>


def test_thinking_stream(scripted):
    chunks = list(scripted.chat.completions.create(model="test", messages=MSGS, temperature=0, max_tokens=32,
                                                   stream=True, logprobs=True, top_logprobs=1,
                                                   stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    lps = [it for ch in chunks if ch.choices and ch.choices[0].logprobs for it in ch.choices[0].logprobs.content]
    assert len(lps) == 9  # one per generated token, held-back reasoning text included
    assert [it.token for it in lps] == ["<think>", "Let", " me", " think", "</think>", "\n\n", "Hello", "!",
                                        "<|im_end|>"]
    body = [ch for ch in chunks if ch.choices]
    reasoning = [_extra(ch.choices[0].delta, "reasoning_content") for ch in body]
    reasoning_alias = [_extra(ch.choices[0].delta, "reasoning") for ch in body]
    content = [ch.choices[0].delta.content for ch in body]
    assert "".join(r or "" for r in reasoning) == "Let me think"
    assert reasoning == reasoning_alias
    assert "".join(c or "" for c in content) == "\n\nHello!"
    assert not any("<think>" in (c or "") or "</think>" in (c or "") for c in content)
    assert not any("<think>" in (r or "") or "</think>" in (r or "") for r in reasoning)
    assert [ch.choices[0].finish_reason for ch in body if ch.choices[0].finish_reason] == ["stop"]
    assert body[-1].choices[0].finish_reason == "stop"

    off = list(scripted.chat.completions.create(model="test", messages=MSGS, temperature=0, max_tokens=32,
                                                stream=True, extra_body=NO_THINK))
    assert "".join(ch.choices[0].delta.content or "" for ch in off if ch.choices) == "Hello!"
    assert all(_extra(ch.choices[0].delta, "reasoning_content") is None for ch in off if ch.choices)


def test_thinking_completions_keep_raw_text(scripted, scripted_server):
    """/v1/completions does not split reasoning: the chat prompt's greedy text comes back verbatim."""
    ids = httpx.post(scripted_server.url + "/tokenize", json={"messages": MSGS}).json()["tokens"]
    r = scripted.completions.create(model="test", prompt=ids, max_tokens=32, temperature=0)
    assert r.choices[0].text == "<think>Let me think</think>\n\nHello!"
    assert r.choices[0].finish_reason == "stop"


def test_thinking_null_kwarg_never_leaks_tags(scripted):
    r = scripted.chat.completions.create(model="test", messages=MSGS, temperature=0, max_tokens=32,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": None}})
    assert r.choices[0].message.content == "\n\nHello!"


def test_completion_top_logprobs_always_hold_the_sampled_token(client):
    """OpenAI: up to logprobs + 1 entries, the sampled token's among them even when it ranks lower."""
    r = client.completions.create(model="test", prompt="Sample widely", max_tokens=16, temperature=1.5, seed=3,
                                  logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    outside = 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and top.get(tok) == pytest.approx(val, abs=1e-5)
        outside += len(top) == 2
    assert outside > 0  # at temperature 1.5 some sampled tokens are not the most likely one
