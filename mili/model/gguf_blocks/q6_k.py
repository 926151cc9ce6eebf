"""Q6_K: super-blocks of 256 6-bit quants in 16 groups of 16 (128 bytes of low nibbles, 64 of high 2-bit pairs,
an int8 sc a group, fp16 d last): w = (d sc) (q - 32). q is kept as q - 32 (-32..31), with no offsets; the scales in
their two levels (d, sc), sc signed. On the int4 kernel with two bits above the nibble."""

from __future__ import annotations

import numpy as np

from mili.model.gguf_blocks.base import QK_K, BlockType, f16, nibbles


class Q6_K(BlockType):
    name = "Q6_K"
    elements, block_bytes, bits, group, kernel = 256, 210, 6, 16, "int4"
    formula = "256: 16 x 16 6-bit q - 32, int8 sc: w = (d sc) q"

    def split(self, blocks):
        n = blocks.shape[0]
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
        d = f16(blocks[:, 208:210])
        low = nibbles(ql, 64).reshape(n, -1, 64)  # two halves of 128: 64 low-nibble values, 64 high
        high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (low.reshape(n, -1, 128) | (high.reshape(n, -1, 128) << 4)).astype(np.int8) - np.int8(32)
        return q.reshape(n, QK_K), (d, sc), None
