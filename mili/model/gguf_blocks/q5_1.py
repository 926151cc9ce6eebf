"""Q5_1: blocks of 32 5-bit quants after an fp16 scale d and an fp16 minimum m: 4 bytes of fifth bits (a
little-endian word, bit i for quant i), then 16 bytes of nibbles: w = d q + m, q 0..31. On the int4 kernel with one
bit above the nibble and offsets (m), one level."""

from __future__ import annotations

import numpy as np

from mili.model.gguf_blocks.base import BlockType, bits_of_words, f16, nibbles


class Q5_1(BlockType):
    name = "Q5_1"
    elements, block_bytes, bits, group, kernel = 32, 24, 5, 32, "int4"
    formula = "32 5-bit q, fp16 d and m: w = d q + m"

    def split(self, blocks):
        q = nibbles(blocks[:, 8:], 16) | (bits_of_words(blocks[:, 4:8]) << 4)
        return q.astype(np.int8), f16(blocks[:, :2]), f16(blocks[:, 2:4])
