"""The torch attention backend: paged attention with torch ops (the CPU path, and a reference).

Decodes are attended together (their pages gathered into one padded tensor, masked by length);
each prefill chunk is attended on its own, over its cached prefix plus the chunk, causally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mili.kernels.reference import store_kv
from mili.model.batch import ForwardBatch


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` cached entries of each row of ``page_table``: [B, num_tokens, H, D]."""
    num_pages = -(-num_tokens // cache.shape[1])
    ids = page_table[:, :num_pages].reshape(-1)
    # index_select on a 2-D view: ~5x faster on the CPU than advanced indexing cache[page_table]
    pages = cache.view(cache.shape[0], -1).index_select(0, ids)
    return pages.view(page_table.shape[0], num_pages * cache.shape[1], *cache.shape[2:])[:, :num_tokens]


class TorchAttentionBackend:
    # the pool's pages: [pages, page_size, Hkv, D] (a backend may lay them out otherwise: kv_cache_shape,
    # with its own _store and _gather)
    _store = staticmethod(store_kv)
    _gather = staticmethod(gather_pages)

    @staticmethod
    def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return num_pages, page_size, num_kv_heads, head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, batch.slot_mapping)
        out = torch.empty_like(q)
        nd = batch.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, batch)
        start = nd
        for i in range(nd, batch.num_seqs):
            qlen, ctx = batch.query_lens[i], batch.context_lens[i]
            end = start + qlen
            if ctx == qlen and not self._attends_stored(k_cache):  # no cached prefix: the chunk's own K/V
                ks, vs = k[start:end], v[start:end]
            else:
                table = batch.page_table[i:i + 1]
                ks = self._gather(k_cache, table, ctx)[0]
                vs = self._gather(v_cache, table, ctx)[0]
            self._prefill_into(out[start:end], q[start:end], ks, vs)
            start = end
        return out

    @staticmethod
    def _attends_stored(k_cache) -> bool:
        """Whether a chunk without a cached prefix still attends over its K/V as stored (read back from the pages,
        where storing changes them: int8 pages) rather than as computed."""
        return False

    def _prefill_into(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``_prefill``'s result written into ``out`` [Lq, Hq, D] (a back-end whose kernel writes there itself
        saves the copy)."""
        out.copy_(self._prefill(q, k, v))

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [Lq, Hq, D] are the last Lq of the Lk positions in k/v: [Lk, Hkv, D]."""
        lq, lk = q.shape[0], k.shape[0]
        if lq == lk:
            mask, causal = None, True
        else:  # query j sits at position lk - lq + j and sees keys 0 .. lk - lq + j
            rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            mask, causal = torch.arange(lk, device=q.device)[None, :] <= rows, False
        # 4-D inputs: on the CPU, SDPA takes its flash kernel only for [B, H, L, D] (3-D falls back to
        # the ~10x slower math path)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        nd = q.shape[0]
        ctx = torch.tensor(batch.context_lens[:nd], device=q.device)
        max_len = max(batch.context_lens[:nd])
        table = batch.page_table[:nd]
        ks = self._gather(k_cache, table, max_len).transpose(1, 2)  # [B, Hkv, L, D]
        vs = self._gather(v_cache, table, max_len).transpose(1, 2)
        mask = (torch.arange(max_len, device=q.device)[None, :] < ctx[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(q[:, :, None, :], ks, vs, attn_mask=mask, enable_gqa=True)
        return o[:, :, 0, :]
