"""Torch implementations of the Gated DeltaNet token mixer's two sequential parts, with the numerics of HF
transformers (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``, ``causal_conv1d``):

* the depthwise causal conv1d (kernel K, SiLU) over q|k|v, resuming from a conv state (the last K - 1
  inputs of the sequence so far);
* the gated delta rule: per value head, a [Dk, Dv] state S decays by exp(g_t), then takes the delta
  update S += k_t (beta_t (v_t - S^T k_t))^T, and the output is S^T q_t (q, k L2-normalised, q scaled by
  1/sqrt(Dk)). A prefill runs it in chunks of 64 (a triangular solve per chunk, as HF and fla do); a decode
  step runs the recurrence once for every sequence of the batch together.

Everything is computed in float32; the SSM state is returned in float32 (the caller stores it in its
pool's dtype, ``mamba_ssm_dtype``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [L, C] after the state [C, K - 1] (its previous inputs, zeros at the start); weight
    [C, K]. Returns (silu(conv) [L, C] in x's dtype, the new state [C, K - 1])."""
    k = weight.shape[-1]
    window = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)  # [C, K - 1 + L]
    out = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, L]
    return F.silu(out).t().to(x.dtype), window[:, -(k - 1):]


def causal_conv1d_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step of B sequences: x [B, C], states [B, C, K - 1] -> (silu(conv) [B, C], new states)."""
    window = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=-1)  # [B, C, K]
    out = (window * weight[None]).sum(-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def _prepare(q, k, v, g, beta):
    """To float32, key heads repeated to the value heads (each key head serves consecutive value heads),
    q and k L2-normalised, q scaled."""
    rep = v.shape[-2] // k.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill chunk: q, k [L, Hk, Dk], v [L, Hv, Dv], g, beta [L, Hv]; ``state`` [Hv, Dk, Dv]
    or None (zeros). Returns (out [L, Hv, Dv] float32, the final state [Hv, Dk, Dv] float32)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    length, hv, dv = v.shape
    dk = k.shape[-1]
    pad = -length % CHUNK
    # [Hv, N, CHUNK, D]: heads first, the sequence padded to whole chunks (zero g and beta in the padding)
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(hv, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).t().reshape(hv, -1, CHUNK) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    s = torch.zeros(hv, dk, dv, device=q.device) if state is None else state.float()
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(hv, -1, dv)[:, :length].transpose(0, 1), s


def recurrent_gated_delta_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv, Dk, Dv].
    Returns (out [B, Hv, Dv] float32, the new states float32)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float() * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s
