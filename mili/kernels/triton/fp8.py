"""FP8 e4m3 conversions shared by the Triton kernels (quantized GEMMs, the FP8 KV cache).

``to_fp8`` rounds in float32 arithmetic to the e4m3 grid first and then casts a value the cast keeps
exactly: the bits are what the GPU's ``cvt.rn.satfinite`` gives (round to nearest even, saturating at
+-448), and TRITON_INTERPRET's cast, which does not carry a rounded-up mantissa into the exponent (1.98
becomes 1.0 there), computes the same thing, so the interpreter tests check the GPU's arithmetic.

``fp8_bits_to_float`` decodes e4m3 bytes loaded as uint8 with integer operations: GPUs before SM 89 have
no fp8 type in Triton at all (not even a pointer to one), so their weight-only GEMM reads the bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_fp8(x):
    """float32 -> float8e4nv: round to nearest even, saturating at +-448 (as torch's cast of a clamped value)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    e = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent; subnormals share the smallest normal's step
    e = tl.maximum(e, 127 - 6)
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): 3 mantissa bits
    inv_step = ((254 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    y = x * inv_step  # exact (a power of two), |y| <= 16
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32's own round to nearest even, at integers
    return (y * step).to(tl.float8e4nv)


@triton.jit
def fp8_bits_to_float(b):
    """e4m3 bytes (uint8) -> float32 exactly: the byte's exponent and mantissa placed in a float16 (whose
    subnormals line up with e4m3's) gives the value / 256. NaN (0x7f / 0xff) is not decoded."""
    b = b.to(tl.int16)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
