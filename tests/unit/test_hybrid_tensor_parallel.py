"""Tensor parallelism for the hybrid_checkpoint (Qwen3.5 dense in the hub's layout, Qwen3.5 MoE with fused experts,
Qwen3-Next's fused interleaved projections) on the CPU (gloo, two rank processes): TP=2 gives the TP=1 greedy
tokens in float32, with prompts prefilled in several chunks beside batched decodes; then again through
prefix-cache snapshots and forked samples (state copies every rank makes); a split the linear attention's
heads do not allow is refused by name before anything starts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from support.engine_state import model_runner, runner_parts
from mili import LLM, InvalidRequest, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    # 70 and 100 tokens take several 32-token chunks, the short ones decode beside them
    return [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=g).tolist()} for n in (1, 9, 70, 100)]


def _tokens(outs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outs]


# qwen3_5_hub: the language model under model.language_model.*; qwen3_5_moe_fused: the experts fused per
# projection; qwen3_next: in_proj_qkvz / in_proj_ba interleaved per key head, MoE with a dense layer
@pytest.mark.parametrize("kind", ["qwen3_5_hub", "qwen3_5_moe_fused", "qwen3_next"])
def test_tp2_matches_tp1(hybrid_checkpoint, kind):
    path = str(hybrid_checkpoint(kind))
    prompts = _prompts()
    one = LLM(path, dtype="float32", max_num_batched_tokens=32, page_size=16)
    expected = _tokens(one.generate(prompts, PARAMS, use_tqdm=False))
    full = runner_parts(one).states.caches[0][1].shape
    del one
    two = LLM(path, dtype="float32", max_num_batched_tokens=32, page_size=16, tensor_parallel_size=2)
    try:
        runner = model_runner(two)
        assert runner.tp.size == 2 and len(runner.tp.workers) == 1 and runner.tp.workers[0].is_alive()
        conv, ssm = runner.parts.states.caches[0]  # rank 0's states: half the value heads
        assert ssm.shape[1] * 2 == full[1]
        assert _tokens(two.generate(prompts, PARAMS, use_tqdm=False)) == expected
        two.engine.check_integrity()
        if kind == "qwen3_5_hub":  # again: prefix-cache snapshots copied into slots, and two samples forked
            outs = two.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2),
                                use_tqdm=False)
            assert sum(out.num_cached_tokens for out in outs) > 0
            assert _tokens(outs) == [ref * 2 for ref in expected]
            two.engine.check_integrity()
    finally:
        two.engine.shutdown()
    assert not runner.tp.workers


def test_an_odd_vocabulary_splits(hybrid_checkpoint, tmp_path):
    """A vocabulary that does not divide by two (issue 30, defect b): padded, TP=2 gives the TP=1 tokens."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "odd_vocab"
    shutil.copytree(hybrid_checkpoint("qwen3_5_hub"), path)
    for file in path.glob("*.safetensors"):  # the table and the head cut to 509 rows, as a resize would
        tensors = load_file(file)
        save_file({name: t[:509].clone() if name.endswith(("embed_tokens.weight", "lm_head.weight")) else t
                   for name, t in tensors.items()}, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["vocab_size"] = 509
    (path / "config.json").write_text(json.dumps(config))
    prompts = [{"prompt_token_ids": [t % 509 for t in p["prompt_token_ids"]]} for p in _prompts()]
    one = LLM(str(path), dtype="float32", max_num_batched_tokens=32, page_size=16)
    assert one.engine.model_config.vocab_size == 509
    expected = _tokens(one.generate(prompts, PARAMS, use_tqdm=False))
    del one
    two = LLM(str(path), dtype="float32", max_num_batched_tokens=32, page_size=16, tensor_parallel_size=2)
    try:
        assert two.apply_model(lambda m: m.lm_head.weight.shape[0]) == 255  # half of 509, rounded up
        assert _tokens(two.generate(prompts, PARAMS, use_tqdm=False)) == expected
    finally:
        two.engine.shutdown()


def test_linear_heads_that_do_not_split_are_refused_before_anything_starts(hybrid_checkpoint, tmp_path):
    path = tmp_path / "one_key_head"
    shutil.copytree(hybrid_checkpoint("qwen3_5_hub"), path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(linear_num_key_heads=1, linear_num_value_heads=2)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match="1 linear-attention key heads do not split evenly") as e:
        LLM(str(path), dtype="float32", tensor_parallel_size=2)
    assert e.value.param == "tensor_parallel_size"
