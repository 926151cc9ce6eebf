"""mili.host_memory.zeros: the CPU's KV pages and recurrent states as zeros that cost nothing until written."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from mili import host_memory


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_zeros_are_torch_zeros_and_writable(dtype):
    shape = (64, 16, 8, 128)  # past 1 MiB: mapped
    got = host_memory.zeros(shape, dtype)
    assert got.shape == shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, torch.zeros(shape, dtype=dtype)) and got.data_ptr() % 4096 == 0
    got[3, 1, 2] = 7
    assert int((got != 0).sum()) == 128 and torch.equal(got[3, 1, 2], torch.full((128,), 7, dtype=dtype))
    small = host_memory.zeros((4, 8), dtype)  # (torch's allocator below 1 MiB)
    assert torch.equal(small, torch.zeros(4, 8, dtype=dtype))


def test_a_pool_is_resident_only_where_written():
    """256 MiB of pool add almost nothing to the process's resident memory until written (torch.zeros would add all
    256), and a view outlives the pool's own name (the mapping goes with its last view)."""
    gc.collect()
    before = _resident_bytes()
    pool = host_memory.zeros((256, 1 << 20), torch.uint8)
    assert _resident_bytes() - before < 16 << 20
    pool[:8] = 1  # 8 MiB written
    assert 8 << 20 <= _resident_bytes() - before < 24 << 20
    view = pool[4:6]
    del pool
    gc.collect()
    assert int(view.sum()) == 2 << 20  # still mapped
    view += 1
    assert int(view[0, 0]) == 2


def _smaps_of(address: int) -> dict[str, str]:
    """This process's /proc/self/smaps fields for the mapping that holds ``address``."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            fields[head.rstrip(":")] = line.split(None, 1)[1] if " " in line.strip() else ""
    return fields


def test_a_pool_is_advised_for_huge_pages():
    """The mapping is private (not shmem, which gets no huge pages by default) and advised MADV_HUGEPAGE: the kernel
    marks it eligible (THPeligible 1) wherever transparent huge pages are on at all (``madvise`` or ``always``), and
    where they are off it is the machine's choice (THPeligible 0)."""
    pool = host_memory.zeros((64, 1 << 20), torch.uint8)
    pool[:16] = 1
    fields = _smaps_of(pool.data_ptr())
    assert "hg" in fields["VmFlags"].split() and "sh" not in fields["VmFlags"].split(), fields["VmFlags"]
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    assert fields["THPeligible"].strip() == ("0" if "[never]" in enabled else "1"), (enabled, fields)


def test_other_devices_get_torch_zeros():
    """Off the CPU (a GPU's pools; the meta device here) the pool is torch.zeros' own, past 1 MiB too."""
    got = host_memory.zeros((1024, 1024), torch.float32, "meta")
    assert got.device.type == "meta" and got.shape == (1024, 1024) and got.dtype == torch.float32
