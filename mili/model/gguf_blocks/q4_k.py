"""Q4_K: super-blocks of 256 4-bit quants in 8 groups of 32 (fp16 d and dmin, 6-bit sc and m a group):
w = (d sc) q + (-dmin m). The scales and offsets are kept in their two levels (``quant.TwoLevel``), which the int4
kernel reads as the file stores them (kernels.c, SCALES_K); their float32 values are those products, exact."""

from __future__ import annotations

import numpy as np

from mili.model.gguf_blocks.base import BlockType, k_scales, nibbles


class Q4_K(BlockType):
    name = "Q4_K"
    elements, block_bytes, bits, group, kernel = 256, 144, 4, 32, "int4"
    formula = "256: 8 x 32 4-bit q, 6-bit sc and m: w = (d sc) q + (-dmin m)"
    medium_mix = "Q6_K"  # llama.cpp's Q4_K_M

    def split(self, blocks):
        scales, offsets = k_scales(blocks)
        return nibbles(blocks[:, 16:], 32).astype(np.int8), scales, offsets
