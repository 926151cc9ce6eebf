"""Images named by chat content parts, shared by the server's dialects and the offline ``LLM.chat`` (no torch).

A conversation's image parts (OpenAI's ``image_url``, or ``image_pil`` offline as vLLM's) are swapped for the part
a chat template renders as an image (``{"type": "image"}``: Qwen3-VL's and Qwen3.5's templates write
``<|vision_start|><|image_pad|><|vision_end|>`` for it) and collected in order, each with the parameter that
names it, so that an error points at the part (``messages[0].content[1]``). ``MediaPolicy.load`` then turns
each into a PIL image: a ``data:`` URL is decoded; an ``http(s)://`` URL is fetched only from the allowed domains
(or any, when remote media are allowed: off by default, since the server would otherwise fetch any address a
client names, its own network included); a ``file://`` URL or a local path only from under the allowed folder.
Every image is bounded in bytes and in pixels before it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from mili.errors import InvalidRequest
from mili.tokenizer.tokenizer import TEMPLATE_IMAGE

MAX_IMAGE_BYTES = 20 * 2**20  # an image's encoded size (a data: URL's decoded bytes, a fetched or read file)
MAX_IMAGE_PIXELS = 40_000_000  # width × height (a 7,300 × 5,500 photo), read from the header before decoding
FETCH_TIMEOUT = 10.0  # seconds for one remote image, connection and body
# an image part translated from another dialect (Anthropic's, the Responses API's) keeps the name it had there
ORIGIN = "_param"


@dataclass
class ImageRef:
    """One image part of a conversation: what it names (a URL or path, or a PIL image) and where it was."""

    source: object
    param: str


def template_content(content, param: str, refs: list[ImageRef]):
    """A message's content for the chat template: text parts joined into one string when there is no image,
    else the parts in order with each image part made ``TEMPLATE_IMAGE`` (its source appended to ``refs``)."""
    if not isinstance(content, list):
        return content
    parts, found = [], False
    for j, part in enumerate(content):
        where = (part.get(ORIGIN) if isinstance(part, dict) else None) or f"{param}[{j}]"
        source = image_source(part, where)
        if source is not None:
            refs.append(ImageRef(source=source, param=where))
            parts.append(TEMPLATE_IMAGE)
            found = True
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise part_error(where, f"content part of type {kind!r} is not supported (text, image_url)")
    return parts if found else "".join(p["text"] for p in parts)


def part_error(param: str, message: str) -> InvalidRequest:
    """An image part's error, its name in the message too (Anthropic's error bodies carry no param)."""
    return InvalidRequest(f"{param}: {message}", param=param)


def image_url_part(url: str, param: str) -> dict:
    """An OpenAI image part for another dialect's image (``param``: its name in that dialect's request)."""
    return {"type": "image_url", "image_url": {"url": url}, ORIGIN: param}


def content_parts(pieces: list, sep: str):
    """Another dialect's content as OpenAI's: its text pieces (strings) joined by ``sep``, or, when it holds image
    parts (dicts), the parts in order with the texts between them joined alike."""
    if all(isinstance(p, str) for p in pieces):
        return sep.join(pieces)
    parts: list[dict] = []
    for piece in pieces:
        if isinstance(piece, str) and parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += sep + piece
        else:
            parts.append({"type": "text", "text": piece} if isinstance(piece, str) else piece)
    return parts


def image_source(part, param: str):
    """What an image content part names (a URL or path string, or a PIL image); None for any other part."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "image_url":  # {"url": ..., "detail": ...} (detail ignored), or vLLM's bare string
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise part_error(param, "an image_url part needs image_url.url, a URL string")
        return url
    if kind == "image_pil":  # the offline API's: a PIL image object
        from PIL import Image

        if not isinstance(part.get("image_pil"), Image.Image):
            raise part_error(param, "an image_pil part needs image_pil, a PIL image")
        return part["image_pil"]
    return None


def check_count(count: int, limit: int, param: str) -> None:
    """``limit_mm_per_prompt["image"]``: the most images one prompt may carry."""
    if count > limit:
        raise part_error(param, f"{count} images in one prompt: at most {limit} (limit_mm_per_prompt)")


def check_images(refs: list[ImageRef], token_ids: list[int], image_inputs, limit: int) -> None:
    """Before any image is fetched or decoded: the model takes images (``image_inputs``: engine/image_inputs.py's
    ``ImageInputs``), no more than ``limit`` (``limit_mm_per_prompt["image"]``: the first past it is the
    error's part), and the chat template wrote one placeholder for each."""
    if not refs:
        return
    if not image_inputs.takes_images:
        raise part_error(refs[0].param, "this model takes no images (a text-only checkpoint, "
                                        "--language-model-only, or --limit-mm-per-prompt image 0)")
    check_count(len(refs), limit, refs[min(limit, len(refs) - 1)].param)
    placeholders = token_ids.count(image_inputs.model_config.image_token_id)
    if placeholders != len(refs):
        raise part_error(refs[0].param, f"the chat template wrote {placeholders} image placeholders for "
                                        f"{len(refs)} images (a template that does not render image parts?)")


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how large they may be."""

    allowed_domains: frozenset[str] = frozenset()
    allow_remote: bool = False
    local_root: Path | None = None
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    timeout: float = FETCH_TIMEOUT

    @classmethod
    def from_config(cls, config) -> MediaPolicy:
        root = config.allowed_local_media_path
        return cls(allowed_domains=frozenset(config.allowed_media_domains or ()),
                   allow_remote=config.allow_remote_media, local_root=Path(root).resolve() if root else None)

    def load(self, ref: ImageRef):
        """The PIL image ``ref`` names, its size checked (it is decoded when the processor reads it)."""
        from PIL import Image

        if isinstance(ref.source, Image.Image):
            return self._checked(ref.source, ref.param)
        url = ref.source
        scheme = urlparse(url).scheme.lower()
        if scheme == "data":
            data = self._data_url(url, ref.param)
        elif scheme in ("http", "https"):
            data = self._fetch(url, ref.param)
        elif scheme == "file" or url.startswith("/"):
            data = self._read_local(url, ref.param)
        else:
            raise part_error(ref.param, "an image URL is a data: URL, an http(s):// URL or a file:// URL")
        return self._decode(data, ref.param)

    def _data_url(self, url: str, param: str) -> bytes:
        header, comma, payload = url.partition(",")
        if not comma or not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
            raise part_error(param, "a data: URL image is data:image/<type>;base64,<data>")
        if len(payload) * 3 // 4 > self.max_bytes:
            raise self._too_large(param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise part_error(param, f"the data: URL is not valid base64: {e}") from e

    def _fetch(self, url: str, param: str) -> bytes:
        """The body of ``url``, from an allowed host only, no redirects (one could lead anywhere), at most
        ``max_bytes`` read, within ``timeout``."""
        import httpx

        host = urlparse(url).hostname or ""
        if not (self.allow_remote or host.lower() in self.allowed_domains):
            raise part_error(param, f"remote images are not allowed from {host!r} (the server's "
                                    "--allowed-media-domains or --allow-remote-media)")
        try:
            with httpx.stream("GET", url, timeout=self.timeout, follow_redirects=False) as response:
                if response.status_code != 200:
                    raise part_error(param, f"fetching the image gave HTTP {response.status_code}")
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise self._too_large(param)
                return bytes(body)
        except httpx.HTTPError as e:
            raise part_error(param, f"cannot fetch the image: {type(e).__name__}: {e}") from e

    def _read_local(self, url: str, param: str) -> bytes:
        """A file under ``local_root`` only (resolved, so neither ``..`` nor a link leads out of it)."""
        if self.local_root is None:
            raise part_error(param, "local images are not allowed (the server's --allowed-local-media-path)")
        path = Path(unquote(urlparse(url).path) if url.startswith("file:") else url).resolve()
        if not path.is_relative_to(self.local_root) or not path.is_file():
            raise part_error(param, f"no image file at {url!r} under the allowed local media path")
        if path.stat().st_size > self.max_bytes:
            raise self._too_large(param)
        return path.read_bytes()

    def _decode(self, data: bytes, param: str):
        from PIL import Image, UnidentifiedImageError

        if len(data) > self.max_bytes:
            raise self._too_large(param)
        try:
            image = Image.open(io.BytesIO(data))  # (reads the header only: the size is known before decoding)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise part_error(param, f"not an image PIL can read: {e}") from e
        self._checked(image, param)
        try:
            image.load()
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise part_error(param, f"the image cannot be decoded: {e}") from e
        return image

    def _checked(self, image, param: str):
        width, height = image.size
        if width * height > self.max_pixels:
            raise part_error(param, f"the image is {width}×{height} pixels: at most {self.max_pixels} in all")
        return image

    def _too_large(self, param: str) -> InvalidRequest:
        return part_error(param, f"the image is larger than {self.max_bytes} bytes")
