"""GGUF's block types as MILI's kernels take them, as objects: one class per type (``base.BlockType``), behind one
registry (``BLOCK_TYPES``, ``block_type``), registered by its GGML type name as it is defined. Each maps a block onto
quants ``q`` with a scale and an offset per group of input channels, w = scale * q + offset (``quant.GroupParts``),
exactly: float32 scale * q + offset, computed in that order, gives the values of ``gguf.quants.dequantize`` exactly
(tested), because the scales are products gguf-py itself forms first (d * sc, exact in float32) and an offset is
its added or subtracted term.

Each module of this package holds one type, its block's layout in its docstring, and this package imports every one
of its modules, so adding a block type is adding its module (and its tests): the loader (model/gguf.py) then
accepts a file's tensors of that type, and the kernel format (formats/kernel.py) runs their parts on the kernel
they fit (``BlockType.kernel``: int4, with the bits above the nibble, or int8g).

The K-quants' scales and offsets are kept in their two levels too (``quant.TwoLevel``: (d, sc) and (-dmin, m) per
super-block of 256 and per group), which the kernels read as the file stores them (kernels.c, SCALES_K).
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np

from mili.model.gguf_blocks.base import BLOCK_TYPES, QK_K, BlockType, Scales


def load_modules() -> None:
    """Import every module of the package (each registers its block type as its class is defined)."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")


load_modules()


def block_type(name: str) -> BlockType:
    """The block type registered as ``name`` (a GGML type name); refused by name where MILI runs no such type."""
    try:
        return BLOCK_TYPES[name]
    except KeyError:
        raise ValueError(f"no kernel mapping for the GGUF type {name} (MILI maps "
                         f"{', '.join(sorted(BLOCK_TYPES))})") from None


def group_parts(data: np.ndarray, type_name: str, shape: tuple[int, ...]):
    """A GGUF tensor's blocks (``data``: the reader's uint8 [rows, bytes]) as a matrix's ``GroupParts``: q
    [out, in] int8, scales and offsets [out, in / group] float32 (and the K-quants' two levels: scales_k,
    offsets_k)."""
    import torch

    from mili.model.quant import GroupParts, TwoLevel

    kind = block_type(type_name)
    out, k = shape[-2], shape[-1]
    q, scales, offsets = kind.split(np.asarray(data).reshape(-1, kind.block_bytes))
    group = kind.group

    def matrix(t, per):  # [out, k / per]
        return torch.from_numpy(np.ascontiguousarray(t).reshape(out, k // per))

    def two_level(t):
        return None if not isinstance(t, tuple) else TwoLevel(matrix(t[0], QK_K), matrix(t[1], group))

    scales_k, offsets_k = two_level(scales), two_level(offsets)
    scales = scales_k.values() if scales_k is not None else matrix(scales, group)
    offsets = (offsets_k.values() if offsets_k is not None else  # (none: -0, so s q + b is s q's bits, -0 too)
               torch.full_like(scales, -0.0) if offsets is None else matrix(offsets, group))
    return GroupParts(torch.from_numpy(q.reshape(out, k).copy()), scales.contiguous(), offsets.contiguous(),
                      kind.bits, scales_k, offsets_k)


__all__ = ["BLOCK_TYPES", "QK_K", "BlockType", "Scales", "block_type", "group_parts", "load_modules"]
