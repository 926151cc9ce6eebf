"""Qwen3-VL (Qwen3VLForConditionalGeneration, and the MoE Qwen3VLMoeForConditionalGeneration: qwen3.py's experts,
the top k always renormalised): the Qwen3 decoder of qwen3.py with images in, in one short file.

What differs from the text model, as transformers computes it:

- the image tokens' embeddings are the vision tower's output (model/vision.py), one row per merged patch block;
- positions are M-RoPE (model/mrope.py): a step with image tokens passes [3, T] positions, any other [T];
- DeepStack: after decoder layer i < len(deepstack), the tower's i-th DeepStack features are added to the hidden
  states at the image tokens.

The step's image rows come in ``batch.images`` (model/batch.py ImageRows); the tower runs beforehand
(``encode_images``), once per distinct image (runtime/encoder_cache.py), so a prompt prefilled in chunks takes each
chunk's share of its rows.

Checkpoint layout (the hub's): ``model.language_model.*`` is the decoder (loaded as ``model.*``), ``model.visual.*``
the tower (``visual.*``; the patch embedding's Conv3d kernel flattened into a linear weight), ``lm_head.weight``.
The same tower serves the hub's Qwen3.5 / 3.6 checkpoints (model/qwen3_5.py, which has no DeepStack).
"""

from __future__ import annotations

import torch

from mili.config import ModelConfig
from mili.kernels.reference import TorchOps
from mili.model.batch import AttentionBackend, ForwardBatch
from mili.model.qwen3 import Qwen3ForCausalLM
from mili.model.vision import VisionOutput, VisionTower, flatten_patch_weight


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, ops=TorchOps,
                 vision: bool = True):
        """``vision`` False: no tower (its tensors are not loaded), text only (EngineConfig.language_model_only)."""
        super().__init__(cfg, backend, dtype, ops)
        self.visual = VisionTower(cfg.vision_config, dtype) if vision else None

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionOutput:
        """The tower over the image processor's output for one or more images (their tokens in order)."""
        return self.visual(pixel_values.to(self.visual.pos_embed.weight.device), grid_thw)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The final hidden states of the rows in ``batch.logits_indices``: [S, hidden]."""
        h, residual = self.model.embed_tokens(batch.input_ids), None
        images = batch.images
        if images is not None:
            h = h.index_copy(0, images.rows, images.embeds.to(h.dtype))
        cos_sin = self.rotary.lookup(batch.positions)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches)):
            h, residual = layer(h, residual, batch, cos_sin, k_cache, v_cache)
            if images is not None and i < len(images.deepstack):  # (h + residual is the layer's output)
                h = h.index_add(0, images.rows, images.deepstack[i].to(h.dtype))
        rows = batch.logits_indices
        return self.model.norm(h[rows], residual[rows])[0]

    # -- checkpoint layout (the loader asks) -------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        if name.startswith("model.visual."):
            return name.removeprefix("model.") if self.visual is not None else None
        return name

    def reorder_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tower's Conv3d kernel flattened; Qwen3-VL MoE's stacked experts, which the hub stores transposed
        (gate|up [E, H, 2I], down [E, I, H]), as MILI's [E, 2I, H] and [E, H, I]: transposed where the shape
        asks for it, as transformers does (a checkpoint that transformers 5 wrote may hold either)."""
        if name == "visual.patch_embed.proj.weight":
            return flatten_patch_weight(tensor)
        cfg = self.config
        if name.endswith(".mlp.experts.gate_up_proj"):
            want = (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        elif name.endswith(".mlp.experts.down_proj"):
            want = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        else:
            return tensor
        if tuple(tensor.shape) != want and tuple(tensor.shape) == (want[0], want[2], want[1]):
            return tensor.transpose(1, 2).contiguous()
        return tensor
