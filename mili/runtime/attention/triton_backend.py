"""The Triton attention backend: K/V stored through the slot mapping; a step of decodes alone by the flash-decoding
kernel (each context split across programs), a step with prefill chunks by the one kernel over all its rows
(``varlen_attention.py``, which CUDA graphs of mixed steps replay), straight from the pages (nothing gathered). The pages
may be FP8 (``--kv-cache-dtype fp8``): the kernels quantize on store and read through the layer's scales.

Qwen3's attention stores K/V in the launch that norms and rotates q and k (``qk_norm_rope_store``), then calls
``forward(..., stored=True)``: one kernel where the norm + RoPE and the store were two (three with q apart)."""

from __future__ import annotations

import bisect

import torch

from mili.kernels.triton.attention import paged_decode, store_kv
from mili.kernels.triton.ops import TritonOps
from mili.kernels.triton.varlen_attention import paged_attention_varlen
from mili.model.batch import ForwardBatch


class TritonAttentionBackend:
    def __init__(self, max_pages_per_seq: int):
        self.max_pages_per_seq = max_pages_per_seq  # fixes the decode split count (CUDA graphs)
        # the decode batch sizes CUDA graphs capture (the runner's): an eager decode batch is split as the graph of its
        # padded size would be, so the eager and graph steps compute the same values
        self.graph_sizes: tuple[int, ...] = ()

    def _split_batch(self, n: int) -> int:
        i = bisect.bisect_left(self.graph_sizes, n)
        return self.graph_sizes[i] if i < len(self.graph_sizes) else n

    @staticmethod
    def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, eps: float, cos_sin: tuple[torch.Tensor, torch.Tensor],
                           k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                           kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """q/k-norm + RoPE with this step's K/V store, in one launch: returns q normed and rotated; k (normed and
        rotated) and v are in the pages after, as ``forward`` would have stored them (``forward(..., stored=True)``
        then attends)."""
        return TritonOps.qk_norm_rope_store(q, k, v, q_weight, k_weight, eps, *cos_sin, k_cache, v_cache,
                                            batch.slot_mapping, *kv_scales)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                kv_scales: tuple[float, float] = (1.0, 1.0), stored: bool = False) -> torch.Tensor:
        """``stored``: this step's K/V are in the pages already (``qk_norm_rope_store``; k and v unused)."""
        k_scale, v_scale = kv_scales
        if not stored:
            store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        scale = q.shape[-1] ** -0.5
        if batch.varlen:  # a step in a CUDA graph: its static buffers, padded; no length read on the host
            return paged_attention_varlen(q, k_cache, v_cache, batch.page_table, batch.query_start_t,
                                          batch.query_lens_t, batch.context_lens_t, scale, k_scale, v_scale)
        if batch.num_decodes == batch.num_seqs:  # decodes alone: each context split across programs
            return paged_decode(q, k_cache, v_cache, batch.page_table, batch.context_lens_t, scale,
                                self.max_pages_per_seq, k_scale, v_scale, self._split_batch(q.shape[0]))
        # a step with prefill chunks: one kernel over its decodes and chunks (what its CUDA graph runs too)
        return paged_attention_varlen(q, k_cache, v_cache, batch.page_table, batch.query_start_t,
                                      batch.query_lens_t, batch.context_lens_t, scale, k_scale, v_scale,
                                      out=torch.empty_like(q))
