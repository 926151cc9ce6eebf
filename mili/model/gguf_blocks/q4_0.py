"""Q4_0: blocks of 32 4-bit quants (16 bytes: the low nibbles are the first 16, the high the last 16) after an
fp16 scale d: w = d (q - 8). q is kept as q - 8 (-8..7): the int4 kernel stores q and no offsets (w = d (q - 8)),
as the file does."""

from __future__ import annotations

import numpy as np

from mili.model.gguf_blocks.base import BlockType, f16, nibbles


class Q4_0(BlockType):
    name = "Q4_0"
    elements, block_bytes, bits, group, kernel = 32, 18, 4, 32, "int4"
    formula = "32 4-bit q, fp16 d: w = d (q - 8)"

    def split(self, blocks):
        return nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8), f16(blocks[:, :2]), None
