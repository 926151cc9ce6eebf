"""mili/engine/media.py without a model: content parts made the chat template's, and the rules on where an image may
come from and how large it may be (each refusal an InvalidRequest naming the part)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from mili.engine.media import (TEMPLATE_IMAGE, ImageRef, MediaPolicy, content_parts, image_url_part,
                               template_content)
from mili.errors import InvalidRequest


def png(width: int = 32, height: int = 16) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), "teal").save(out, "PNG")
    return out.getvalue()


def url_of(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def load(policy: MediaPolicy, source, param: str = "messages[0].content[0]"):
    return policy.load(ImageRef(source=source, param=param))


def test_template_content_text_joined_images_kept_in_order():
    refs = []
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert template_content(text, "messages[0].content", refs) == "ab" and refs == []
    parts = [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": "data:x"}},
             {"type": "image_url", "image_url": "data:y"}]  # (vLLM's bare-string form too)
    assert template_content(parts, "messages[2].content", refs) == [{"type": "text", "text": "look: "},
                                                                      TEMPLATE_IMAGE, TEMPLATE_IMAGE]
    assert [(r.source, r.param) for r in refs] == [("data:x", "messages[2].content[1]"),
                                                  ("data:y", "messages[2].content[2]")]
    with pytest.raises(InvalidRequest) as e:
        template_content([{"type": "text", "text": "a"}, {"type": "input_audio"}], "messages[1].content", [])
    assert e.value.param == "messages[1].content[1]" and "input_audio" in str(e.value)


def test_a_translated_part_keeps_its_dialects_name():
    refs = []
    template_content([image_url_part("data:x", "input[3].content[0]")], "messages[1].content", refs)
    assert refs[0].param == "input[3].content[0]"
    assert content_parts(["a", "b"], "\n") == "a\nb"
    image = image_url_part("data:x", "p")
    assert content_parts(["a", "b", image, "c"], "\n") == [{"type": "text", "text": "a\nb"}, image,
                                                           {"type": "text", "text": "c"}]


def test_data_urls_decoded_and_bounded():
    image = load(MediaPolicy(), url_of(png()))
    assert image.size == (32, 16)
    for url, says in [(url_of(b"not a png"), "not an image"), ("data:image/png;base64,&&", "base64"),
                      ("data:text/plain;base64,QUJD", "data:image/"), ("data:image/png,raw", "data:image/")]:
        with pytest.raises(InvalidRequest, match=says) as e:
            load(MediaPolicy(), url)
        assert e.value.param == "messages[0].content[0]"
    small = len(png()) - 1
    with pytest.raises(InvalidRequest, match=f"larger than {small} bytes"):
        load(MediaPolicy(max_bytes=small), url_of(png()))
    with pytest.raises(InvalidRequest, match="32×16 pixels"):
        load(MediaPolicy(max_pixels=500), url_of(png()))
    with pytest.raises(InvalidRequest, match="32×16 pixels"):  # a PIL image (LLM.chat's image_pil) too
        load(MediaPolicy(max_pixels=500), Image.open(io.BytesIO(png())))


def test_remote_and_local_refused_by_default(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    for source, says in [("http://127.0.0.1:9/a.png", "remote images are not allowed"),
                         ("https://example.com/a.png", "remote images are not allowed"),
                         ((tmp_path / "a.png").as_uri(), "local images are not allowed"),
                         (str(tmp_path / "a.png"), "local images are not allowed"),
                         ("gopher://x/a.png", "data: URL")]:
        with pytest.raises(InvalidRequest, match=says):
            load(MediaPolicy(), source)
    with pytest.raises(InvalidRequest, match="not allowed from 'example.com'"):  # only the listed hosts
        load(MediaPolicy(allowed_domains=frozenset({"127.0.0.1"})), "https://example.com/a.png")


def test_local_files_only_inside_the_allowed_folder(tmp_path):
    root, outside = tmp_path / "media", tmp_path / "secret"
    root.mkdir(), outside.mkdir()
    (root / "a.png").write_bytes(png())
    (outside / "b.png").write_bytes(png())
    (root / "link.png").symlink_to(outside / "b.png")
    policy = MediaPolicy(local_root=root.resolve())
    assert load(policy, (root / "a.png").as_uri()).size == (32, 16)
    assert load(policy, str(root / "a.png")).size == (32, 16)
    for source in [(outside / "b.png").as_uri(), f"{root.as_uri()}/../secret/b.png", str(root / "link.png"),
                   str(root / "none.png"), root.as_uri()]:
        with pytest.raises(InvalidRequest, match="under the allowed local media path"):
            load(policy, source)
    with pytest.raises(InvalidRequest, match="larger than"):
        load(MediaPolicy(local_root=root.resolve(), max_bytes=len(png()) - 1), str(root / "a.png"))


def test_flags_and_config_file_keys(tmp_path):
    """--allowed-media-domains (comma-separated; a list in the config file), --allow-remote-media and
    --allowed-local-media-path reach EngineConfig, and MediaPolicy.from_config reads them."""
    from mili.cli import build_parser, engine_kwargs
    from mili.config import EngineConfig
    from mili.config_file import ConfigFileError, read_config_file

    parser = build_parser()
    kwargs = engine_kwargs(parser.parse_args(["serve", "--allowed-media-domains", "a.example, B.example",
                                              "--allow-remote-media", "--allowed-local-media-path", str(tmp_path)]))
    assert (kwargs["allowed_media_domains"], kwargs["allow_remote_media"], kwargs["allowed_local_media_path"]) == (
        "a.example, B.example", True, str(tmp_path))
    defaults = engine_kwargs(parser.parse_args(["serve"]))
    assert (defaults["allowed_media_domains"], defaults["allow_remote_media"],
            defaults["allowed_local_media_path"]) == (None, False, None)
    (tmp_path / "a.yaml").write_text("allowed_media_domains: [a.example, b.example]\n")
    assert read_config_file(str(tmp_path / "a.yaml"), parser.serve_parser)[0] == {
        "allowed_media_domains": "a.example,b.example"}
    (tmp_path / "b.yaml").write_text("allowed_media_domains: [1, 2]\n")
    with pytest.raises(ConfigFileError, match="a list of host names"):
        read_config_file(str(tmp_path / "b.yaml"), parser.serve_parser)

    config = EngineConfig(model="demo", allowed_media_domains="a.example, B.example",
                          allowed_local_media_path=str(tmp_path))
    policy = MediaPolicy.from_config(config)
    assert policy.allowed_domains == {"a.example", "b.example"} and policy.local_root == tmp_path.resolve()
    with pytest.raises(InvalidRequest, match="is not a folder"):
        EngineConfig(model="demo", allowed_local_media_path=str(tmp_path / "none"))
    assert not MediaPolicy().allow_remote and MediaPolicy().local_root is None  # the defaults: data: URLs only
