"""Torch implementations of every kernel: the references the Triton kernels are tested against, and
(norms, RoPE) the ops the model runs with on the torch path. Numerics follow HF transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm in float32, rounded before the weight; with ``residual``: (norm(x + r), x + r)."""
    if residual is not None:
        x = x + residual
    out = weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return out if residual is None else (out, x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, Hq, D] and k [T, Hkv, D], then rotate-half RoPE with cos/sin [T, D]
    (float32 tables, applied in the tensors' dtype)."""
    cos, sin = cos.to(q.dtype)[:, None, :], sin.to(q.dtype)[:, None, :]
    q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v: [T, Hkv, D] written at flat slots (page * page_size + offset); slot < 0 is skipped."""
    if (slot_mapping < 0).any():  # padding rows (CUDA graphs)
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    query_lens: list[int], context_lens: list[int], scale: float) -> torch.Tensor:
    """The plainest paged attention: q [T, Hq, D] of several sequences (query_lens each, at the last
    positions of context_lens[b] cached tokens), one sequence at a time, in float32."""
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out, start = torch.empty_like(q), 0
    for b, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        slots = [int(page_table[b, p // page_size]) * page_size + p % page_size for p in range(ctx)]
        k = k_cache.view(-1, hkv, k_cache.shape[-1])[slots].float().repeat_interleave(group, 1)
        v = v_cache.view(-1, hkv, v_cache.shape[-1])[slots].float().repeat_interleave(group, 1)
        qs = q[start:start + qlen].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qpos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]  # the mask where the scores are
        scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > qpos, float("-inf"))
        out[start:start + qlen] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        start += qlen
    return out


class TorchOps:
    """Norm, RoPE and SwiGLU ops for the torch path."""

    rms_norm = staticmethod(rms_norm)
    qk_norm_rope = staticmethod(qk_norm_rope)
    silu_and_mul = staticmethod(silu_and_mul)


# -- quantized weights and the FP8 KV cache ------------------------------------------------------------------
FP8_MAX = 448.0  # the largest float8_e4m3fn


def to_fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """x / scale rounded to float8_e4m3fn (nearest even), saturating at +-448: an FP8 KV page's entries. (A
    true division, as the kernels': torch on CUDA multiplies by the reciprocal of a Python number, which can
    differ in the last bit, so the scale is always a tensor on x's device.)"""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]): each group of a row divided by its largest
    magnitude / 448 (at least 1e-10 / 448)."""
    m, k = x.shape
    groups = F.pad(x.float(), (0, -k % group)).view(m, -1, group)
    amax = groups.abs().amax(dim=-1).clamp(min=1e-10)
    scales = amax / torch.full_like(amax, FP8_MAX)  # (a true division on CUDA too: see to_fp8)
    return to_fp8(groups, scales[..., None]).view(m, -1)[:, :k], scales


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scale_block: tuple[int, int],
               fp8_activations: bool, group: int = 128) -> torch.Tensor:
    """x @ (weight x its scale per ``scale_block`` block)^T in float32; with ``fp8_activations`` x through
    ``per_token_group_quant_fp8`` first. In x's dtype."""
    n, k = weight.shape
    w = weight.float() * weight_scale.float().repeat_interleave(scale_block[0], 0)[:n].repeat_interleave(
        scale_block[1], 1)[:, :k]
    a = x.float()
    if fp8_activations:
        q, scales = per_token_group_quant_fp8(x, group)
        a = q.float() * scales.repeat_interleave(group, 1)[:, :k]
    return (a @ w.T).to(x.dtype)


def int4_linear(x: torch.Tensor, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ W^T, W [N, K] = (q - zeros) * scales, one zero point and scale per group of input channels."""
    group = q.shape[1] // zeros.shape[1]
    w = (q.float() - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    return (x.float() @ w.T).to(x.dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W^T, W [N, K] = q (int8) * scale, one scale per output channel; in float32, then x's dtype."""
    return (x.float() @ (q.float() * scale.float()[:, None]).T).to(x.dtype)
