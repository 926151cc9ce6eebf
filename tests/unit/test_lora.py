"""LoRA adapters on the engine (offline ``lora_request``), in float32 against PEFT's own model of the same adapter:
greedy tokens equal and logprobs within 1e-4, alone and in a batch that mixes adapters with the base model; the
prefix cache keyed by adapter; adapters refused by name where MILI cannot run them faithfully."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mili import InvalidRequest, LLM, LoRARequest, SamplingParams
from support.engine_state import assert_drained
from support.lora import build_adapter
from support.parity import hf_greedy

PROMPTS = [[5, 17, 99, 3, 250, 40, 11], [400, 2, 3], list(range(30, 70))]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def dense(tmp_path_factory, qwen3_checkpoint):
    """The base (GQA, untied) and three adapters: every target at rank 4; q, v and down at rank 8 with rsLoRA; the
    MLP only at rank 2."""
    base = qwen3_checkpoint("gqa_untied")
    root = tmp_path_factory.mktemp("lora")
    refs = {"a": build_adapter(base, root / "a", 1),
            "b": build_adapter(base, root / "b", 2, rank=8, targets=("q_proj", "v_proj", "down_proj"), rslora=True),
            "c": build_adapter(base, root / "c", 3, rank=2, targets=("gate_proj", "up_proj", "down_proj"))}
    requests = {name: LoRARequest(name, i, str(root / name)) for i, name in enumerate(refs, 1)}
    return base, refs, requests


def _check(outs, expected) -> None:
    """Greedy tokens equal to PEFT's, and each one's logprob within 1e-4 of PEFT's (``expected``: support.parity's
    (tokens, raw logits [steps, V]))."""
    for out, (tokens, scores) in zip(outs, expected):
        o = out.outputs[0]
        assert o.token_ids == tokens
        got = torch.tensor([o.logprobs[i][t].logprob for i, t in enumerate(tokens)])
        ref = scores.log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_each_adapter_matches_peft_and_a_mixed_batch_matches_each_alone(dense):
    base, refs, requests = dense
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = {name: hf_greedy(ref, PROMPTS, 12) for name, ref in refs.items()}
    expected[None] = hf_greedy(plain, PROMPTS, 12)
    for name, request in [*requests.items(), (None, None)]:
        _check(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=request), expected[name])
    # one step: three adapters and the base model, each prompt under each
    names = ["a", "b", "c", None] * 3
    mixed = llm.generate([prompts[i % 3] for i in range(12)], PARAMS, use_tqdm=False,
                         lora_request=[requests[n] if n else None for n in names])
    _check(mixed, [expected[n][i % 3] for i, n in enumerate(names)])
    assert_drained(llm)


def test_merged_weights_give_the_same_tokens(tmp_path, dense):
    """PEFT's merge_and_unload() of adapter a, saved as a checkpoint: MILI's base with a, and MILI on the merged
    weights, give the same greedy tokens."""
    base, _, requests = dense
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      requests["a"].lora_path)
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    shutil.copy(base / "tokenizer.json", tmp_path / "merged")
    shutil.copy(base / "tokenizer_config.json", tmp_path / "merged")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    merged = LLM(str(tmp_path / "merged"), dtype="float32").generate(prompts, PARAMS, use_tqdm=False)
    adapted = LLM(str(base), dtype="float32", enable_lora=True).generate(prompts, PARAMS, use_tqdm=False,
                                                                          lora_request=requests["a"])
    assert [o.outputs[0].token_ids for o in merged] == [o.outputs[0].token_ids for o in adapted]


def test_the_prefix_cache_never_shares_between_adapters(dense):
    base, refs, requests = dense
    llm = LLM(str(base), dtype="float32", enable_lora=True, page_size=4)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    first = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=requests["a"])[0]
    again = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=requests["a"])[0]
    other = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=requests["b"])[0]
    plain = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    _check([other], hf_greedy(refs["b"], PROMPTS[2:], 12))
    assert_drained(llm)


def test_more_adapters_than_slots_wait_and_are_evicted(dense):
    """max_loras 1: a step runs one adapter, the others wait their turn; max_cpu_loras 2: the least recently used
    of three is dropped and loaded again when asked for. Every answer stays right."""
    base, refs, requests = dense
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2)
    names = ["a", "b", "c", "a"]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 4, PARAMS, use_tqdm=False,
                        lora_request=[requests[n] for n in names])
    for out, name in zip(outs, names):
        _check([out], hf_greedy(refs[name], PROMPTS[:1], 12))
    assert len(llm.engine.core.runner.loras.loaded) == 2
    assert_drained(llm)


def test_adapters_mili_cannot_run_are_refused_by_name(tmp_path, dense, qwen3_checkpoint):
    base, _, requests = dense
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]

    def refused(path, match, name="x"):
        with pytest.raises(InvalidRequest, match=match):
            llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=LoRARequest(name, 99, str(path)))

    refused(tmp_path / "missing", "no adapter_config.json")
    refused(requests["b"].lora_path, "rank 8 exceeds --max-lora-rank 4")
    for key, value, match in (("use_dora", True, "DoRA is not supported"),
                              ("modules_to_save", ["lm_head"], "modules_to_save"),
                              ("bias", "all", "bias 'all'")):
        bad = tmp_path / key
        shutil.copytree(requests["a"].lora_path, bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        config[key] = value
        (bad / "adapter_config.json").write_text(json.dumps(config))
        refused(bad, match)
    other = build_adapter(qwen3_checkpoint("mha_tied"), tmp_path / "other-base", 5)  # another base's shapes
    del other
    refused(tmp_path / "other-base", "do not fit the base's layer")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(requests["a"].lora_path, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    refused(corrupt, "cannot be read")
    with pytest.raises(InvalidRequest, match="started without --enable-lora"):
        LLM(str(base), dtype="float32").generate(prompt, PARAMS, use_tqdm=False, lora_request=requests["a"])
    _check(llm.generate(prompt, PARAMS, use_tqdm=False), hf_greedy(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(),
        PROMPTS[:1], 12))
    assert_drained(llm)
