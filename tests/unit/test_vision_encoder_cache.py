"""The encoder cache (runtime/encoder_cache.py) and the image limits: the vision tower runs once per distinct image
across chunked prefill, requests that share an image after different text, and preemption by recompute, with the
outputs of the path that shares nothing (greedy tokens and logprobs within 1e-5, float32); the cache stays within
its budget (evictions past it, no claim left once requests end); a text-only request costs no tower call and no
image work in a step; ``limit_mm_per_prompt`` refuses extra images in the core, and at 0 skips the tower."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from mili import LLM, SamplingParams
from mili.config import EngineConfig
from mili.errors import InvalidRequest
from mili.runtime.encoder_cache import EncodedImage, EncoderCache, VisionBudget, output_bytes_per_token
from test_vision_engine import image_prompt, images  # noqa: F401 (the fixture)
from support.engine_state import engine_core, runner_parts
from support.vision import TEXT

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def _count_images(llm) -> list[int]:
    """The number of images each tower call encodes, as the calls come."""
    model, encoded = llm.apply_model(lambda m: m), []
    encode = model.encode_images
    model.encode_images = lambda pixels, grid: encoded.append(len(grid)) or encode(pixels, grid)
    return encoded


def _assert_same(got, want) -> None:
    """The same greedy tokens, their logprobs within 1e-5 (float32)."""
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in (g, w)]
        assert max(abs(a - b) for a, b in zip(*logprobs)) < 1e-5


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5_vl"])
def test_the_tower_runs_once_per_distinct_image(vision_checkpoint, images, kind):
    """Three requests over two images (the first image after three different texts, the second in chunks of 4
    beside it): two images encoded; each request's tokens and logprobs as a lone request's, with nothing cached."""
    cases = [(images[:1], [[5, 17, 301], [7, 90]]), (images[:1], [[6, 2], [7, 90, 4]]),
             (images[1:2] + images[:1], [[8], [33, 2], [400, 3]])]
    prompts = [image_prompt(paths, texts) for paths, texts in cases]
    alone = LLM(str(vision_checkpoint(kind)), dtype="float32", enable_prefix_caching=False, encoder_cache_tokens=0)
    alone_count = _count_images(alone)
    want = [alone.generate([p], PARAMS, use_tqdm=False)[0] for p in prompts]
    assert sum(alone_count) == 4  # (nothing kept between requests)
    llm = LLM(str(vision_checkpoint(kind)), dtype="float32", max_num_batched_tokens=4, page_size=4)  # chunks cut images
    count = _count_images(llm)
    got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert sum(count) == 2
    _assert_same(got, want)
    cache = runner_parts(llm).encoder_cache
    assert cache.num_hits > 0 and not cache.claims and len(cache.entries) == 2
    llm.engine.check_integrity()


def test_a_preempted_request_reuses_its_images(vision_checkpoint, images):
    """A KV pool too small for four requests over three images: preempted ones are recomputed from their prompt
    without the tower (three images encoded in all), and each writes a lone request's tokens and logprobs."""
    cases = [(images[i % 3:i % 3 + 1], [[5 + i, 17], [7, 90 + i, 3]]) for i in range(4)]
    prompts = [image_prompt(paths, texts) for paths, texts in cases]
    alone = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32", enable_prefix_caching=False, encoder_cache_tokens=0)
    want = [alone.generate([p], PARAMS, use_tqdm=False)[0] for p in prompts]
    llm = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32", max_num_batched_tokens=16, page_size=4, num_kv_pages=10,
              enable_prefix_caching=False)
    count = _count_images(llm)
    got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0 and sum(count) == 3
    _assert_same(got, want)
    llm.engine.check_integrity()


def _run_steps(llm, prompts) -> int:
    """Run ``prompts`` step by step (integrity checked after each); the most tokens the encoder cache held."""
    engine, most = llm.engine, 0
    cache = runner_parts(engine).encoder_cache  # (its occupancy: nothing public shows it)
    for p in prompts:
        engine.add_request(p["prompt_token_ids"], PARAMS, images=p["multi_modal_data"]["image"])
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, cache.num_tokens)
        engine.check_integrity()
    return most


def test_the_cache_stays_within_its_budget(vision_checkpoint, images):
    """A budget of two images (12 tokens): a third evicts the least recently used, which is encoded again when it
    comes back. A budget smaller than one image (4 of 6 tokens): the image a chunk cuts is kept (claimed) for the
    next chunk, so it is still encoded once, then goes as soon as it is computed. No claim is left at the end."""
    kwargs = dict(dtype="float32", max_num_batched_tokens=8, page_size=4, enable_prefix_caching=False)
    llm = LLM(str(vision_checkpoint("qwen3_vl")), encoder_cache_tokens=12, **kwargs)
    cache, count = runner_parts(llm).encoder_cache, _count_images(llm)
    for i in (0, 2, 0, 1, 2):  # (0 is used again: 2 goes for 1, then 0 for 2)
        assert _run_steps(llm, [image_prompt(images[i:i + 1], [[5, 17], [7]])]) <= 12
    assert sum(count) == 4 and cache.num_evictions == 2 and len(cache.entries) == 2 and not cache.claims
    small = LLM(str(vision_checkpoint("qwen3_vl")), encoder_cache_tokens=4, **kwargs)
    cache, count = runner_parts(small).encoder_cache, _count_images(small)
    for i in (0, 2, 0):  # (11 tokens, the image at 3 .. 8: the first chunk of 8 cuts it)
        assert _run_steps(small, [image_prompt(images[i:i + 1], [[5, 17], [7]])]) == 6  # (over the budget, claimed)
        assert cache.num_tokens == 0 and not cache.claims
    assert sum(count) == 3 and cache.num_evictions == 3


def test_a_text_only_request_pays_nothing_for_the_tower(vision_checkpoint, images, monkeypatch):
    """No tower call and no StepImages (the per-step image work) for text-only steps, beside an image-capable
    model; the first request with an image makes them."""
    import mili.runtime.input_batch as input_batch

    made = []
    step_images = input_batch.StepImages
    monkeypatch.setattr(input_batch, "StepImages", lambda *args: made.append(1) or step_images(*args))
    llm = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32")
    count = _count_images(llm)
    llm.generate([{"prompt_token_ids": [5, 17, 301, 42]}], PARAMS, use_tqdm=False)
    assert not count and not made
    llm.generate([image_prompt(images[:1], [[5, 17], [7]])], PARAMS, use_tqdm=False)
    assert count == [1] and made


def test_the_core_refuses_images_past_the_limit(vision_checkpoint, images):
    """limit_mm_per_prompt image 1: a request with two images is refused by the core itself (InvalidRequest), even
    when it was made by an input processor that allowed it; one image passes."""
    from mili.engine.input_processor import InputProcessor

    llm = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32", limit_mm_per_prompt={"image": 1})
    two = image_prompt(images[:2], [[5], [7], [9]])
    with pytest.raises(InvalidRequest, match="at most 1|limit"):
        llm.generate([two], PARAMS, use_tqdm=False)
    lenient = InputProcessor(dataclasses.replace(llm.engine.config, limit_mm_per_prompt={"image": 4}))
    lenient.core_info = llm.engine.inputs.core_info
    add = lenient.make_request(two["prompt_token_ids"], PARAMS, "two", two["multi_modal_data"]["image"])
    with pytest.raises(InvalidRequest, match="at most 1 are allowed"):
        engine_core(llm).add_request(add)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([image_prompt(images[:1], [[5], [7]])], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_a_limit_of_zero_images_skips_the_tower(vision_checkpoint, images):
    """limit_mm_per_prompt image 0 (vLLM's way to serve a VL checkpoint as text): the tower is not loaded, images
    are refused, text is served."""
    llm = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32", limit_mm_per_prompt={"image": 0})
    assert llm.apply_model(lambda m: m.visual) is None and runner_parts(llm).encoder_cache is None
    with pytest.raises(InvalidRequest, match="takes no images"):
        llm.generate([image_prompt(images[:1], [[5], [7]])], PARAMS, use_tqdm=False)
    assert llm.generate([{"prompt_token_ids": [5, 17, 301]}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_the_cache_evicts_least_recently_used_unclaimed_entries():
    cache = EncoderCache(budget_tokens=10)

    def entry(n):
        return EncodedImage(embeds=torch.zeros(n, 2), deepstack=[])

    owner = object()
    cache.put(1, entry(4))
    cache.put(2, entry(4))
    cache.get(1)  # 2 is now the least recently used
    cache.put(3, entry(4))
    assert list(cache.entries) == [1, 3] and cache.num_evictions == 1
    cache.claim(1, owner, 0)
    cache.put(4, entry(8))  # 3 goes; 1 is claimed; 4 itself goes too (still over)
    assert list(cache.entries) == [1] and cache.num_tokens == 4
    cache.claim(5, owner, 1)  # claimed before it is encoded: kept though the cache is over its budget
    cache.put(5, entry(8))
    assert list(cache.entries) == [1, 5]
    cache.check_integrity(alive=lambda o: o is owner)
    cache.release_all(owner)
    assert not cache.claims and list(cache.entries) == [5] and cache.num_tokens == 8
    cache.check_integrity(alive=lambda o: False)


def test_the_start_up_budget_follows_the_processor_and_the_limits(tmp_path):
    """A Qwen3-VL-2B-shaped tower, its processor's largest image 16,777,216 pixels (16,384 tokens of 32×32 pixels):
    one image a tower call, the cache one such image; capped by max_model_len; smaller images grouped up to
    max_num_batched_tokens, at most the limit's count."""
    vision = SimpleNamespace(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                             hidden_size=1024, intermediate_size=4096, out_hidden_size=2048,
                             deepstack_visual_indexes=[5, 11, 17])
    model_config = SimpleNamespace(vision_config=vision)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 16777216}}))
    # (the config as the engine core hands it on: the plan's batch limits in auto's place, the CPU's 2048 tokens)
    config = EngineConfig(model=str(tmp_path), device="cpu", max_num_batched_tokens=2048)
    plan = VisionBudget.plan(config, model_config, str(tmp_path), torch.bfloat16, max_model_len=262144)
    assert (plan.max_image_tokens, plan.tokens_per_call, plan.cache_tokens) == (16384, 16384, 16384)
    assert output_bytes_per_token(vision, torch.bfloat16) == 4 * 2048 * 2
    assert plan.reserve_bytes > 16384 * output_bytes_per_token(vision, torch.bfloat16)
    short = VisionBudget.plan(config, model_config, str(tmp_path), torch.bfloat16, max_model_len=4096)
    assert short.max_image_tokens == 4096
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 200704}}))  # 196 tokens
    for limit, per_call in ((4, 4 * 196), (20, 10 * 196)):
        config = EngineConfig(model=str(tmp_path), device="cpu", limit_mm_per_prompt={"image": limit},
                              max_num_batched_tokens=2048)
        plan = VisionBudget.plan(config, model_config, str(tmp_path), torch.bfloat16, max_model_len=262144)
        assert plan.tokens_per_call == per_call and plan.cache_tokens == 2048


def test_the_cpu_warns_when_the_pool_and_the_tower_exceed_the_memory(vision_checkpoint, monkeypatch, caplog):
    """The CPU's pool is a fixed size: the tower's planned memory is not taken out of it, but a start-up whose pool
    and tower plan exceed MemAvailable says so."""
    import logging

    import mili.runtime.encoder_cache as encoder_cache

    monkeypatch.setattr(encoder_cache, "available_host_memory", lambda: 1 << 20)
    with caplog.at_level(logging.INFO, logger="mili"):
        llm = LLM(str(vision_checkpoint("qwen3_vl")), dtype="float32", kv_cache_memory=4 << 20)
    assert "exceed the memory available (1 MiB)" in caplog.text and "vision tower: images up to" in caplog.text
    page_bytes = 2 * TEXT["num_hidden_layers"] * 16 * TEXT["num_key_value_heads"] * TEXT["head_dim"] * 4  # K and V
    assert llm.engine.stats().num_pages == (4 << 20) // page_bytes  # (the whole budget: nothing taken out)
