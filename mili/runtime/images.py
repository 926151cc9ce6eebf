"""A request's images on the core's side, and a step's share of them (M-RoPE models: Qwen3-VL, Qwen3.5 / 3.6).

``RequestImages`` holds what every step of the request needs: the pixel rows (the vision tower runs over them at
the first prefill chunk that reaches an image token, and its output is kept while the prompt prefills, chunk by
chunk; it is dropped once the prompt is computed, and made again if a preemption has the prompt recomputed),
the prompt's M-RoPE
positions and decode delta, which prompt tokens are image tokens, and the prompt as the prefix cache keys it
(each image's tokens replaced by an id from its pixels' hash: two different images never share K/V).

``StepImages`` gathers a step's rows: each sequence's chunk positions ([3, n] where the request has images) and
image rows, into one ForwardBatch's ``positions`` and ``images``. A step none of whose tokens is an image token
passes [T] positions (every axis equal there: text and decodes sit at index + delta), the text path's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mili.model.batch import ImageRows
from mili.model.mrope import rope_index
from mili.model.vision import VisionOutput, chunk_image_rows


@dataclass(eq=False)
class RequestImages:
    pixel_values: torch.Tensor  # [patches, patch_dim] float32
    grid_thw: list[tuple[int, int, int]]
    positions: torch.Tensor  # [3, prompt_len]
    delta: int  # a token past the prompt at index i sits at i + delta on every axis
    is_image: torch.Tensor  # [prompt_len] bool
    cache_ids: list[int]  # the prompt as the prefix cache keys it
    vision: VisionOutput | None = None

    @classmethod
    def build(cls, prompt: list[int], pixel_bytes: bytes, patch_dim: int, grid_thw: list, hashes: list[int],
              image_token_id: int, merge: int) -> "RequestImages":
        pixels = torch.from_numpy(np.frombuffer(pixel_bytes, dtype=np.float32).reshape(-1, patch_dim).copy())
        grids = [tuple(g) for g in grid_thw]
        positions, delta = rope_index(prompt, grids, image_token_id, merge)
        keys, k = list(prompt), 0
        for (t, h, w), digest in zip(grids, hashes):  # each image's run of tokens, in order
            k = keys.index(image_token_id, k)
            n = t * h * w // merge ** 2
            keys[k:k + n] = [-1 - digest] * n  # (negative: never a token id)
            k += n
        return cls(pixels, grids, positions, delta, torch.tensor(prompt) == image_token_id, keys)

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens start .. end - 1 (the prompt's, then index + delta)."""
        prompt = self.positions.shape[1]
        tail = torch.arange(max(start, prompt), max(end, prompt)) + self.delta
        return torch.cat([self.positions[:, start:min(end, prompt)], tail.expand(3, -1)], dim=1)


class StepImages:
    """A step's M-RoPE positions and image rows, sequence by sequence (in the batch's row order)."""

    def __init__(self, model):
        self.model = model
        self.positions: list[torch.Tensor] = []
        self.rows: list[ImageRows] = []
        self.any_image = False

    def add(self, images: RequestImages | None, start: int, n: int, first_row: int) -> None:
        """Sequence tokens start .. start + n - 1 at batch rows first_row ..; ``images``: its request's (or None)."""
        if images is None:
            self.positions.append(torch.arange(start, start + n).expand(3, -1))
            return
        self.positions.append(images.rope_positions(start, start + n))
        end = min(start + n, images.is_image.shape[0])
        if start < end and bool(images.is_image[start:end].any()):
            if images.vision is None:
                images.vision = self.model.encode_images(images.pixel_values, images.grid_thw)
            part = chunk_image_rows(images.is_image, images.vision, start, end)
            self.rows.append(ImageRows(part.rows + first_row, part.embeds, part.deepstack))
            self.any_image = True

    def batch_fields(self, device: torch.device) -> tuple[torch.Tensor, ImageRows | None]:
        """(positions: [3, T] when a row is an image token, else [T]; the step's ImageRows or None)."""
        positions = torch.cat(self.positions, dim=1)
        if not self.any_image:
            return positions[0].to(device), None
        rows = ImageRows(torch.cat([r.rows for r in self.rows]).to(device), torch.cat([r.embeds for r in self.rows]),
                         [torch.cat(d) for d in zip(*(r.deepstack for r in self.rows))])
        return positions.to(device), rows
