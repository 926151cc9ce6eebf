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


def kv_head_range(total_kv: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) of a rank: an even split, or one replicated head when heads < ranks."""
    if size <= total_kv:
        return shard_range(total_kv, rank, size)
    return rank * total_kv // size, 1
