"""The vision tower (mili/model/vision.py) against transformers' in float32: Qwen3-VL's (merged tokens and DeepStack
features) and Qwen3.5's, on one and two PNG images of different sizes processed by transformers' image processor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mili.model.vision import VisionTower, flatten_patch_weight
from support.vision import KINDS, hf_model, process_images


def load_tower(path, config) -> VisionTower:
    tower = VisionTower(config.vision_config, torch.float32)
    state = {k.removeprefix("model.visual."): v for k, v in load_file(path / "model.safetensors").items()
             if k.startswith("model.visual.")}
    state["patch_embed.proj.weight"] = flatten_patch_weight(state["patch_embed.proj.weight"])
    tower.load_state_dict(state, strict=True)  # every tensor of the checkpoint's tower, and nothing else
    return tower.eval()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 2])
def test_tower_matches_hf(vision_checkpoint, test_images, kind, count):
    hf = hf_model(vision_checkpoint(kind), kind)
    tower = load_tower(vision_checkpoint(kind), hf.config)
    pixels, grid = process_images(test_images[:count])
    assert grid.tolist()[:2] == [[1, 4, 6], [1, 6, 4]][:count]  # (the sizes differ: 64×96, 96×64)
    with torch.no_grad():
        ref = hf.model.get_image_features(pixels, grid)
        ours = tower(pixels, grid.tolist())
    assert ours.tokens_per_image == [len(e) for e in ref.pooler_output]
    assert torch.allclose(ours.embeds, torch.cat(ref.pooler_output), atol=1e-5, rtol=0)
    deepstack = getattr(ref, "deepstack_features", None) or []
    assert len(ours.deepstack) == len(deepstack) == (0 if kind == "qwen3_5_vl" else 2)
    for got, want in zip(ours.deepstack, deepstack):
        assert torch.allclose(got, torch.cat(want), atol=1e-5, rtol=0)
    assert ours.embeds.abs().max() > 1e-2  # (not a trivially small output)
