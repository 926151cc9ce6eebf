"""Q4_1: blocks of 32 4-bit quants (16 bytes: the low nibbles are the first 16, the high the last 16) after an fp16
scale d and an fp16 minimum m: w = d q + m, q 0..15. On the int4 kernel with offsets (m), one level."""

from __future__ import annotations

import numpy as np

from mili.model.gguf_blocks.base import BlockType, f16, nibbles


class Q4_1(BlockType):
    name = "Q4_1"
    elements, block_bytes, bits, group, kernel = 32, 20, 4, 32, "int4"
    formula = "32 4-bit q, fp16 d and m: w = d q + m"

    def split(self, blocks):
        return nibbles(blocks[:, 4:], 16).astype(np.int8), f16(blocks[:, :2]), f16(blocks[:, 2:4])
