"""The attention backend protocol and the batch metadata every forward pass carries explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class ImageRows:
    """The image tokens among a step's rows (M-RoPE models): their embeddings from the vision tower, which
    replace the image-pad token's, and per DeepStack layer the features added to the hidden states there after
    that decoder layer (Qwen3-VL's first ``len(deepstack)`` layers; none for Qwen3.5)."""

    rows: torch.Tensor  # [N] rows of the step's T tokens
    embeds: torch.Tensor  # [N, hidden]
    deepstack: list[torch.Tensor]  # each [N, hidden]


@dataclass
class ForwardBatch:
    """One forward pass over a mixed batch: decodes first (one query token each), then prefill chunks.

    Sequence ``i`` contributes ``query_lens[i]`` new tokens at positions
    ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``; after this step its KV cache holds
    ``context_lens[i]`` tokens, laid out over the pages ``page_table[i, :]``.
    """

    input_ids: torch.Tensor  # [T] token ids of the new tokens, all sequences concatenated
    positions: torch.Tensor  # [T], or [3, T] (time, height, width) for an M-RoPE model's batch with images
    slot_mapping: torch.Tensor  # [T] flat slot (page * page_size + offset) where each new K/V goes
    page_table: torch.Tensor  # [B, max_pages] page ids per sequence (padded with 0)
    query_lens: list[int]  # [B]
    context_lens: list[int]  # [B]
    num_decodes: int  # sequences 0 .. num_decodes-1 have query_len 1
    logits_indices: torch.Tensor  # [S] rows of the T tokens whose logits are needed (final hidden states)
    # The same lengths as device tensors, for kernels (int32): [B] each; query_start_t[b] = sum of
    # query_lens[:b]
    context_lens_t: torch.Tensor | None = None
    query_lens_t: torch.Tensor | None = None
    query_start_t: torch.Tensor | None = None
    # prompt logprobs: the last num_prompt_rows of logits_indices (after the sampling rows) are prompt
    # positions whose logits score the next prompt token (see runtime/prompt_logprobs.py)
    num_prompt_rows: int = 0
    # pooling requests (embeddings, scores): the num_pool_rows rows of logits_indices after the sampling rows are
    # their last tokens, pooled as ``pooling`` says (mili.sampling_params.PoolingParams, one a row)
    num_pool_rows: int = 0
    pooling: list | None = None
    # hybrid models: each sequence's recurrent-state slot in the runner's state pool ([B], None otherwise)
    state_slots: list[int] | None = None
    # M-RoPE models: the step's image tokens and what replaces their embeddings (None: no image token this step)
    images: ImageRows | None = None
    # a mixed step replayed as a CUDA graph (runtime/cuda_graph.py): the tensors are the graph's static buffers, padded
    # (sequences of no token, tokens of none), and the host lists above are not the step's: attention runs the
    # one kernel over decodes and chunks whose launch reads no length (kernels/triton/varlen_attention.py)
    varlen: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged pool and attends over each sequence's pages. The pool's
    layout is the backend's: ``kv_cache_shape`` where it has one (the CPU backend's pages are head-major,
    [num_pages, Hkv, page_size, D]), else [num_pages, page_size, Hkv, D]. A backend may also offer
    ``qk_norm_rope_store`` (the Triton one: Qwen3's q/k-norm + RoPE and the K/V store in one kernel), after which
    its ``forward(..., stored=True)`` attends without storing."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D], caches: the backend's page layout -> [T, Hq, D]. ``kv_scales``:
        the layer's K and V scales for FP8 pages (stored as k / k_scale; backends without FP8 pages ignore
        them)."""
        ...
