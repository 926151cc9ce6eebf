"""Decode steps on the CPU as one C call over every decoder layer (``mili_decode_layers`` in kernels/cpu).

The CPU counterpart of the CUDA graphs: on a decode-only batch the model's modules would cross from Python
into a kernel ~15 times a layer, and the Python and torch work between those kernels (module calls, views,
allocations, the KV store) cost about a quarter of a batch-32 step and a seventh of a batch-1 step. Here
the layers are one call running the same kernels in the same order, so the result is bit for bit the
module path's (tested). A speculative verification (a sequence's last token and its drafts) runs here too,
each token a row attending up to its own position as its decode would: the same bits as decoding those
tokens one step at a time. Prefill steps, and models the kernels can't take whole, keep the module path.
"""

from __future__ import annotations

import ctypes

import torch

from mili.kernels.cpu import abi
from mili.kernels.cpu.ops import Int8Pages, KVPages, decode_metadata, grouped_desc, int8_desc, kv_pages, seq_pages
from mili.lora import LoRALinear
from mili.model.cpu_linear import Int4Linear, Int8GroupLinear, Int8Linear, KernelLinear, SplitLinear
from mili.model.batch import ForwardBatch

# a verifying sequence's tokens in one step, at most (its last token and drafts, each a row of the decode kernels)
MAX_QUERY = 16


# mili_kernels.h's descriptors: one linear layer (a chain through ``next``; its LoRA adapters at ``lora``), one layer
LinearDesc, LayerDesc = abi.STRUCTS["mili_linear_desc"], abi.STRUCTS["mili_layer_desc"]
DecodeStep = abi.STRUCTS["mili_decode_step"]  # the step's tokens through the layers


def _linear_desc(layer) -> LinearDesc | None:
    """The kernel's view of a swapped linear layer, or None where the fused step can't take it. A SplitLinear's parts
    are a chain (``next``: each pointer holds its target alive). A LoRALinear's adapters ride on its base layer's
    (``lora``; None where they are not on the kernels)."""
    if isinstance(layer, LoRALinear):
        desc = _linear_desc(layer.base) if layer.desc is not None else None
        if desc is not None:
            desc.lora = ctypes.pointer(layer.desc)
        return desc
    if layer.bias is not None or layer.out_features % 16:
        return None
    if isinstance(layer, SplitLinear):
        descs = [_linear_desc(p) for p in layer.parts]
        if None in descs:
            return None
        for desc, after in zip(reversed(descs[:-1]), reversed(descs[1:])):
            desc.next = ctypes.pointer(after)
        return descs[0]
    if isinstance(layer, KernelLinear):
        return LinearDesc(layer.packed.data_ptr(), None, None, layer.out_features, layer.in_features, 0, 0)
    if isinstance(layer, Int8Linear) and layer.kernel:
        return int8_desc(layer.qweight, layer.scales, layer.column_sums)
    if isinstance(layer, (Int4Linear, Int8GroupLinear)):  # (the int4 and int8g kernels' own descriptor)
        return grouped_desc(layer.qweight, layer.scales, layer.offsets, layer.in_features,
                            (2 if layer.signed else 1) if isinstance(layer, Int8GroupLinear) else 0,
                            getattr(layer, "high_bits", 0))
    return None


def _rows(desc: LinearDesc) -> int:
    """A layer's output features: its parts' together (kernels.c, linear_n)."""
    return desc.n + (_rows(desc.next.contents) if desc.next else 0)


class CpuDecodeRunner:
    """Built over a loaded model whose linear layers are MILI's kernel layers; ``why_not`` says why a
    model can't use it (then the model runner keeps the module path)."""

    def __init__(self, model, lib):
        """``lib``: the plan's library of MILI's CPU kernels (None: none loads)."""
        self.model = model
        self.lib = lib
        self.layers: list[LayerDesc] | ctypes.Array = []
        self._linears: list[list[LinearDesc]] = []
        self.why_not = "" if self.lib is not None else "no CPU kernels"
        if self.lib is not None and model.config.is_moe:
            self.why_not = "a mixture-of-experts model (its layers run as modules, experts on the kernels)"
        for layer in model.model.layers if self.lib is not None and not model.config.is_moe else []:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [_linear_desc(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
            if (None in linears or any(n.weight.dtype != torch.bfloat16 for n in norms) or attn.head_dim % 32
                    or attn.head_dim > 1024):  # (the q/k-norm kernel's bound)
                self.why_not = "a layer the fused kernel can't take (bias, odd sizes or another linear kind)"
                self.layers = []
                break
            self._linears.append(linears)  # (a split layer's chain: kept alive for the C side)
            self.layers.append(LayerDesc(
                layer.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                mlp.down_proj.in_features, layer.input_layernorm.eps, attn.head_dim ** -0.5,
                *(n.weight.data_ptr() for n in norms), *linears))
        if self.layers:  # one array: mili_decode_layers runs them all in one call
            self.layers = (LayerDesc * len(self.layers))(*self.layers)
        self._kv_pages: tuple[int, object] | None = None
        # the model's LoRA adapters' step (which slot each row runs), where it has them
        self.lora_step = next((m.step for m in model.modules() if isinstance(m, LoRALinear)), None)
        self.work_per_token = 0
        if self.layers:
            d = self.layers[0]
            self.work_per_token = (2 * d.hidden + _rows(d.qkv) + d.q_heads * d.head_dim + _rows(d.gate_up) + d.inter)

    def _pages(self, kv_caches: list[tuple]):
        """Each layer's pages as the kernels read them (mili_kv_pages [layers], for mili_decode_layers), made again
        only if the caches are not the ones they were made from."""
        first = kv_caches[0][0]
        key = (first.values if isinstance(first, Int8Pages) else first).data_ptr()
        if self._kv_pages is None or self._kv_pages[0] != key:
            self._kv_pages = (key, (KVPages * len(kv_caches))(*(kv_pages(k, v) for k, v in kv_caches)))
        return self._kv_pages[1]

    @property
    def available(self) -> bool:
        return bool(self.layers)

    def run(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor | Int8Pages, torch.Tensor | Int8Pages]],
            verifying: bool = False) -> torch.Tensor | None:
        """The final hidden states of the rows in ``batch.logits_indices`` for a decode-only batch, or with
        ``verifying`` one whose chunks are speculative decoding's verifications (at most ``MAX_QUERY`` tokens a
        sequence); else None."""
        t = batch.input_ids.shape[0]
        if not self.layers or max(batch.query_lens) > (MAX_QUERY if verifying else 1):
            return None
        if isinstance(kv_caches[0][0], Int8Pages) and self.layers[0].head_dim > 512:  # (the int8 kernel's bound)
            return None
        h = self.model.model.embed_tokens(batch.input_ids).contiguous()
        residual = torch.empty_like(h)
        cos, sin = (c.contiguous() for c in self.model.rotary.lookup(batch.positions))
        work = torch.empty(t * self.work_per_token, dtype=torch.bfloat16)
        slots = batch.slot_mapping.contiguous()
        if t == batch.num_seqs:
            table, lens = decode_metadata(batch.page_table, batch.context_lens, t)
        else:  # a row per token, attending up to its own index (every row's K/V is stored first; the index, not
            # the position: M-RoPE's positions past an image are not the indices)
            table = batch.page_table.repeat_interleave(torch.tensor(batch.query_lens), dim=0).to(torch.int64)
            lens = torch.cat([torch.arange(c - q + 1, c + 1) for q, c in zip(batch.query_lens, batch.context_lens)])
        threads = torch.get_num_threads()
        lora = self.lora_step.slots.data_ptr() if self.lora_step is not None and self.lora_step.active else None
        step = DecodeStep(h.data_ptr(), residual.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                          work.data_ptr(), lora, t)
        self.lib.mili_decode_layers(self.layers, self._pages(kv_caches), len(self.layers),
                                    ctypes.byref(seq_pages(table, lens)), ctypes.byref(step), threads)
        rows = batch.logits_indices
        return self.model.model.norm(h[rows], residual[rows])[0]
