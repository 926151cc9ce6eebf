"""GGUF's block types as MILI's kernels take them: quants ``q`` with a scale and an offset per group of input
channels, w = scale * q + offset (``quant.GroupParts``). Each type maps onto that exactly: float32 scale * q +
offset, computed in that order, gives the values of ``gguf.quants.dequantize`` exactly (tested), because the scales are
products gguf-py itself forms first (d * sc, exact in float32) and an offset is its subtracted term.

    Q8_0  32 int8 q, fp16 d                      w = d q                  8-bit, group 32
    Q4_0  32 4-bit q, fp16 d                     w = d (q - 8)            4-bit, group 32
    Q4_K  256: 8 x 32 4-bit q, 6-bit sc and m    w = (d sc) q + (-dmin m)  4-bit, group 32
    Q5_K  256: 8 x 32 5-bit q, 6-bit sc and m    w = (d sc) q + (-dmin m)  5-bit, group 32
    Q6_K  256: 16 x 16 6-bit q - 32, int8 sc     w = (d sc) q             6-bit, group 16

Q4_0's q is kept as q - 8 (-8..7): the int4 kernel stores q and no offsets (w = d (q - 8)), as the file does. The
K-quants' scales and offsets are kept in their two levels too (``quant.TwoLevel``: (d, sc) and (-dmin, m) per super-block
of 256 and per group), which the kernels read as the file stores them (kernels.c, SCALES_K); their float32 values are
those products.
"""

from __future__ import annotations

import numpy as np
import torch

from mili.model.quant import GroupParts, TwoLevel

QK_K = 256
# (elements, bytes) of a block, by GGML type name: what the file's tensor sizes are checked against
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins: 8 of each (llama.cpp's get_scale_min_k4), int8."""
    n = scales.shape[0]
    d, m, m_d = (scales[:, i * 4:(i + 1) * 4] for i in range(3))
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.reshape(n, 8).astype(np.int8), mn.reshape(n, 8).astype(np.int8)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes in chunks of ``chunk``: each chunk's low nibbles, then its high nibbles (GGUF's order)."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n, -1)


Scales = np.ndarray | tuple[np.ndarray, np.ndarray]  # [n, groups] float32, or two levels (d [n, 1], sc [n, groups])


def split_blocks(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, Scales, Scales | None, int, int]:
    """``blocks`` [n, bytes] of one type -> (q [n, elements] int8, scales, offsets, group, bits). Scales and offsets are
    [n, groups] float32, or for the K-quants their two levels (d [n, 1] float32 of fp16 values, sc [n, groups] int8:
    a group's value d sc); offsets None: none."""
    n = blocks.shape[0]
    if type_name == "Q8_0":
        return blocks[:, 2:].view(np.int8), _f16(blocks[:, :2]), None, 32, 8
    if type_name == "Q4_0":  # (symmetric: the int4 kernel's w = d (q - 8), no offsets stored)
        return _nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8), _f16(blocks[:, :2]), None, 32, 4
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        scales, offsets = (d, sc), (-dmin, mn)  # (-dmin m = -(dmin m): gguf-py's d sc q - dmin m)
        if type_name == "Q4_K":
            return _nibbles(blocks[:, 16:], 32).astype(np.int8), scales, offsets, 32, 4
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = _nibbles(blocks[:, 48:], 32) | ((qh & 1).reshape(n, -1) << 4)
        return q.astype(np.int8), scales, offsets, 32, 5
    if type_name == "Q6_K":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
        d = _f16(blocks[:, 208:210])
        low = _nibbles(ql, 64).reshape(n, -1, 64)  # two halves of 128: 64 low-nibble values, 64 high
        high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (low.reshape(n, -1, 128) | (high.reshape(n, -1, 128) << 4)).astype(np.int8) - np.int8(32)
        return q.reshape(n, QK_K), (d, sc), None, 16, 6
    raise ValueError(f"no kernel mapping for {type_name}")


def group_parts(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> GroupParts:
    """A GGUF tensor's blocks (``data``: the reader's uint8 [rows, bytes]) as a matrix's ``GroupParts``: q
    [out, in] int8, scales and offsets [out, in / group] float32 (and the K-quants' two levels: scales_k,
    offsets_k)."""
    out, k = shape[-2], shape[-1]
    _, size = BLOCKS[type_name]
    q, scales, offsets, group, bits = split_blocks(np.asarray(data).reshape(-1, size), type_name)

    def matrix(t, per):  # [out, k / per]
        return torch.from_numpy(np.ascontiguousarray(t).reshape(out, k // per))

    def two_level(t):
        return None if not isinstance(t, tuple) else TwoLevel(matrix(t[0], QK_K), matrix(t[1], group))

    scales_k, offsets_k = two_level(scales), two_level(offsets)
    scales = scales_k.values() if scales_k is not None else matrix(scales, group)
    offsets = (offsets_k.values() if offsets_k is not None else  # (none: -0, so s q + b is s q's bits, -0 too)
               torch.full_like(scales, -0.0) if offsets is None else matrix(offsets, group))
    return GroupParts(torch.from_numpy(q.reshape(out, k).copy()), scales.contiguous(), offsets.contiguous(), bits,
                      scales_k, offsets_k)
