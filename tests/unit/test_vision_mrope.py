"""M-RoPE (mili/model/mrope.py, the rotary table's [3, T] lookup) against transformers: the 3×T position ids and
decode delta of prompts with one and two images (get_rope_index), and the interleaved cos/sin of Qwen3-VL's
text rotary and Qwen3.5's partial one."""

from __future__ import annotations

import pytest
import torch

from mili.model.layers import RotaryEmbedding
from mili.model.mrope import decode_positions, rope_index
from support.vision import IMAGE, KINDS, hf_model, prompt_with_images

GRIDS = [[1, 4, 6], [1, 6, 4], [1, 8, 2]]
TEXTS = {  # text around the images: before, between, after (empty runs: an image first or last)
    1: [[[5, 6, 7], [8, 9]], [[], [3]], [[4, 4], []]],
    2: [[[5, 6, 7], [8], [9, 10, 11]], [[], [], []], [[1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2]]],
}


@pytest.fixture(scope="module")
def models(vision_checkpoint):
    return {kind: hf_model(vision_checkpoint(kind), kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 2])
def test_rope_index_matches_hf(models, kind, count):
    hf = models[kind]
    for texts, grids in [(t, GRIDS[:count]) for t in TEXTS[count]] + [(TEXTS[count][0], GRIDS[1:1 + count])]:
        grid = torch.tensor(grids)
        ids = prompt_with_images(grid, texts)
        positions, delta = rope_index(ids, grids, IMAGE, 2)
        want, want_delta = hf.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == IMAGE).int(), grid)
        assert torch.equal(positions, want[:, 0])
        assert delta == int(want_delta) < 0
        # decoding: HF's positions past the prompt are the index plus its cached delta on all three axes
        assert torch.equal(decode_positions(len(ids), 3, delta),
                           torch.arange(len(ids), len(ids) + 3).expand(3, 3) + want_delta[0, 0])


def test_rope_index_refuses_mismatched_images():
    ids = prompt_with_images(torch.tensor([GRIDS[0]]), [[1], [2]])
    with pytest.raises(ValueError, match="more image tokens"):
        rope_index(ids + ids, [GRIDS[0]], IMAGE, 2)
    with pytest.raises(ValueError, match="more images"):
        rope_index(ids, GRIDS[:2], IMAGE, 2)
    with pytest.raises(ValueError, match="fewer in a row"):
        rope_index(ids, [[1, 8, 4]], IMAGE, 2)  # 8 tokens where the prompt has 6


@pytest.mark.parametrize("kind", KINDS)
def test_mrope_cos_sin_match_hf(models, kind):
    hf = models[kind]
    text = hf.config.text_config
    ids = prompt_with_images(torch.tensor(GRIDS[:2]), [[5, 6], [7], [8, 9]])
    positions, _ = rope_index(ids, GRIDS[:2], IMAGE, 2)
    ours = RotaryEmbedding(text, 256, torch.device("cpu"))
    cos, sin = ours.lookup(positions)
    want_cos, want_sin = hf.model.language_model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[:, None])
    assert cos.shape == want_cos[0].shape  # (Qwen3.5: the rotated quarter of each head only)
    assert torch.allclose(cos, want_cos[0], atol=1e-6, rtol=0) and torch.allclose(sin, want_sin[0], atol=1e-6, rtol=0)
    assert not torch.allclose(cos, ours.lookup(positions[0])[0])  # (the image's rows and columns do rotate)
    # text only: [T] positions read the plain table, the same as three equal rows
    plain = torch.arange(40)
    assert all(torch.equal(a, b) for a, b in zip(ours.lookup(plain), ours.lookup(plain.expand(3, -1))))
