"""Large zeroed pools in the host's memory (the CPU's KV pages) at no start-up cost. ``torch.zeros`` writes every
byte: for the CPU's default 2 GiB KV pool that is ~0.5 s of page faults and stores at every engine's start, and all
of it resident before a request comes. An anonymous mapping is zero by definition (POSIX) and the kernel backs each
page only when it is first written, so a pool costs memory as sequences fill it, as llama.cpp's mapped buffers do.

The mapping is private and, on Linux, advised for transparent huge pages (``MADV_HUGEPAGE``; it takes effect where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``): a decode step reads every page of its
context, and on 4 KiB pages each 4 KiB costs a TLB miss (a nested page walk in a VM). On a Zen 4 VM the int8 pages'
attention after 16k tokens ran 1.09x as fast on 2 MiB pages (benchmarks/README.md). Python's default, a shared
mapping, is shmem, which gets no huge pages unless the machine's ``shmem_enabled`` says so."""

from __future__ import annotations

import math
import mmap

import torch

_MAPPED_FROM = 1 << 20  # bytes: smaller pools come from torch's allocator, zeroed as usual


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU, past 1 MiB, over a private anonymous mapping
    advised for huge pages (4 KiB-aligned; the tensor holds the mapping, unmapped once the last view of it is gone)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MAPPED_FROM:
        return torch.zeros(shape, dtype=dtype, device=device)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapping = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
