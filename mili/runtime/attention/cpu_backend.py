"""The CPU attention backend: the torch backend, with decodes attended by MILI's C kernel, which reads
each sequence's pages where they lie instead of gathering them into a padded copy every step, and
prefill chunks by MILI's causal kernel (torch's CPU flash attention reaches ~50 GFLOP/s in bf16 on a CPU
without AMX; the kernel runs both products on the linear layers' AVX-512 micro-kernel)."""

from __future__ import annotations

import torch

from mili.kernels.cpu import ops as cpu_ops
from mili.runtime.attention.base import ForwardBatch
from mili.runtime.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not cpu_ops.prefill_attention_supported(q, k, v):
            return TorchAttentionBackend._prefill(q, k, v)
        return cpu_ops.prefill_attention(q, k, v, q.shape[-1] ** -0.5)

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        if not cpu_ops.decode_attention_supported(q, k_cache):
            return TorchAttentionBackend._decode(q, k_cache, v_cache, batch)
        return cpu_ops.decode_attention(q, k_cache, v_cache, batch.page_table, batch.context_lens,
                                        q.shape[-1] ** -0.5)
