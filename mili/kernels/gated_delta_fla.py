"""The Gated DeltaNet mixer's sequential part on flash-linear-attention's Triton kernels (``fla-core``, an
optional dependency: ``pip install fla-core``, or the ``cuda`` extra), for the hybrids on CUDA.

What runs where, for one step's linear-attention layer (``FlaGatedDelta.__call__``):

* decodes, all together: the conv step in torch (``gated_delta.causal_conv1d_step`` over the slots'
  conv states, a handful of elementwise ops), then fla's ``fused_recurrent_gated_delta_rule`` with one
  token per sequence, the slots' SSM states gathered as its ``initial_state`` and its final states scattered
  back (fla-core 0.6's gated delta kernel has no state-index argument: gather/scatter by the slot tensor,
  which CUDA graphs take as a static input);
* prefill chunks, all in one call: the conv per chunk in torch (``gated_delta.causal_conv1d``: fla's causal
  conv keeps a state of K columns where MILI's slots keep K - 1), then fla's ``chunk_gated_delta_rule``
  over the chunks concatenated, ``cu_seqlens`` marking them, each from its slot's state (zeros where the
  chunk starts its sequence), the final states written back to the slots.

q and k are L2-normalised in the kernels (``use_qk_l2norm_in_kernel``), the key heads shared by consecutive
value heads as in ``gated_delta._prepare``; g and beta come in computed (g float32). The numerics are those
of ``mili/kernels/gated_delta.py`` (the tests compare them under ``TRITON_INTERPRET=1``).

``GatedDeltaNet.kernels`` (mili/model/qwen3_5.py) holds the implementation a model's layers call: None for
the torch code in the model, or a ``FlaGatedDelta``, which the runner sets on CUDA (``select``).
"""

from __future__ import annotations

import importlib.util

import torch

from mili.kernels.gated_delta import causal_conv1d, causal_conv1d_step

INSTALL_HINT = "pip install fla-core"


def fla_available() -> bool:
    """Whether fla-core is installed (its kernels are imported on first use, not here)."""
    return importlib.util.find_spec("fla") is not None


def use(model: torch.nn.Module, kernels: "FlaGatedDelta | None") -> int:
    """Set every Gated DeltaNet layer of ``model`` to ``kernels`` (None: the model's torch code); returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "kernels") and hasattr(m, "conv1d")]
    for m in layers:
        m.kernels = kernels
    return len(layers)


class FlaGatedDelta:
    name = "fla"

    def __init__(self):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        self._chunk, self._recurrent = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def __call__(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, rb,
                 conv_states: torch.Tensor, ssm_states: torch.Tensor, shape) -> torch.Tensor:
        """qkv [T, conv_dim] (before the conv), g [T, Hv] float32, beta [T, Hv]; ``rb``: the step's
        ``RecurrentBatch``; the states [rows, ...] are read at each sequence's slot and written back.
        Returns the mixer's output [T, Hv, Dv] (qkv's dtype)."""
        s, t = shape, qkv.shape[0]
        core = qkv.new_empty(t, s.num_v_heads, s.head_v_dim)
        scale = s.head_k_dim ** -0.5
        nd = rb.decode_slots.shape[0]
        if nd:
            conv0 = conv_states.index_select(0, rb.decode_slots)
            ssm0 = ssm_states.index_select(0, rb.decode_slots).float()
            if rb.decode_keep is not None:  # a sequence's first token starts from zeros, whatever the slot held
                conv0 = torch.where(rb.decode_keep[:, None, None], conv0, 0)
                ssm0 = torch.where(rb.decode_keep[:, None, None, None], ssm0, 0)
            x, conv1 = causal_conv1d_step(qkv[:nd], conv0, weight)
            q, k, v = _split(x[:, None], s)  # [nd, 1, H, D]: one token per sequence
            out, ssm1 = self._recurrent(q, k, v, g=g[:nd, None], beta=beta[:nd, None], scale=scale,
                                        initial_state=ssm0, output_final_state=True, use_qk_l2norm_in_kernel=True)
            core[:nd] = out[:, 0]
            conv_states.index_copy_(0, rb.decode_slots, conv1.to(conv_states.dtype))
            ssm_states.index_copy_(0, rb.decode_slots, ssm1.to(ssm_states.dtype))
        if rb.prefills:
            xs, h0 = [], []
            for start, end, slot, fresh in rb.prefills:
                conv0 = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
                x, conv1 = causal_conv1d(qkv[start:end], conv0, weight)
                conv_states[slot] = conv1.to(conv_states.dtype)
                xs.append(x)
                h0.append(torch.zeros(ssm_states.shape[1:], device=qkv.device) if fresh else ssm_states[slot].float())
            first = rb.prefills[0][0]  # the chunks are the rows after the decodes, back to back
            cu, cu_cpu, slots = _varlen(rb, qkv.device)
            q, k, v = _split(torch.cat(xs)[None], s)  # [1, rows, H, D]
            out, ssm1 = self._chunk(q, k, v, g=g[None, first:], beta=beta[None, first:], scale=scale,
                                    initial_state=torch.stack(h0), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
            core[first:] = out[0]
            ssm_states.index_copy_(0, slots, ssm1.to(ssm_states.dtype))
        return core


def _varlen(rb, device: torch.device):
    """The step's prefill chunks as fla's varlen input: (cu_seqlens on the device, on the CPU, the chunks' slots),
    made once per step and kept on ``rb``: every layer passes the same tensors, so fla's tensor cache reuses the
    chunk indices it derives from them."""
    if getattr(rb, "_fla_varlen", None) is None:
        lens = [0]
        for start, end, _, _ in rb.prefills:
            lens.append(lens[-1] + end - start)
        cu_cpu = torch.tensor(lens, dtype=torch.long)
        slots = torch.tensor([slot for _, _, slot, _ in rb.prefills], dtype=torch.long)
        rb._fla_varlen = (cu_cpu.to(device), cu_cpu, slots.to(device))
    return rb._fla_varlen


def _split(x: torch.Tensor, s):
    """q | k | v channels of x [..., conv_dim] -> q, k [..., Hk, Dk], v [..., Hv, Dv] (contiguous: fla's layout)."""
    q, k, v = x.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
    lead = x.shape[:-1]
    return (q.reshape(*lead, s.num_k_heads, s.head_k_dim).contiguous(),
            k.reshape(*lead, s.num_k_heads, s.head_k_dim).contiguous(),
            v.reshape(*lead, s.num_v_heads, s.head_v_dim).contiguous())
