"""Tensor parallelism on the CPU (gloo, two rank processes): TP=2 gives the TP=1 greedy tokens in float32, a
vocabulary that does not divide by two included (padded as vLLM pads it)."""

from __future__ import annotations

import pytest
import torch

from support.checkpoints import build_checkpoint, build_moe_checkpoint
from support.engine_state import model_runner
from mili import LLM, InvalidRequest, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prompts(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in (1, 9, 40, 70)]


def _resized(src, dst, rows: int):
    """``src`` with its embeddings (and head) resized to ``rows``, as fine-tunes resized to len(tokenizer) are
    (151,669 rows for Qwen3's, which does not divide by 2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.resize_token_embeddings(rows)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory, qwen3_checkpoint):
    root = tmp_path_factory.mktemp("tp")
    return {
        # odd vocabularies (issue 30, defect b): rank 1's shard ends with a zero row, its logit cut
        "odd_vocab_untied": _resized(qwen3_checkpoint("gqa_untied"), root / "odd_untied", 509),
        "odd_vocab_tied": _resized(qwen3_checkpoint("mha_tied"), root / "odd_tied", 383),
        "gqa_untied": qwen3_checkpoint("gqa_untied"),  # 2 KV heads: one a rank
        "mha_tied": qwen3_checkpoint("mha_tied"),  # tied embedding: the head is the vocabulary-split table
        "one_kv_head": build_checkpoint(root / "one_kv", "gqa_untied", num_key_value_heads=1),  # replicated
        "moe": build_moe_checkpoint(root / "moe", num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                    mlp_only_layers=[1]),
    }


@pytest.mark.parametrize("shape", ["gqa_untied", "mha_tied", "one_kv_head", "moe", "odd_vocab_untied",
                                   "odd_vocab_tied"])
def test_tp2_matches_tp1(tp_checkpoints, shape):
    path = str(tp_checkpoints[shape])
    one = LLM(path, dtype="float32", max_num_batched_tokens=32)
    prompts = _prompts(one.engine.model_config.vocab_size)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, PARAMS, use_tqdm=False)]
    two = LLM(path, dtype="float32", max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        runner = model_runner(two)
        assert runner.tp.size == 2 and len(runner.tp.workers) == 1 and runner.tp.workers[0].is_alive()
        cfg = runner.parts.model_config
        assert cfg.num_attention_heads * 2 == one.engine.model_config.num_attention_heads
        vocab = cfg.vocab_size  # the whole vocabulary, each rank holding half of it rounded up
        assert vocab == one.engine.model_config.vocab_size and (vocab % 2 == 1) == shape.startswith("odd")
        assert runner.parts.model.model.embed_tokens.weight.shape[0] == (vocab + 1) // 2
        got = [o.outputs[0].token_ids for o in two.generate(prompts, PARAMS, use_tqdm=False)]
        assert got == expected
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()
    assert not runner.tp.workers


def test_a_model_that_does_not_split_is_refused_before_anything_starts(tp_checkpoints):
    with pytest.raises(InvalidRequest, match="attention heads do not split evenly") as e:
        LLM(str(tp_checkpoints["gqa_untied"]), dtype="float32", tensor_parallel_size=3)
    assert e.value.param == "tensor_parallel_size"
