"""A request's images on the core's side, and a step's share of them (M-RoPE models: Qwen3-VL, Qwen3.5 / 3.6).

``RequestImages`` holds what every step of the request needs: the pixel rows (the vision tower runs over an image
at the first prefill chunk that reaches one of its tokens, unless the encoder cache has it), each image's run of
prompt tokens and pixel hash, the prompt's M-RoPE positions and decode delta, and the prompt as the prefix cache
keys it (each image's tokens replaced by an id from its pixels' hash: two different images never share K/V).

``StepImages`` gathers a step's rows: each sequence's chunk positions ([3, n] where the request has images) and the
images its chunk reaches. It then takes their tower outputs from the encoder cache (runtime/encoder_cache.py),
runs the tower once over the missing ones (distinct hashes only, grouped up to the tokens one call may take), and
slices each chunk's share of rows into one ForwardBatch's ``images``. An image a chunk leaves unfinished stays
claimed in the cache for the next chunk; the claim goes when its last token is computed or the request ends. A step
none of whose tokens is an image token passes [T] positions (every axis equal there: text and decodes sit at
index + delta), the text path's cost; a step with no request with images builds no StepImages at all.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from mili.errors import InvalidRequest

from mili.model.batch import ImageRows
from mili.model.mrope import rope_index
from mili.runtime.encoder_cache import EncodedImage, EncoderCache


@dataclass(eq=False)
class RequestImages:
    pixel_values: torch.Tensor  # [patches, patch_dim] float32, the images' patches in order
    grid_thw: list[tuple[int, int, int]]
    hashes: list[int]  # each image's pixel hash (the encoder cache's key)
    spans: list[tuple[int, int]]  # each image's prompt tokens: [start, end)
    patch_starts: list[int]  # each image's first row of pixel_values, and the total last
    positions: torch.Tensor  # [3, prompt_len]
    delta: int  # a token past the prompt at index i sits at i + delta on every axis
    cache_ids: list[int]  # the prompt as the prefix cache keys it

    @classmethod
    def build(cls, prompt: list[int], pixel_bytes: bytes, patch_dim: int, grid_thw: list, hashes: list[int],
              image_token_id: int, merge: int) -> "RequestImages":
        pixels = torch.from_numpy(np.frombuffer(pixel_bytes, dtype=np.float32).reshape(-1, patch_dim).copy())
        grids = [tuple(g) for g in grid_thw]
        positions, delta = rope_index(prompt, grids, image_token_id, merge)
        keys, spans, k = list(prompt), [], 0
        for (t, h, w), digest in zip(grids, hashes):  # each image's run of tokens, in order
            k = keys.index(image_token_id, k)
            n = t * h * w // merge ** 2
            keys[k:k + n] = [-1 - digest] * n  # (negative: never a token id)
            spans.append((k, k + n))
            k += n
        patch_starts = list(itertools.accumulate((t * h * w for t, h, w in grids), initial=0))
        return cls(pixel_values=pixels, grid_thw=grids, hashes=list(hashes), spans=spans, patch_starts=patch_starts,
                   positions=positions, delta=delta, cache_ids=keys)

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens start .. end - 1 (the prompt's, then index + delta)."""
        prompt = self.positions.shape[1]
        tail = torch.arange(max(start, prompt), max(end, prompt)) + self.delta
        return torch.cat([self.positions[:, start:min(end, prompt)], tail.expand(3, -1)], dim=1)

    def reached(self, start: int, end: int) -> list[int]:
        """The images some of whose tokens are among start .. end - 1."""
        return [i for i, (a, b) in enumerate(self.spans) if a < end and start < b]

    def pixels(self, index: int) -> torch.Tensor:
        return self.pixel_values[self.patch_starts[index]:self.patch_starts[index + 1]]


@dataclass
class _Reach:
    """A chunk's share of one image: the request's ``index``-th image, its tokens first .. last - 1 of the prompt
    at the step's rows from ``row``."""

    images: RequestImages
    index: int
    first: int
    last: int
    row: int


class StepImages:
    """A step's M-RoPE positions and image rows, sequence by sequence (in the batch's row order)."""

    def __init__(self, model, cache: EncoderCache, tokens_per_call: int):
        self.model, self.cache, self.tokens_per_call = model, cache, tokens_per_call
        self.positions: list[torch.Tensor] = []
        self.reaches: list[_Reach] = []

    def add(self, images: RequestImages | None, start: int, n: int, first_row: int) -> None:
        """Sequence tokens start .. start + n - 1 at batch rows first_row ..; ``images``: its request's (or None)."""
        if images is None:
            self.positions.append(torch.arange(start, start + n).expand(3, -1))
            return
        self.positions.append(images.rope_positions(start, start + n))
        for i in images.reached(start, start + n):
            a, b = images.spans[i]
            first, last = max(a, start), min(b, start + n)
            self.reaches.append(_Reach(images, i, first, last, first_row + first - start))

    def batch_fields(self, device: torch.device) -> tuple[torch.Tensor, ImageRows | None]:
        """(positions: [3, T] when a row is an image token, else [T]; the step's ImageRows or None)."""
        positions = torch.cat(self.positions, dim=1)
        if not self.reaches:
            return positions[0].to(device), None
        outputs = self._tower_outputs()
        rows, embeds, deepstack = [], [], []
        for r in self.reaches:
            out, offset = outputs[r.images.hashes[r.index]], r.images.spans[r.index][0]
            rows.append(torch.arange(r.row, r.row + r.last - r.first))
            embeds.append(out.embeds[r.first - offset:r.last - offset])
            deepstack.append([d[r.first - offset:r.last - offset] for d in out.deepstack])
        return positions.to(device), ImageRows(torch.cat(rows).to(device), torch.cat(embeds),
                                               [torch.cat(d) for d in zip(*deepstack)])

    def _tower_outputs(self) -> dict[int, EncodedImage]:
        """The step's images' tower outputs by hash: the cache's, the rest made now. An image a chunk leaves
        unfinished is claimed first (what this step adds never evicts it: the next chunk needs it); one a chunk
        finishes is released last (after this step has taken it)."""
        unfinished = [r.last < r.images.spans[r.index][1] for r in self.reaches]
        for r, claim in zip(self.reaches, unfinished):
            if claim:
                self.cache.claim(r.images.hashes[r.index], r.images, r.index)
        outputs, missing = {}, {}
        for r in self.reaches:
            digest = r.images.hashes[r.index]
            if digest not in outputs and digest not in missing:
                entry = self.cache.get(digest)
                if entry is None:
                    missing[digest] = r
                else:
                    outputs[digest] = entry
        for group in self._calls(list(missing.items())):
            outputs.update(self._encode(group))
        for r, claim in zip(self.reaches, unfinished):
            if not claim:
                self.cache.release(r.images.hashes[r.index], r.images, r.index)
        return outputs

    def _calls(self, missing: list[tuple[int, _Reach]]) -> list[list[tuple[int, _Reach]]]:
        """The missing images in tower calls of at most ``tokens_per_call`` tokens (a larger image alone)."""
        calls, tokens = [], self.tokens_per_call
        for item in missing:
            a, b = item[1].images.spans[item[1].index]
            if not calls or tokens + b - a > self.tokens_per_call:
                calls.append([])
                tokens = 0
            calls[-1].append(item)
            tokens += b - a
        return calls

    def _encode(self, group: list[tuple[int, _Reach]]) -> dict[int, EncodedImage]:
        """One tower call over ``group``'s images; each output goes into the cache by its hash."""
        pixels = torch.cat([r.images.pixels(r.index) for _, r in group])
        vision = self.model.encode_images(pixels, [r.images.grid_thw[r.index] for _, r in group])
        out, start = {}, 0
        own = len(group) > 1  # (each image's rows copied out of a shared output: evicting one frees its memory)
        for (digest, _), n in zip(group, vision.tokens_per_image):
            rows = [t[start:start + n] for t in [vision.embeds, *vision.deepstack]]
            rows = [t.clone() for t in rows] if own else rows
            entry = EncodedImage(embeds=rows[0], deepstack=rows[1:])
            self.cache.put(digest, entry)
            out[digest] = entry
            start += n
        return out


def request_images(model, config, model_config, prompt: list[int], images) -> RequestImages:
    """A request's images (an engine ``ImageInput``) as its steps take them; refused without a vision tower."""
    if getattr(model, "visual", None) is None:
        raise InvalidRequest("this model takes no images (a text-only checkpoint, language_model_only, or "
                             "tensor parallelism)", param="multi_modal_data")
    limit = config.limit_mm_per_prompt["image"]
    if len(images.grid_thw) > limit:
        raise InvalidRequest(f"the prompt has {len(images.grid_thw)} images; at most {limit} are allowed "
                             f"(limit_mm_per_prompt)", param="multi_modal_data")
    merge = model_config.vision_config.spatial_merge_size
    return RequestImages.build(prompt, images.pixel_values, images.patch_dim, images.grid_thw, images.hashes,
                               model_config.image_token_id, merge)
