"""The Triton attention backend: K/V stored through the slot mapping, decodes by the flash-decoding
kernel, prefill chunks by the paged prefill kernel, straight from the pages (nothing gathered). The pages
may be FP8 (``--kv-cache-dtype fp8``): the kernels quantize on store and read through the layer's scales."""

from __future__ import annotations

import torch

from mili.kernels.triton.attention import paged_decode, paged_prefill, store_kv
from mili.model.batch import ForwardBatch


class TritonAttentionBackend:
    def __init__(self, max_pages_per_seq: int):
        self.max_pages_per_seq = max_pages_per_seq  # fixes the decode split count (CUDA graphs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        k_scale, v_scale = kv_scales
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        scale = q.shape[-1] ** -0.5
        nd = batch.num_decodes
        if nd == batch.num_seqs:
            return paged_decode(q, k_cache, v_cache, batch.page_table, batch.context_lens_t, scale,
                                self.max_pages_per_seq, k_scale, v_scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = paged_decode(q[:nd], k_cache, v_cache, batch.page_table[:nd], batch.context_lens_t[:nd],
                                    scale, self.max_pages_per_seq, k_scale, v_scale)
        prefill_lens = batch.query_lens[nd:]
        out[nd:] = paged_prefill(q[nd:], k_cache, v_cache, batch.page_table[nd:], batch.query_start_t[nd:] - nd,
                                 batch.query_lens_t[nd:], batch.context_lens_t[nd:], max(prefill_lens), scale,
                                 k_scale=k_scale, v_scale=v_scale)
        return out
