"""LoRA adapters on the hybrid Qwen3.5 / 3.6 and Qwen3-Next (Gated DeltaNet + gated attention), in float32 against
PEFT's own model of the same adapter: greedy tokens equal and logprobs within 1e-4 (vLLM's issue #49354: there,
adapters on these models change nothing). The adapters target the gated attention (q_proj holds each head's query
and its gate), the Gated DeltaNet projections (Qwen3.5's in_proj_qkv / z / b / a, Qwen3-Next's interleaved
in_proj_qkvz / ba) and out_proj, and the dense MLP."""

from __future__ import annotations

import shutil

import pytest
import torch

from mili import InvalidRequest, LLM, LoRARequest, SamplingParams
from support.engine_state import assert_drained
from support.lora import assert_kernel_products_match, build_adapter, cached_runs, check_outputs
from support.parity import hf_greedy

PROMPTS = [[5, 17, 99, 3, 250, 40, 11], [400, 2, 3], list(range(30, 70))]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# the Gated DeltaNet's projections as each family's checkpoints name them
DELTANET = {"qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
            "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj")}
# (PEFT maps gate/up/down_proj on an MoE model to its experts: the MoE kinds' adapters leave the MLP out)
TARGETS = {"qwen3_5": ATTENTION + DELTANET["qwen3_5"] + ("gate_proj", "up_proj", "down_proj"),
           "qwen3_5_moe": ATTENTION + DELTANET["qwen3_5"], "qwen3_next": ATTENTION + DELTANET["qwen3_next"]}


def _prompts(indices=range(3)):
    return [{"prompt_token_ids": PROMPTS[i]} for i in indices]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hybrid_adapters_match_peft(tmp_path, hybrid_checkpoint, kind):
    base = hybrid_checkpoint(kind)
    reference = build_adapter(base, tmp_path / "a", 1, targets=TARGETS[kind], std=0.1)
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=LoRARequest("a", 1, str(tmp_path / "a")))
    check_outputs(outs, hf_greedy(reference, PROMPTS, 8))
    plain = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    assert all(p.outputs[0].token_ids != o.outputs[0].token_ids for p, o in zip(plain, outs))  # it changes them
    assert_drained(llm)


def test_a_mixed_hybrid_batch_equals_each_alone_and_the_caches_know_the_adapter(tmp_path, hybrid_checkpoint):
    """Qwen3.5: two adapters (one on the Gated DeltaNet alone, at rank 8 with rsLoRA) and the base model in one
    batch equal each run alone; a prompt's KV and recurrent-state snapshots are reused under its own adapter only."""
    base = hybrid_checkpoint("qwen3_5")
    refs = {"a": build_adapter(base, tmp_path / "a", 1, targets=TARGETS["qwen3_5"], std=0.1),
            "b": build_adapter(base, tmp_path / "b", 2, rank=8, targets=DELTANET["qwen3_5"], rslora=True, std=0.1)}
    requests = {name: LoRARequest(name, i, str(tmp_path / name)) for i, name in enumerate(refs, 1)}
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, page_size=4)
    expected = {name: hf_greedy(ref, PROMPTS, 8) for name, ref in refs.items()}
    names = ["a", "b", None] * 3
    mixed = llm.generate([_prompts()[i // 3] for i in range(9)], PARAMS, use_tqdm=False,
                         lora_request=[requests[n] if n else None for n in names])
    alone = {None: llm.generate(_prompts(), PARAMS, use_tqdm=False)}
    for name in refs:
        check_outputs([o for o, n in zip(mixed, names) if n == name], expected[name])
    assert [o.outputs[0].token_ids for o, n in zip(mixed, names) if n is None] == [
        o.outputs[0].token_ids for o in alone[None]]
    llm.engine.reset_prefix_cache()
    again, other = cached_runs(llm, _prompts([2])[0], PARAMS, requests["a"], requests["b"])
    check_outputs([again], expected["a"][2:])
    check_outputs([other], expected["b"][2:])
    assert_drained(llm)


def test_merged_qwen3_next_weights_give_the_same_tokens(tmp_path, hybrid_checkpoint):
    """PEFT's merge_and_unload() of a Qwen3-Next adapter (its fused projections interleaved per key head, as MILI
    reorders them at load), saved as a checkpoint: MILI on the merged weights and on the base with the adapter agree."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = hybrid_checkpoint("qwen3_next")
    build_adapter(base, tmp_path / "a", 3, targets=TARGETS["qwen3_next"], std=0.1)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "a")
    merged.merge_and_unload().save_pretrained(tmp_path / "merged")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, tmp_path / "merged")
    want = LLM(str(tmp_path / "merged"), dtype="float32").generate(_prompts(), PARAMS, use_tqdm=False)
    got = LLM(str(base), dtype="float32", enable_lora=True).generate(
        _prompts(), PARAMS, use_tqdm=False, lora_request=LoRARequest("a", 1, str(tmp_path / "a")))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_hub_layout_adapters_and_refusals(tmp_path, hybrid_checkpoint):
    """A Qwen3.5 checkpoint in the hub's layout (Qwen3_5ForConditionalGeneration, with its vision tower): an adapter
    made on it (keys under model.language_model) equals PEFT's on text prompts; one on the vision tower, or on the MoE
    shared expert, is refused by name."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    hub = hybrid_checkpoint("qwen3_5_hub")
    reference = build_adapter(hub, tmp_path / "text", 1, std=0.1, model_class=Qwen3_5ForConditionalGeneration,
                              targets=r".*language_model.*\.(q_proj|v_proj|in_proj_qkv|in_proj_z|out_proj)")
    llm = LLM(str(hub), dtype="float32", enable_lora=True)
    check_outputs(llm.generate(_prompts([0, 1]), PARAMS, use_tqdm=False,
                               lora_request=LoRARequest("text", 1, str(tmp_path / "text"))),
                  hf_greedy(reference, PROMPTS[:2], 8))
    build_adapter(hub, tmp_path / "vision", 2, targets=r".*visual.*\.qkv", model_class=Qwen3_5ForConditionalGeneration)
    with pytest.raises(InvalidRequest, match="targets a module MILI does not run adapters on"):
        llm.generate(_prompts([0]), PARAMS, use_tqdm=False, lora_request=LoRARequest("v", 2, str(tmp_path / "vision")))
    moe = hybrid_checkpoint("qwen3_5_moe")
    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules=["shared_expert.down_proj"])).save_pretrained(tmp_path / "se")
    with pytest.raises(InvalidRequest, match="not a target MILI runs .*shared expert"):
        LLM(str(moe), dtype="float32", enable_lora=True).generate(
            _prompts([0]), PARAMS, use_tqdm=False, lora_request=LoRARequest("se", 3, str(tmp_path / "se")))
    assert_drained(llm)


def test_mtp_drafts_from_the_base_model_keep_the_adapters_tokens(tmp_path):
    """Qwen3.5 with its MTP head: the drafts come from the base model's head (it runs no adapter) and are verified
    under each request's adapter, so the output is PEFT's, token for token, in a batch mixing adapter and base."""
    from support.hybrid import build_hybrid_checkpoint

    base = build_hybrid_checkpoint(tmp_path / "mtp", "qwen3_5", mtp=True)
    reference = build_adapter(base, tmp_path / "a", 5, targets=TARGETS["qwen3_5"], std=0.1)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    llm = LLM(str(base), dtype="float32", enable_lora=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    outs = llm.generate(_prompts() * 2, PARAMS, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
    check_outputs(outs[:3], hf_greedy(reference, PROMPTS, 8))
    check_outputs(outs[3:], hf_greedy(plain, PROMPTS, 8))
    assert llm.engine.spec_decode_stats()["num_draft_tokens"] > 0
    assert_drained(llm)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_adapter_products_on_the_cpu_kernels(tmp_path, hybrid_checkpoint, kind):
    """bf16 on MILI's CPU kernels: every adapted projection of a hybrid (the Gated DeltaNet's fused in_proj_qkvz and
    in_proj_ba, Qwen3-Next's adapted whole, the gated attention's q|k|v) equals torch's product."""
    base = hybrid_checkpoint(kind)
    build_adapter(base, tmp_path / "a", 1, targets=TARGETS[kind], std=0.1)
    build_adapter(base, tmp_path / "b", 2, targets=DELTANET[kind], std=0.1)
    llm = LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=2)
    requests = [LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))]
    assert_kernel_products_match(llm, requests)
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False, lora_request=[requests[0], requests[1], None])
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)  # (bf16 end to end: prefill and decode steps)
    assert_drained(llm)
