"""The building blocks of the Qwen3 forward: RMSNorm, the rotary table, SwiGLU; the hybrids' zero-centred and
gated RMSNorms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mili.errors import ModelLoadError
from mili.kernels.reference import TorchOps
from mili.model.checks import STATIC_ROPE_TYPES, rope_parameters
from mili.model.mrope import mrope_axes


class RMSNorm(nn.Module):
    """Computed in float32, cast back before the weight, as HF transformers does; ``ops`` is the
    kernel set (torch or Triton). ``forward(x, residual)`` adds the residual first and returns both."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, ops=TorchOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inverse_frequencies(hf_config) -> tuple[torch.Tensor, float]:
    """inv_freq and the cos/sin scale for the checkpoint's RoPE type (default, linear, yarn, ...)."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", 1.0))  # the hybrids rotate a quarter of each head
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    if rope_type not in STATIC_ROPE_TYPES or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported (static types only: "
                             f"{', '.join(STATIC_ROPE_TYPES)})")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


class RotaryEmbedding(nn.Module):
    """A cos/sin table over every position, indexed by the batch's explicit positions: [T], or for an M-RoPE model
    (``mrope_section`` in its rope parameters) [3, T] (time, height, width: each column of the table then takes
    its axis's position, see model/mrope.py). A batch without images passes [T] positions either way."""

    def __init__(self, hf_config, max_positions: int, device: torch.device):
        super().__init__()
        inv_freq, scale = rope_inverse_frequencies(hf_config)
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(device), persistent=False)
        axes = mrope_axes(rope_parameters(hf_config), len(inv_freq))
        # [1, 2D]: the position row (0 time, 1 height, 2 width) each column of cos/sin reads
        self.mrope_axes = None if axes is None else torch.cat([axes, axes])[None].to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [T, rotary dim] for a step's positions: once per step, not per layer."""
        if positions.dim() == 1:
            return self.cos[positions], self.sin[positions]
        if self.mrope_axes is None:
            raise ValueError("positions of shape [3, T] for a model without M-RoPE")
        index = self.mrope_axes.expand(positions.shape[1], -1)[None]  # [1, T, 2D]
        return self.cos[positions].gather(0, index)[0], self.sin[positions].gather(0, index)[0]


class ZeroCentredRMSNorm(nn.Module):
    """HF's Qwen3_5RMSNorm / Qwen3NextRMSNorm: x̂ · (1 + w) in float32, then cast; ``forward(x, residual)``
    adds the residual first and returns both."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        out = (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)


class GatedRMSNorm(nn.Module):
    """The linear attention's output norm: w · x̂ (plain weight, cast back before it), times silu(gate)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)
