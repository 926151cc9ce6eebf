"""Qwen3-VL (mili/model/qwen3_vl.py) and Qwen3.5 with its vision tower (mili/model/qwen3_5.py) against transformers
in float32, module calls (no engine): a whole prompt with one or two images of different sizes (every position's
logprobs), and the same prompt prefilled in chunks that split an image, then greedy decodes at M-RoPE's shifted
positions (HF generate's tokens and scores)."""

from __future__ import annotations

import pytest
import torch

from mili.config import ModelConfig
from mili.model.batch import ForwardBatch
from mili.model.checkpoint import load_hf_config
from mili.model.loader import load_weights
from mili.model.mrope import rope_index
from mili.model.qwen3_5 import Qwen3_5ForCausalLM
from mili.model.qwen3_vl import Qwen3VLForConditionalGeneration
from mili.model.vision import chunk_image_rows
from mili.runtime.attention.torch_backend import TorchAttentionBackend
from support.vision import IMAGE, KINDS, hf_model, process_images, prompt_with_images

PAGE = 8
TEXTS = {1: [[5, 17, 301, 42], [7, 7, 90]], 2: [[5, 17], [33, 2, 8], [400, 3, 9, 11]]}


def mili_model(path):
    cfg = ModelConfig.from_hf(load_hf_config(str(path)))
    with torch.device("meta"):
        cls = Qwen3_5ForCausalLM if cfg.is_hybrid else Qwen3VLForConditionalGeneration
        model = cls(cfg, TorchAttentionBackend(), torch.float32)
    model = model.to_empty(device="cpu")
    load_weights(model, str(path))
    model.init_rotary(512, torch.device("cpu"))
    return model.eval()


class Sequence:
    """One prompt's K/V pages and positions, fed to the model a chunk at a time."""

    def __init__(self, model, ids: list[int], pixels, grid):
        cfg = model.config
        self.model, self.ids = model, list(ids)
        pages = (16, PAGE, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = [(torch.zeros(pages), torch.zeros(pages)) for _ in range(cfg.num_attention_layers)]
        shape = getattr(model, "linear_shape", None)  # the hybrid: its recurrent states in slot 1 of 2
        self.states = [(torch.zeros(2, *shape.conv_state_shape()), torch.zeros(2, *shape.ssm_state_shape()))
                       for _ in range(cfg.layer_types.count("linear_attention"))]
        self.pages = torch.tensor([[3, 9, 1, 12, 5, 0, 7, 14, 2, 11, 4, 6, 8, 10, 13, 15]])
        self.positions, self.delta = rope_index(ids, grid.tolist(), IMAGE, 2)
        self.vision = model.encode_images(pixels, grid.tolist())
        self.is_image = torch.tensor(ids) == IMAGE

    def step(self, start: int, end: int, all_logits: bool = False) -> torch.Tensor:
        """Tokens start .. end - 1 (prompt tokens, or decoded ones past it): logits of the last (or every) row."""
        pos = torch.arange(start, end)
        prompt = len(self.is_image)
        images = chunk_image_rows(self.is_image, self.vision, start, end) if start < prompt else None
        # a chunk with images: M-RoPE's 3 rows; otherwise (text, decodes) the one row all three share
        positions = self.positions[:, start:end] if images is not None else \
            (self.positions[0, start:end] if end <= prompt else pos + self.delta)
        n = end - start
        batch = ForwardBatch(torch.tensor(self.ids[start:end]), positions,
                             self.pages[0][pos // PAGE] * PAGE + pos % PAGE, self.pages, [n], [end], int(n == 1),
                             torch.arange(n) if all_logits else torch.tensor([n - 1]), images=images,
                             state_slots=[1])
        with torch.no_grad():
            hidden = self.model(batch, self.kv, self.states) if self.states else self.model(batch, self.kv)
            return self.model.compute_logits(hidden)


def _inputs(images, count):
    pixels, grid = process_images(images[:count])
    ids = prompt_with_images(grid, TEXTS[count])
    return pixels, grid, ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 2])
def test_prompt_logprobs_match_hf(vision_checkpoint, test_images, kind, count):
    checkpoint = vision_checkpoint(kind)
    pixels, grid, ids = _inputs(test_images, count)
    hf = hf_model(checkpoint, kind)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid,
                 mm_token_type_ids=(input_ids == IMAGE).int()).logits[0].log_softmax(-1)
    ours = Sequence(mili_model(checkpoint), ids, pixels, grid).step(0, len(ids), all_logits=True).log_softmax(-1)
    assert (ours - ref).abs().max().item() < 1e-4
    assert ref.exp().max(-1).values.min() < 0.9  # (not a near-one-hot distribution everywhere)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 2])
def test_chunked_prefill_and_decode_match_hf_generate(vision_checkpoint, test_images, kind, count):
    checkpoint = vision_checkpoint(kind)
    pixels, grid, ids = _inputs(test_images, count)
    hf = hf_model(checkpoint, kind)
    input_ids = torch.tensor([ids])
    steps = 6
    with torch.no_grad():
        out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                          image_grid_thw=grid, mm_token_type_ids=(input_ids == IMAGE).int(), max_new_tokens=steps,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    want_tokens, want_scores = out.sequences[0, len(ids):].tolist(), torch.stack(out.scores)[:, 0]
    seq = Sequence(mili_model(checkpoint), ids, pixels, grid)
    first_image = ids.index(IMAGE)
    cuts = [0, first_image + 2, first_image + 5, len(ids)]  # the first image split over three chunks
    for start, end in zip(cuts, cuts[1:]):
        logits = seq.step(start, end)
    tokens = []
    for i in range(steps):
        tokens.append(int(logits.argmax(-1)))
        assert (logits[0].log_softmax(-1) - want_scores[i].log_softmax(-1)).abs().max().item() < 1e-4
        seq.ids.append(tokens[-1])
        logits = seq.step(len(seq.ids) - 1, len(seq.ids))
    assert tokens == want_tokens


def test_text_only_prompts_through_the_engine_match_hf(vision_checkpoint):
    """A Qwen3-VL checkpoint loads in the offline engine (tower included) and serves text: [T] positions, no
    M-RoPE cost, HF's greedy tokens and logprobs (prompts prefilled in chunks, batched)."""
    from support.parity import assert_greedy_matches_hf
    from mili import LLM, SamplingParams

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 498, (n,), generator=g).tolist() for n in (3, 40, 90)]
    checkpoint = vision_checkpoint("qwen3_vl")
    hf = hf_model(checkpoint, "qwen3_vl")
    reference = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True,
                              pad_token_id=0)
        reference.append((out.sequences[0, len(ids):].tolist(), torch.stack(out.scores)[:, 0]))
    llm = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=64, page_size=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_matches_hf(outs, reference, 8)
    assert any(type(m).__name__ == "VisionTower" for m in llm.apply_model(lambda m: m.modules()))


def test_moe_experts_load_from_the_hubs_transposed_layout(vision_checkpoint):
    """Qwen3-VL MoE's releases store gate|up as [E, H, 2I] and down as [E, I, H] (the test checkpoint too): they
    load transposed into MILI's stacked experts (the parity tests above then hold for the MoE kind)."""
    from safetensors.torch import load_file

    stored = load_file(vision_checkpoint("qwen3_vl_moe") / "model.safetensors")
    gate_up = stored["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    down = stored["model.language_model.layers.0.mlp.experts.down_proj"]
    assert tuple(gate_up.shape) == (4, 64, 96) and tuple(down.shape) == (4, 48, 64)
    model = mili_model(vision_checkpoint("qwen3_vl_moe"))
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(experts.w13, gate_up.transpose(1, 2)) and torch.equal(experts.w2, down.transpose(1, 2))
    assert not hasattr(model.model.layers[1].mlp, "experts")  # (mlp_only_layers: the middle layer is dense)
