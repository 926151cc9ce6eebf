"""The Triton ops set: fused RMSNorm (+ residual), fused q/k-norm + RoPE and fused MoE experts, same
interface as TorchOps (which has no ``fused_experts``: the torch path loops over experts)."""

from __future__ import annotations

from mili.kernels import reference
from mili.kernels.triton import fused_moe, norm_rope


class TritonOps:
    rms_norm = staticmethod(norm_rope.rms_norm)
    silu_and_mul = staticmethod(reference.silu_and_mul)
    fused_experts = staticmethod(fused_moe.fused_experts)

    @staticmethod
    def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
        half = q.shape[-1] // 2
        if q.shape[-1] % 2 or half & (half - 1):  # the kernel wants head_dim = 2 x a power of two
            return reference.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
        return norm_rope.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
