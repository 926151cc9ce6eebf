"""The collectives and shard arithmetic of tensor parallelism, as the model and the loader call them (below
every other part of MILI: it imports none of it). Processes and groups: runtime/parallel.py."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (vocabulary shards of logits)."""
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of rank's even share of ``total``."""
    part = total // size
    return rank * part, part


def vocab_shard(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, rows) of rank's share of a vocabulary-parallel table (the embedding, the lm_head): the
    vocabulary padded up to a multiple of ``size`` so a vocabulary that does not divide (a fine-tune resized
    to len(tokenizer), 151,669 rows) still splits evenly. As in vLLM's VocabParallelEmbedding, the padded
    rows (here at the end of the last rank) are zeros no id looks up, and their logits are cut
    (``gather_logits``); vLLM also rounds the table to 64 rows, which MILI does not need."""
    part = -(-vocab // size)
    return rank * part, part


def gather_logits(logits: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """Every rank's vocabulary shard of ``logits`` joined, cut to the real vocabulary (no padded row is
    ever sampled)."""
    if size == 1:
        return logits
    full = all_gather_last(logits, size)
    return full[..., :vocab] if full.shape[-1] != vocab else full


def kv_head_range(total_kv: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) of a rank: an even split, or one replicated head when heads < ranks."""
    if size <= total_kv:
        return shard_range(total_kv, rank, size)
    return rank * total_kv // size, 1
