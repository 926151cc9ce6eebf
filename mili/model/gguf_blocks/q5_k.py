"""Q5_K: Q4_K's super-blocks with a fifth bit a quant (32 bytes of high bits, bit j of byte i for quant 32 j + i):
w = (d sc) q + (-dmin m), q 0..31. On the int4 kernel with one bit above the nibble."""

from __future__ import annotations

import numpy as np

from mili.model.gguf_blocks.base import BlockType, k_scales, nibbles


class Q5_K(BlockType):
    name = "Q5_K"
    elements, block_bytes, bits, group, kernel = 256, 176, 5, 32, "int4"
    formula = "256: 8 x 32 5-bit q, 6-bit sc and m: w = (d sc) q + (-dmin m)"
    medium_mix = "Q6_K"  # llama.cpp's Q5_K_M

    def split(self, blocks):
        n = blocks.shape[0]
        scales, offsets = k_scales(blocks)
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = nibbles(blocks[:, 48:], 32) | ((qh & 1).reshape(n, -1) << 4)
        return q.astype(np.int8), scales, offsets
