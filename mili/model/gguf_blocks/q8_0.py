"""Q8_0: blocks of 32 int8 quants after an fp16 scale d: w = d q. On the int8g kernel, as stored (u = q + 128, no
offsets)."""

from __future__ import annotations

import numpy as np

from mili.model.gguf_blocks.base import BlockType, f16


class Q8_0(BlockType):
    name = "Q8_0"
    elements, block_bytes, bits, group, kernel = 32, 34, 8, 32, "int8g"
    formula = "32 int8 q, fp16 d: w = d q"

    def split(self, blocks):
        return blocks[:, 2:].view(np.int8), f16(blocks[:, :2]), None
