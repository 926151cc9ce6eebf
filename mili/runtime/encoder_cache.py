"""The vision tower's outputs kept by image content, and the tower's memory budget (M-RoPE models with a tower).

``EncoderCache`` keeps each image's tower output (its merged embeddings and DeepStack features) under the image's
pixel hash, so that the tower runs once per distinct image while the output is of use: across the chunks of a
prefill that cuts through the image, across requests that carry the same image after different text (a prefix
cache miss), and across a preemption that has a prompt recomputed. Its budget is in image tokens (rows of the
language model's width, as vLLM's ``encoder_cache_size``); past it the least recently used entries go.

Invariants (``check_integrity``): ``num_tokens`` is the entries' token count; an image some request has begun but
not finished computing is *claimed* and never evicted (its next chunk needs it), so the entries go past the budget
only by claimed ones; a claim belongs to a live request (dropped when its image is computed, or the request ends).

``VisionBudget`` says how large an image may be and how much memory the tower takes at start-up: the image
processor's largest image in tokens, the tokens one tower call may take (vLLM's rule: the largest of
max_num_batched_tokens and one largest image, in whole images, at most ``limit_mm_per_prompt`` of them), the
cache's budget, and an estimate of the bytes the tower's activations and the cache take, which the CUDA path
takes out of the KV pool's share of the card (the CPU's pool is a fixed size: there it is checked against the
memory available, with a warning).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("mili")

# transformers' Qwen2-VL image processor's default largest image (its ``size.longest_edge``, in pixels)
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass
class EncodedImage:
    """One image's tower output: ``embeds`` [tokens, hidden] and one such tensor per DeepStack layer."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]


class EncoderCache:
    """Tower outputs by pixel hash in LRU order, bounded by ``budget_tokens`` (past it, unclaimed entries go)."""

    def __init__(self, budget_tokens: int):
        self.budget_tokens = budget_tokens
        self.entries: OrderedDict[int, EncodedImage] = OrderedDict()  # least recently used first
        self.claims: dict[int, set] = {}  # pixel hash -> {(owner, image index)} that have begun but not finished it
        self.num_tokens = 0
        self.num_hits = self.num_misses = self.num_evictions = 0

    def get(self, digest: int) -> EncodedImage | None:
        entry = self.entries.get(digest)
        if entry is None:
            self.num_misses += 1
            return None
        self.entries.move_to_end(digest)
        self.num_hits += 1
        return entry

    def put(self, digest: int, entry: EncodedImage) -> None:
        if digest in self.entries:
            self.num_tokens -= self.entries.pop(digest).num_tokens
        self.entries[digest] = entry
        self.num_tokens += entry.num_tokens
        self._evict()

    def claim(self, digest: int, owner, index: int) -> None:
        """``owner``'s image ``index`` (that hash) is computed in part: keep it until ``release``."""
        self.claims.setdefault(digest, set()).add((owner, index))

    def release(self, digest: int, owner, index: int) -> None:
        holders = self.claims.get(digest)
        if holders is not None:
            holders.discard((owner, index))
            if not holders:
                del self.claims[digest]
        self._evict()

    def release_all(self, owner) -> None:
        """Drop every claim of ``owner`` (its request ended)."""
        for digest in [d for d, holders in self.claims.items() if any(o is owner for o, _ in holders)]:
            for claim in [c for c in self.claims[digest] if c[0] is owner]:
                self.release(digest, *claim)

    def _evict(self) -> None:
        """Least recently used first, skipping claimed entries, until the entries fit the budget."""
        for digest in list(self.entries):
            if self.num_tokens <= self.budget_tokens:
                return
            if digest not in self.claims:
                self.num_tokens -= self.entries.pop(digest).num_tokens
                self.num_evictions += 1

    def check_integrity(self, alive) -> None:
        """``alive(owner)``: whether a claim's owner (a request's images) still belongs to a live request."""
        assert self.num_tokens == sum(e.num_tokens for e in self.entries.values()), "token count off"
        unclaimed = sum(e.num_tokens for d, e in self.entries.items() if d not in self.claims)
        assert unclaimed == 0 or self.num_tokens <= self.budget_tokens, "over budget with unclaimed entries"
        assert all(alive(owner) for holders in self.claims.values() for owner, _ in holders), "a claim leaked"


@dataclass
class VisionBudget:
    """How large an image may get and what the tower's memory is (see the module's docstring)."""

    max_image_tokens: int  # the image processor's largest image, in the language model's tokens
    tokens_per_call: int  # the most image tokens one tower call takes (images are grouped up to it)
    cache_tokens: int  # the encoder cache's budget
    reserve_bytes: int  # the tower's activation peak at tokens_per_call + a full cache (estimated)

    @classmethod
    def plan(cls, config, model_config, model_path: str, dtype: torch.dtype, max_model_len: int) -> "VisionBudget":
        vision = model_config.vision_config
        per_token = vision.patch_size ** 2 * vision.spatial_merge_size ** 2  # pixels a token covers
        max_image = min(max(1, processor_max_pixels(model_path) // per_token), max_model_len)
        limit = config.limit_mm_per_prompt["image"]
        per_call = max_image * max(1, min(limit, max(config.max_num_batched_tokens, max_image) // max_image))
        cache = config.encoder_cache_tokens
        if cache is None:
            cache = max(config.max_num_batched_tokens, max_image)
        tower = tower_activation_bytes(vision, per_call * vision.spatial_merge_size ** 2, dtype)
        return cls(max_image, per_call, cache, tower + cache * output_bytes_per_token(vision, dtype))

    def check_host_memory(self, pool_bytes: int) -> None:
        """The CPU: warn when the KV pool and the tower's planned memory exceed the memory available now (after the
        weights), since the pool is a fixed size there and the tower's memory comes on top of it."""
        available = available_host_memory()
        if available is not None and pool_bytes + self.reserve_bytes > available:
            log.warning("the KV pool (%.0f MiB) and the vision tower's planned activations and cache (%.0f MiB) "
                        "exceed the memory available (%.0f MiB): lower kv_cache_memory, the processor's max_pixels "
                        "or limit_mm_per_prompt", pool_bytes / 2**20, self.reserve_bytes / 2**20, available / 2**20)

    def describe(self) -> str:
        return (f"images up to {self.max_image_tokens} tokens, {self.tokens_per_call} tokens a tower call, encoder "
                f"cache {self.cache_tokens} tokens; {self.reserve_bytes / 2**20:.0f} MiB for its activations and the "
                f"cache (taken from the KV budget on CUDA; beside the fixed pool on the CPU)")


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def processor_max_pixels(model_path: str) -> int:
    """The largest image the checkpoint's image processor makes (pixels, after its resize): ``size.longest_edge``
    (transformers 5's spelling) or ``max_pixels``; the processor's default where neither is given."""
    file = Path(model_path) / "preprocessor_config.json"
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_PIXELS
    size = cfg.get("size") or {}
    return int(size.get("longest_edge") or size.get("max_pixels") or cfg.get("max_pixels") or DEFAULT_MAX_PIXELS)


def output_bytes_per_token(vision, dtype: torch.dtype) -> int:
    """An image token's tower output: its embedding and one feature per DeepStack layer, language-model wide."""
    layers = 1 + len(getattr(vision, "deepstack_visual_indexes", None) or [])
    return layers * vision.out_hidden_size * dtype.itemsize


def tower_activation_bytes(vision, patches: int, dtype: torch.dtype) -> int:
    """An estimate of the tower's peak above its weights over ``patches`` patches: per patch, the MLP's two
    intermediate tensors and four hidden-wide ones in the model's dtype (the residual, a norm's output, the layer's
    in and out), four float32 hidden-wide rotary temporaries (q, k and their rotations in float32), and the float32
    pixel row (attention itself is flash-style on the CPU and CUDA: no patches² matrix)."""
    hidden, inter = vision.hidden_size, vision.intermediate_size
    pixel_row = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return patches * (dtype.itemsize * (2 * inter + 4 * hidden) + 4 * 4 * hidden + 4 * pixel_row)
