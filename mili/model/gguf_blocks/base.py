"""The base of GGUF's block types (``BlockType``) and their registry (``BLOCK_TYPES``): each type's class registers
itself by its GGML type name as it is defined, and the package imports each of its modules (``gguf_blocks/__init__``),
so a new block type is one module of the package (and its tests). Also the readers the types share: fp16 fields,
nibbles in GGUF's order, the K-quants' 6-bit scales and mins."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

QK_K = 256  # the K-quants' super-block
Scales = np.ndarray | tuple[np.ndarray, np.ndarray]  # [n, groups] float32, or two levels (d [n, 1], sc [n, groups])

# every block type MILI runs by its GGML type name, filled in as each class is defined (``BlockType.__init_subclass__``)
BLOCK_TYPES: dict[str, BlockType] = {}


class BlockType:
    """One GGUF block type as MILI's kernels take it: quants ``q`` with a scale and an offset per group of input
    channels, w = scale q + offset (``quant.GroupParts``), read from the file's blocks by ``split``. The registry
    holds one instance of each; everything about the type is here: its block (``elements``, ``block_bytes``, what
    the file's tensor sizes are checked against), its quants' ``bits`` and ``group``, the CPU kernel that runs it
    as stored (``kernel``: "int4", with ``bits - 4`` bits above the nibble, or "int8g"; the kernel format's
    ``cpu_form`` picks it from the parts, and the tests hold the two equal), its bytes a weight (the roofline's)."""

    name: ClassVar[str] = ""  # the GGML type name (gguf.GGMLQuantizationType's), the registry's key
    elements: ClassVar[int] = 0  # weights a block
    block_bytes: ClassVar[int] = 0  # bytes a block
    bits: ClassVar[int] = 0  # of a quant: 4 (-8..7 without offsets, 0..15 with), 5, 6 (with high bits), 8
    group: ClassVar[int] = 0  # input channels a scale (and offset)
    kernel: ClassVar[str] = ""  # the CPU kernel that runs it as stored: "int4" or "int8g"
    formula: ClassVar[str] = ""  # w in words, for the docs and the logs
    # the type llama.cpp's "_M" mix of this main type puts its sensitive layers in (the file type is then NAME_M)
    medium_mix: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name:
            if name in BLOCK_TYPES and type(BLOCK_TYPES[name]) is not cls:
                raise ValueError(f"two GGUF block types named {name!r}: {type(BLOCK_TYPES[name]).__qualname__}, "
                                 f"{cls.__qualname__}")
            BLOCK_TYPES[name] = cls()

    @property
    def bytes_per_weight(self) -> float:
        """The bytes the file stores a weight in (its scales spread over the weights): what a decode step reads."""
        return self.block_bytes / self.elements

    def split(self, blocks: np.ndarray) -> tuple[np.ndarray, Scales, Scales | None]:
        """``blocks`` [n, block_bytes] (uint8) -> (q [n, elements] int8, scales, offsets): scales and offsets [n,
        elements / group] float32, or the K-quants' two levels (d [n, 1] float32 of fp16 values, sc [n, groups]
        int8: a group's value d sc); offsets None: none. float32 scale * q + offset, in that order, must be
        ``gguf.quants.dequantize`` of the blocks, value for value."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<GGUF block type {self.name}>"


def f16(b: np.ndarray) -> np.ndarray:
    """Bytes [n, 2] of fp16 values -> [n, 1] float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes in chunks of ``chunk``: each chunk's low nibbles, then its high nibbles (GGUF's order), uint8."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n, -1)


def bits_of_words(qh: np.ndarray) -> np.ndarray:
    """Bytes [n, 4] of a little-endian 32-bit word -> its 32 bits [n, 32] uint8, bit i at i (Q5_0's and Q5_1's high
    bits)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins: 8 of each (llama.cpp's get_scale_min_k4), int8."""
    n = scales.shape[0]
    d, m, m_d = (scales[:, i * 4:(i + 1) * 4] for i in range(3))
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.reshape(n, 8).astype(np.int8), mn.reshape(n, 8).astype(np.int8)


def k_scales(blocks: np.ndarray) -> tuple[Scales, Scales]:
    """Q4_K's and Q5_K's scales and offsets in two levels, from a block's first 16 bytes (fp16 d, fp16 dmin, 12
    bytes of 6-bit sc and m): (d, sc) and (-dmin, m) (-dmin m = -(dmin m): gguf-py's d sc q - dmin m)."""
    d, dmin = f16(blocks[:, :2]), f16(blocks[:, 2:4])
    sc, mn = scale_min_k4(blocks[:, 4:16])
    return (d, sc), (-dmin, mn)
