"""Images through the offline engine (Qwen3-VL and Qwen3.5 with its vision tower) against transformers' generate in
float32: prompts naming one or two PNG images of different sizes (one image-pad token each, as vLLM's prompts),
the images processed by transformers' image processor (the checkpoint's preprocessor_config.json); greedy tokens
and logprobs as HF's, prefilled in chunks that split the images, batched beside a text-only prompt; prompt
logprobs within 1e-4; the prefix cache reused for the same image and never for another one at the same tokens."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from support.parity import assert_greedy_matches_hf
from mili import LLM, SamplingParams
from mili.errors import InvalidRequest
from mili.runtime.plan import AttentionBackend
from support.vision import (IMAGE, KINDS, VISION_END, VISION_START, hf_model,
                                process_images, prompt_with_images, write_images)

MAX_TOKENS = 8
TEXTS = [[[5, 17, 301, 42], [7, 7, 90]], [[5, 17], [33, 2, 8], [400, 3, 9, 11]]]  # around one image, two images


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    return write_images(folder) + write_images(folder / "..", sizes=[(64, 96)], seed=5)  # the third: other pixels


def _placeholders(texts: list[list[int]]) -> list[int]:
    """The prompt as a user writes it: one image-pad token per image."""
    ids = list(texts[0])
    for after in texts[1:]:
        ids += [VISION_START, IMAGE, VISION_END] + list(after)
    return ids


def _reference(hf, paths, texts):
    """HF generate over the expanded prompt: (greedy tokens, scores [steps, vocab]), and the prompt's logits."""
    if not paths:
        ids = torch.tensor([texts[0]])
        extra = {}
    else:
        pixels, grid = process_images(paths)
        ids = torch.tensor([prompt_with_images(grid, texts)])
        extra = dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0, **extra)
        logits = hf(input_ids=ids, **extra).logits[0]
    return ids[0].tolist(), (out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.scores)[:, 0]), logits


def image_prompt(paths, texts):
    prompt = {"prompt_token_ids": _placeholders(texts)}
    if paths:
        prompt["multi_modal_data"] = {"image": [Image.open(p) for p in paths]}
    return prompt


@pytest.mark.parametrize("kind", KINDS)
def test_images_match_hf_generate(vision_checkpoint, images, kind):
    hf = hf_model(vision_checkpoint(kind), kind)
    cases = [(images[:1], TEXTS[0]), (images[:2], TEXTS[1]), ([], [[9, 8, 7, 6, 5, 4, 3, 2, 1, 20, 30]])]
    refs = [_reference(hf, paths, texts) for paths, texts in cases]
    llm = LLM(str(vision_checkpoint(kind)), dtype="float32", max_num_batched_tokens=8, page_size=4)  # chunks split images
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = llm.generate([image_prompt(paths, texts) for paths, texts in cases], params, use_tqdm=False)
    assert_greedy_matches_hf(outs, [ref for _, ref, _ in refs], MAX_TOKENS)
    for out, (ids, _, logits) in zip(outs, refs):
        assert out.prompt_token_ids == ids  # (the placeholders expanded as HF's processor does)
        got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        want = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (got - want).abs().max().item() < 1e-4
    llm.engine.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_keys_images_by_content(vision_checkpoint, images, kind):
    """The same image again hits the cache (its tokens' K/V reused, the same output); another image at the same
    token ids (same size, other pixels) does not, and gets its own output (HF's)."""
    hf = hf_model(vision_checkpoint(kind), kind)
    texts = [[5, 17, 301, 42, 11, 12, 13, 14], [7, 7, 90]]
    llm = LLM(str(vision_checkpoint(kind)), dtype="float32", max_num_batched_tokens=64, page_size=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    first, = llm.generate([image_prompt(images[:1], texts)], params, use_tqdm=False)
    again, = llm.generate([image_prompt(images[:1], texts)], params, use_tqdm=False)
    other, = llm.generate([image_prompt(images[2:3], texts)], params, use_tqdm=False)
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 4  # (all but the last, partial, page)
    # the text before the image at most (two pages of 4; the hybrid hits only where it kept a state snapshot)
    assert other.num_cached_tokens == 8 if kind != "qwen3_5_vl" else other.num_cached_tokens <= 8
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    refs = [_reference(hf, paths, texts)[1] for paths in (images[:1], images[2:3])]
    assert_greedy_matches_hf([first, other], refs, MAX_TOKENS)
    assert refs[0][0] != refs[1][0]  # (the two images do lead to other tokens)
    llm.engine.check_integrity()


def test_images_refused_where_they_cannot_go(vision_checkpoint, images):
    request = image_prompt(images[:1], TEXTS[0])
    from mili.cli import build_parser, engine_kwargs

    assert engine_kwargs(build_parser().parse_args(["serve", "--language-model-only"]))["language_model_only"]
    text_only = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32", language_model_only=True)
    assert text_only.apply_model(lambda m: m.visual) is None  # (its tensors skipped, not loaded)
    with pytest.raises(InvalidRequest, match="takes no images"):
        text_only.generate([request], SamplingParams(max_tokens=1), use_tqdm=False)
    llm = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32")
    with pytest.raises(InvalidRequest, match="1 image placeholders .* for 2 images"):
        llm.generate([{**request, "multi_modal_data": {"image": [Image.open(p) for p in images[:2]]}}],
                     SamplingParams(max_tokens=1), use_tqdm=False)


def test_a_request_with_images_crosses_the_wire(vision_checkpoint, images):
    """The server's path: the API side's AddRequest, msgpack-encoded to the core process, decodes to the same."""
    from mili.engine.messages import encode, input_decoder

    llm = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32")
    add = llm.engine.inputs.make_request(_placeholders(TEXTS[1]), SamplingParams(max_tokens=2), "r",
                                         [Image.open(p) for p in images[:2]])
    assert add.images.grid_thw == [[1, 4, 6], [1, 6, 4]]
    assert len(add.prompt_token_ids) == len(_placeholders(TEXTS[1])) + 10  # 6 + 6 tokens for 2 placeholders
    assert input_decoder.decode(encode(add)) == add


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_puts_the_tower_on_the_cpu_linears(vision_checkpoint, images, kind):
    """In bfloat16 the tower's linears are swapped as the text model's are (MILI's kernel, or packed where it is
    not built), and the output stays near float32's: the first greedy token's logprob within 0.05."""
    from torch import nn

    prompt = image_prompt(images[:2], TEXTS[1])
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    want = LLM(str(vision_checkpoint(kind)), dtype="float32").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(vision_checkpoint(kind)), dtype="bfloat16")
    tower = llm.apply_model(lambda m: m.visual)
    assert not any(type(m) is nn.Linear for m in tower.modules())
    text = next(m for n, m in llm.apply_model(lambda m: m.model.named_modules()) if n.endswith(("o_proj", "out_proj")))
    assert type(tower.blocks[0].attn.qkv) is type(text)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)[0].outputs[0]
    token = want.token_ids[0]
    assert abs(got.logprobs[0][token].logprob - want.logprobs[0][token].logprob) < 0.05


def test_images_on_the_triton_path(vision_checkpoint, images):
    """The Triton attention backend and kernels (TRITON_INTERPRET=1 on the CPU): the rotary kernel takes M-RoPE's
    cos/sin as it takes plain ones; HF's greedy tokens and logprobs, an image split over chunks of 16."""
    pytest.importorskip("triton")
    hf = hf_model(vision_checkpoint("qwen3_vl"), "qwen3_vl")
    cases = [(images[:2], TEXTS[1]), ([], [[9, 8, 7, 6, 5]])]
    refs = [_reference(hf, paths, texts)[1] for paths, texts in cases]
    llm = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32", attention_backend="triton", max_num_batched_tokens=16)
    assert llm.engine.plan.attention is AttentionBackend.TRITON
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([image_prompt(paths, texts) for paths, texts in cases], params, use_tqdm=False)
    assert_greedy_matches_hf(outs, refs, MAX_TOKENS)
    llm.engine.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_preempted_requests_with_images_keep_hfs_tokens(vision_checkpoint, images, kind):
    """A KV pool too small for all of them: requests with images are preempted and recomputed (the tower not run
    again: the encoder cache keeps its output by the image's hash) and still write HF's tokens; no page leaks."""
    hf = hf_model(vision_checkpoint(kind), kind)
    cases = [(images[i % 3:i % 3 + 1], [[5 + i, 17], [7, 90 + i, 3]]) for i in range(4)]
    refs = [_reference(hf, paths, texts)[1] for paths, texts in cases]
    llm = LLM(str(vision_checkpoint(kind)), dtype="float32", max_num_batched_tokens=16, page_size=4, num_kv_pages=14,
              enable_prefix_caching=False)
    engine, model, encoded = llm.engine, llm.apply_model(lambda m: m), []
    encode = model.encode_images
    model.encode_images = lambda pixels, grid: encoded.append(len(grid)) or encode(pixels, grid)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [engine.add_request(r["prompt_token_ids"], params, images=r["multi_modal_data"]["image"])
                for r in (image_prompt(paths, texts) for paths, texts in cases)]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.stats().num_preemptions > 0
    assert sum(encoded) == 3  # once per distinct image (4 requests over 3 images), preemptions notwithstanding
    exact = sum(r.seqs[0].output_token_ids == ref for r, (ref, _) in zip(requests, refs))
    assert exact >= len(cases) - 1
