"""The CPU attention backend: the torch backend, with decodes attended by MILI's C kernel, which reads
each sequence's pages where they lie instead of gathering them into a padded copy every step, and
prefill chunks by MILI's causal kernel (torch's CPU flash attention reaches ~50 GFLOP/s in bf16 on a CPU
without AMX; the kernel runs both products on the linear layers' AVX-512 micro-kernel)."""

from __future__ import annotations

import torch

from mili.kernels.cpu import ops as cpu_ops
from mili.model.batch import ForwardBatch
from mili.runtime.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    """Pages head-major, [pages, Hkv, page_size, D]: a kv head's tokens of a page lie together, so the
    decode kernel reads them as one run (kernels.c). The pages are bf16 tensors, or with ``--kv-cache-dtype int8``
    ``Int8Pages`` (int8 values and a scale per token and kv head): the store quantizes, the decode kernel reads them
    as they are, and a prefill chunk attends over its context dequantized to bf16, its own K/V too (read back from
    the pages, so that a chunk sees the values its decodes will, whether or not a prefix was cached)."""

    _store = staticmethod(cpu_ops.store_kv)
    _gather = staticmethod(cpu_ops.gather_pages)

    @staticmethod
    def _attends_stored(k_cache) -> bool:
        return isinstance(k_cache, cpu_ops.Int8Pages)

    @staticmethod
    def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return num_pages, num_kv_heads, page_size, head_dim

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not cpu_ops.prefill_attention_supported(q, k, v):
            return TorchAttentionBackend._prefill(q, k, v)
        return cpu_ops.prefill_attention(q, k, v, q.shape[-1] ** -0.5)

    def _prefill_into(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not cpu_ops.prefill_attention_supported(q, k, v) or out.stride()[1:] != (q.shape[-1], 1):
            return super()._prefill_into(out, q, k, v)
        cpu_ops.prefill_attention(q, k, v, q.shape[-1] ** -0.5, out=out)  # (written in place: no copy of a chunk)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        if not cpu_ops.decode_attention_supported(q, k_cache):
            return super()._decode(q, k_cache, v_cache, batch)
        return cpu_ops.decode_attention(q, k_cache, v_cache, batch.page_table, batch.context_lens,
                                        q.shape[-1] ** -0.5)
