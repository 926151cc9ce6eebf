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
