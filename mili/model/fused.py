"""The fused parameters the model files, the loader and the per-format linears share: ``FusedLinear``
(q|k|v, gate|up), the MoE router and the stacked experts, and the maps from a checkpoint's names to them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mili.kernels.reference import TorchOps

# HF checkpoint name -> (fused parameter, shard index); MoE experts: see EXPERT_PARAMS
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


# an expert's projection in a hub checkpoint (...mlp.experts.{e}.{name}.weight) -> (stacked parameter, shard)
EXPERT_PARAMS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


class FusedLinear(nn.Linear):
    """A linear layer whose output is several checkpoint matrices stacked (q|k|v or gate|up)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__(in_features, sum(shard_sizes), bias=bias, dtype=dtype)
        self.shard_sizes = shard_sizes

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])


class RouterLinear(nn.Linear):
    """The MoE router's [E, H] matrix: kept as it is by ``swap_linears`` (routing must not change)."""


class FusedExperts(nn.Module):
    """E SwiGLU experts, stacked: ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, ops=TorchOps):
        super().__init__()
        self.num_experts, self.inter, self.ops = num_experts, inter, ops
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False)
        self.linears: nn.ModuleList | None = None  # per expert (gate_up, down) CPU linears, once swapped

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * down(silu(gate(x)) * up(x)): [T, H]."""
        fused = getattr(self.ops, "fused_experts", None)  # the Triton kernel (CUDA)
        if fused is not None and self.linears is None:
            return fused(x, self.w13, self.w2, topk_weights, topk_ids)
        k = topk_ids.shape[1]
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        rows = x.index_select(0, tokens)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            xe = rows[start:start + n]
            if self.linears is not None:
                gate_up, down = self.linears[e * 2], self.linears[e * 2 + 1]
                out[start:start + n] = down(self.ops.silu_and_mul(gate_up(xe)))
            else:
                out[start:start + n] = F.linear(self.ops.silu_and_mul(F.linear(xe, self.w13[e])), self.w2[e])
            start += n
        out.mul_(topk_weights.flatten().index_select(0, order).unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, tokens, out)
