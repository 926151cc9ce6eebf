"""Large zeroed pools in the host's memory (the CPU's KV pages) at no start-up cost. ``torch.zeros`` writes every
byte: for the CPU's default 2 GiB KV pool that is ~0.5 s of page faults and stores at every engine's start, and all
of it resident before a request comes. An anonymous mapping is zero by definition (POSIX) and the kernel backs each
page only when it is first written, so a pool costs memory as sequences fill it, as llama.cpp's mapped buffers do."""

from __future__ import annotations

import math
import mmap

import torch

_MAPPED_FROM = 1 << 20  # bytes: smaller pools come from torch's allocator, zeroed as usual


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU, past 1 MiB, over an anonymous mapping (its pages
    4 KiB-aligned; the tensor holds the mapping, unmapped once the last view of it is gone)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MAPPED_FROM:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
