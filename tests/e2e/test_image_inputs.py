"""Images in chat requests through a real `mili serve` of a tiny Qwen3-VL (tests/support/vision.py: the real Qwen3
tokenizer, Qwen3.5's released chat template): OpenAI's image_url parts (a data: URL, an http URL on an allowed
host, a file under the allowed folder), Anthropic's image blocks and the Responses API's input_image all give the
greedy reply the offline engine gives for the same prompt and image, and their usage counts the image's tokens;
bad image parts are 400s in each dialect's shape naming the part, and the server serves on. ``LLM.chat`` takes the
same parts offline."""

from __future__ import annotations

import base64
import functools
import http.server
import threading

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from mili import LLM, SamplingParams
from mili.errors import InvalidRequest

QUESTION = "What is in this picture?"
MAX_TOKENS = 8
IMAGE_TOKENS = 6  # a 64×96 image: a 4×6 patch grid, merged 2×2
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def asking(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def server(serve, vision_chat_model, test_images):
    return serve(vision_chat_model, "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path",
                 str(test_images[0].parent), "--limit-mm-per-prompt", '{"image": 2}')


@pytest.fixture(scope="module")
def llm(vision_chat_model):
    return LLM(str(vision_chat_model), dtype="float32", max_model_len=1024)


@pytest.fixture(scope="module")
def reference(vision_chat_model, test_images, llm):
    """The offline engine's greedy reply to QUESTION about image 0, its prompt rendered by transformers' own
    tokenizer and chat template (one image part) and its image given as multi_modal_data."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vision_chat_model)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                                   tokenize=False, add_generation_prompt=True, enable_thinking=False)
    ids = tok(text, add_special_tokens=False).input_ids
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": Image.open(test_images[0])}}, params,
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == len(ids) - 1 + IMAGE_TOKENS  # the one placeholder expanded
    assert out.outputs[0].text.strip()  # (text to compare: not only special or blank tokens)
    return out


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model="test", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=NO_THINK, **kwargs)


def test_data_url_reply_is_the_offline_engines(client, server, reference, test_images):
    reply = chat(client, asking(image_part(data_url(test_images[0]))))
    assert reply.choices[0].message.content == reference.outputs[0].text
    assert reply.usage.prompt_tokens == len(reference.prompt_token_ids)  # the image's tokens counted
    tokens = httpx.post(server.url + "/tokenize", json={"messages": asking(image_part(data_url(test_images[0]))),
                                                          "chat_template_kwargs": {"enable_thinking": False}},
                        timeout=60)
    assert tokens.json()["tokens"] == reference.prompt_token_ids, tokens.text  # /tokenize: the same, expanded
    other = chat(client, asking(image_part(data_url(test_images[1]))))  # another image: another reply
    assert other.choices[0].message.content != reference.outputs[0].text


def test_streamed_reply_and_usage(client, reference, test_images):
    stream = chat(client, asking(image_part(data_url(test_images[0]))), stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(reference.prompt_token_ids)


@pytest.fixture(scope="module")
def image_host(test_images):
    """An HTTP server on 127.0.0.1 serving the test images' folder."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(test_images[0].parent))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def test_remote_image_from_an_allowed_host_only(client, reference, image_host, test_images):
    name = test_images[0].name
    reply = chat(client, asking(image_part(f"http://127.0.0.1:{image_host}/{name}")))
    assert reply.choices[0].message.content == reference.outputs[0].text
    for url, says in [(f"http://localhost:{image_host}/{name}", "not allowed"),  # not in --allowed-media-domains
                      (f"http://127.0.0.1:{image_host}/missing.png", "HTTP 404")]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, asking(image_part(url)))
        assert e.value.body["param"] == "messages[0].content[0]" and says in e.value.body["message"], e.value.body


def test_local_file_under_the_allowed_folder_only(client, reference, test_images, tmp_path):
    reply = chat(client, asking(image_part(test_images[0].as_uri())))
    assert reply.choices[0].message.content == reference.outputs[0].text
    outside = tmp_path / "outside.png"
    outside.write_bytes(test_images[0].read_bytes())
    for url in [outside.as_uri(), f"{test_images[0].parent.as_uri()}/../{tmp_path.name}/outside.png", str(outside)]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, asking(image_part(url)))
        assert e.value.body["param"] == "messages[0].content[0]", (url, e.value.body)


def test_anthropic_image_block(server, reference, test_images, image_host):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(test_images[0].read_bytes()).decode()}}
    m = client.messages.create(model="test", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}])
    assert m.content[0].text == reference.outputs[0].text and m.stop_reason == "max_tokens"
    assert m.usage.input_tokens == len(reference.prompt_token_ids)
    by_url = {"type": "image", "source": {"type": "url", "url": f"http://127.0.0.1:{image_host}/{test_images[0].name}"}}
    m = client.messages.create(model="test", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [by_url, {"type": "text", "text": QUESTION}]}])
    assert m.content[0].text == reference.outputs[0].text
    count = client.messages.count_tokens(model="test", messages=[
        {"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}])
    assert count.input_tokens == len(reference.prompt_token_ids)
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="test", max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [{"type": "text", "text": QUESTION}, bad]}])
    assert e.value.body["type"] == "error" and "messages[0].content[1]" in e.value.body["error"]["message"]


def test_responses_input_image(client, reference, test_images):
    r = client.responses.create(model="test", max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(test_images[0])},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == reference.outputs[0].text
    assert r.usage.input_tokens == len(reference.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="test", input=[{"role": "user", "content": [
            {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": "data:image/png;base64,@"}]}])
    assert e.value.body["param"] == "input[0].content[1]", e.value.body


def test_bad_image_parts_are_400s_naming_the_part(client, reference, test_images, tmp_path):
    huge = tmp_path / "huge.png"
    Image.new("L", (8000, 6000)).save(huge)  # 48 megapixels: past the limit, though small as a file
    good = image_part(data_url(test_images[0]))
    cases = [
        (asking(image_part("data:image/png;base64,AAAA")), "messages[0].content[0]", "not an image"),
        (asking(good, image_part("data:image/png;base64,***")), "messages[0].content[1]", "base64"),
        (asking(good, {"type": "image_url"}), "messages[0].content[1]", "image_url.url"),
        (asking({"type": "input_audio", "input_audio": {}}), "messages[0].content[0]", "not supported"),
        (asking(image_part(data_url(huge))), "messages[0].content[0]", "pixels"),
        (asking(good, good, good), "messages[0].content[2]", "at most 2"),  # --limit-mm-per-prompt
        (asking(image_part("ftp://127.0.0.1/x.png")), "messages[0].content[0]", "data: URL"),
        ([{"role": "system", "content": [good]}, *asking()], "messages", "System message"),  # the template's rule
    ]
    for messages, param, says in cases:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, messages)
        body = e.value.body
        assert body["param"] == param and says in body["message"], (param, body)
    assert chat(client, asking(good)).choices[0].message.content == reference.outputs[0].text  # serving on


def test_llm_chat_takes_image_parts(llm, reference, test_images):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kwargs = dict(chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    by_url = llm.chat(asking(image_part(data_url(test_images[0]))), params, **kwargs)[0]
    by_pil = llm.chat(asking({"type": "image_pil", "image_pil": Image.open(test_images[0])}), params, **kwargs)[0]
    for out in (by_url, by_pil):
        assert out.prompt_token_ids == reference.prompt_token_ids
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[0\]: remote images are not allowed"):
        llm.chat(asking(image_part("http://127.0.0.1:9/x.png")), params, **kwargs)  # remote: not allowed offline


def test_language_model_only_takes_no_images(vision_chat_model, test_images):
    text_only = LLM(str(vision_chat_model), dtype="float32", max_model_len=1024, language_model_only=True)
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[1\]: this model takes no images"):
        text_only.chat([{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                     image_part(data_url(test_images[0]))]}], params, use_tqdm=False)
    assert text_only.chat(asking(), params, use_tqdm=False)[0].outputs[0].token_ids  # text: served
