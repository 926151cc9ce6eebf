"""SwiGLU on a fused [gate | up] projection in one Triton kernel: one read of ``gate_up``, one write of the result.

Numerics follow ``reference.silu_and_mul`` (torch's ``F.silu(gate) * up`` in the model dtype): silu is computed in
float32 as ``g / (1 + exp(-g))`` (a correctly rounded division, as torch's CUDA kernel divides) and rounded to the
model dtype, then multiplied by ``up`` in float32 and rounded again (the product of two bf16 / fp16 values is exact
in float32, so that is torch's one model-dtype multiply). The one difference: ``tl.exp`` on the GPU is the fast
``ex2.approx`` path, a few float32 ulps from torch's ``expf``, which moves a bf16 result by one ulp in rare ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SWIGLU_MAX_BLOCK = 1024  # columns a program takes at most (4 warps, 8 values a thread)


@triton.jit
def _silu_and_mul_kernel(GATE_UP, OUT, I, stride_g, stride_o, BLOCK: tl.constexpr):
    """One row's BLOCK output columns: out = round(round(silu(gate)) * up)."""
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(GATE_UP + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * stride_g + I + cols, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dt).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (silu * up).to(dt), mask=mask)


def silu_and_mul_meta(inter: int) -> dict:
    """The launch's block of columns: the row's width up to ``SWIGLU_MAX_BLOCK`` (a pure function of the width, so
    the compile check compiles what runs)."""
    return dict(BLOCK=min(SWIGLU_MAX_BLOCK, triton.next_power_of_2(inter)))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate columns, then up) -> silu(gate) * up [..., I] in gate_up's dtype."""
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    meta = silu_and_mul_meta(inter)
    if x.shape[0] and inter:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, meta["BLOCK"]))](x, out, inter, x.stride(0),
                                                                               out.stride(0), **meta)
    return out.view(*gate_up.shape[:-1], inter)
