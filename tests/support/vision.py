"""Tiny random image-capable checkpoints built with transformers' own classes (Qwen3-VL dense, Qwen3.5 with its
vision tower), the test images (PNG files drawn here), and transformers' image processor (PIL backend) over them.

The vocabulary is 512 ids, so the image tokens are ids 498-500 (vision start, vision end, image pad) rather than
the real tokenizer's; a prompt's image tokens are laid out as Qwen3-VL's processor lays them out: vision start,
one image-pad per merged token, vision end. ``build_chat_vision_checkpoint`` is the exception: a Qwen3-VL on the real
Qwen3 vocabulary and tokenizer (its image tokens 151652-151656), for the server's chat routes."""

from __future__ import annotations

from pathlib import Path

import torch

from support.checkpoints import DATA, add_tokenizer

VISION_START, VISION_END, IMAGE, VIDEO = 498, 499, 500, 501
TOKEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
                 vision_end_token_id=VISION_END)
# patch 16, merge 2: a 64×96 image is a 4×6 patch grid, 2×3 = 6 tokens
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
# the hybrid: 3 Gated DeltaNet layers + 1 gated attention; a quarter of each 32-wide head rotated (4 frequencies)
HYBRID_TEXT = dict(TEXT, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1], "mrope_interleaved": True})
# the real Qwen3 tokenizer's vision tokens (<|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>)
REAL_VOCAB = 151936
REAL_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                      vision_end_token_id=151653)
KINDS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_vl")
# Qwen3-VL MoE: 4 experts of 48 (2I = 96 is not the hidden 64: the hub's transposed layout is told by its shape),
# the middle layer dense
MOE = dict(moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1])
IMAGE_SIZES = [(64, 96), (96, 64)]  # (height, width)


def _model(kind: str, real_vocab: bool = False):
    import transformers as tf

    if real_vocab:  # the real tokenizer's ids, the embedding tied to the lm_head (one 151,936 × 64 matrix)
        text = dict(TEXT, vocab_size=REAL_VOCAB, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                     "mrope_interleaved": True})
        return tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(
            text_config=text, vision_config=dict(VISION, deepstack_visual_indexes=[0, 1]), tie_word_embeddings=True,
            **REAL_TOKEN_IDS))
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                           "mrope_interleaved": True})
        vision = dict(VISION, deepstack_visual_indexes=[0, 1])
        if kind == "qwen3_vl_moe":
            return tf.Qwen3VLMoeForConditionalGeneration(tf.Qwen3VLMoeConfig(
                text_config=dict(text, **MOE), vision_config=vision, tie_word_embeddings=False, **TOKEN_IDS))
        return tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=False, **TOKEN_IDS))
    return tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=HYBRID_TEXT, vision_config=VISION,
                                                               tie_word_embeddings=False, **TOKEN_IDS))


def build_vision_checkpoint(path: Path, kind: str, seed: int = 0, weight_scale: float = 4.0,
                            real_vocab: bool = False) -> Path:
    """A random ``kind`` checkpoint (see KINDS): the matrices scaled up (the tower's q/k/v most, so that its
    attention is far from uniform and its rotary positions count) and the norms randomised (the tower's
    LayerNorms start at exactly 1 and 0), so that neither the tower's output nor the logits are flat.
    ``real_vocab`` (Qwen3-VL dense only): on the real Qwen3 vocabulary, for ``build_chat_vision_checkpoint``."""
    torch.manual_seed(seed)
    model = _model(kind, real_vocab).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                if "norm" in name:
                    p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.2, 0.2)
                elif name.endswith("bias"):
                    p.uniform_(-0.1, 0.1)
                elif name.endswith("attn.qkv.weight"):  # sharp attention: the 2-D rotary positions matter
                    p.mul_(4 * weight_scale)
                elif p.dim() >= 2 and "pos_embed" not in name:
                    p.mul_(weight_scale)
                continue
            if p.dim() >= 2 and "embed" not in name and "conv1d" not in name:
                p.mul_(weight_scale)
            elif name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5) if kind == "qwen3_5_vl" else p.uniform_(0.5, 1.5)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
    model.save_pretrained(path)
    if kind == "qwen3_vl_moe":
        _hub_experts(path)
    return path


def build_chat_vision_checkpoint(path: Path) -> Path:
    """A tiny random Qwen3-VL (dense) a server can chat with: the real Qwen3 tokenizer (whose vocabulary holds the
    vision tokens), Qwen3.5's released chat template (it renders an image part as
    ``<|vision_start|><|image_pad|><|vision_end|>``), Qwen3's eos ids, and the image processor's config."""
    import shutil

    build_vision_checkpoint(path, "qwen3_vl", real_vocab=True)
    add_tokenizer(path, chat_template=(DATA / "qwen3.5" / "qwen3.5_chat_template.jinja").read_text())
    shutil.copy(DATA / "qwen3-tokenizer" / "generation_config.json", path / "generation_config.json")
    image_processor().save_pretrained(path)
    return path


def _hub_experts(path: Path) -> None:
    """Qwen3-VL MoE's stacked experts as the hub's releases store them: gate|up [E, H, 2I], down [E, I, H]."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, t in tensors.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            hidden = TEXT["hidden_size"]
            hub = t if (t.shape[1] == hidden) == name.endswith("gate_up_proj") else t.transpose(1, 2)
            tensors[name] = hub.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})

def hf_model(path: Path, kind: str):
    import transformers as tf

    from mili.tools.selftest.parity import hf_torch_paths

    hf_torch_paths()
    cls = {"qwen3_vl": tf.Qwen3VLForConditionalGeneration, "qwen3_vl_moe": tf.Qwen3VLMoeForConditionalGeneration,
           "qwen3_5_vl": tf.Qwen3_5ForConditionalGeneration}[kind]
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def image_processor():
    """transformers' Qwen2-VL image processor (what Qwen3-VL's processor uses), PIL backend, at Qwen3-VL's
    settings: 16-pixel patches, 2 frames a patch, 2×2 merge, mean and std 0.5."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3)


def write_images(folder: Path, sizes=IMAGE_SIZES, seed: int = 0) -> list[Path]:
    """PNG files of random-coloured blocks, one per (height, width)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    paths = []
    for i, (h, w) in enumerate(sizes):
        blocks = torch.randint(0, 256, (h // 8, w // 8, 3), generator=g, dtype=torch.uint8)
        pixels = blocks.repeat_interleave(8, 0).repeat_interleave(8, 1).numpy()
        path = folder / f"image{i}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def process_images(paths: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [patches, 3·2·16·16] and image_grid_thw [N, 3] from the PNG files."""
    from PIL import Image

    out = image_processor()([Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"]


def prompt_with_images(grid_thw: torch.Tensor, text: list[list[int]]) -> list[int]:
    """text[0], image 0's tokens, text[1], image 1's tokens, ..., text[N] (len(text) = images + 1)."""
    ids = list(text[0])
    for (t, h, w), after in zip(grid_thw.tolist(), text[1:]):
        ids += [VISION_START] + [IMAGE] * (t * h * w // 4) + [VISION_END] + list(after)
    return ids
