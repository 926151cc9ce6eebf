"""Q5_0: blocks of 32 5-bit quants after an fp16 scale d: 4 bytes of fifth bits (a little-endian word, bit i for
quant i), then Q4_0's 16 bytes of nibbles: w = d (q - 16). q is kept as q - 16 (-16..15), with no offsets: the
int4 kernel with one bit above the nibble, as the file does."""

from __future__ import annotations

import numpy as np

from mili.model.gguf_blocks.base import BlockType, bits_of_words, f16, nibbles


class Q5_0(BlockType):
    name = "Q5_0"
    elements, block_bytes, bits, group, kernel = 32, 22, 5, 32, "int4"
    formula = "32 5-bit q, fp16 d: w = d (q - 16)"

    def split(self, blocks):
        q = nibbles(blocks[:, 6:], 16) | (bits_of_words(blocks[:, 2:6]) << 4)
        return q.astype(np.int8) - np.int8(16), f16(blocks[:, :2]), None
