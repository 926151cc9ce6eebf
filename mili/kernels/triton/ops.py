"""The Triton ops set: fused RMSNorm (+ residual), fused q/k-norm + RoPE (also with the K/V store), fused SwiGLU
and fused MoE experts, same interface as TorchOps (which has no ``fused_experts``: the torch path loops over
experts, nor ``qk_norm_rope_store``: the other back-ends store K/V apart)."""

from __future__ import annotations

from mili.kernels import reference
from mili.kernels.triton import fused_moe, norm_rope, swiglu
from mili.kernels.triton.attention import store_kv


def _norm_rope_kernel_takes(head_dim: int) -> bool:
    """The norm + RoPE kernels want head_dim = 2 x a power of two (else torch's reference runs)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half & (half - 1) == 0


class TritonOps:
    rms_norm = staticmethod(norm_rope.rms_norm)
    silu_and_mul = staticmethod(swiglu.silu_and_mul)
    fused_experts = staticmethod(fused_moe.fused_experts)

    @staticmethod
    def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
        if not _norm_rope_kernel_takes(q.shape[-1]):
            return reference.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
        return norm_rope.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)

    @staticmethod
    def qk_norm_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slot_mapping,
                           k_scale: float = 1.0, v_scale: float = 1.0):
        """q normed and rotated (returned); k normed, rotated and written with v into the Triton back-end's pages
        at ``slot_mapping`` (slot < 0 skipped): one launch, or the norm + RoPE and the store apart where the kernel
        does not take the head_dim."""
        if not _norm_rope_kernel_takes(q.shape[-1]):
            q, k = reference.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
            store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return q
        return norm_rope.qk_norm_rope_store(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache,
                                            slot_mapping, k_scale, v_scale)
