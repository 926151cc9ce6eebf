"""LoRA adapters on the engine (offline ``lora_request``), in float32 against PEFT's own model of the same adapter:
greedy tokens equal and logprobs within 1e-4, alone and in a batch that mixes adapters with the base model; the
prefix cache keyed by adapter; adapters refused by name where MILI cannot run them faithfully."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mili import InvalidRequest, LLM, LoRARequest, SamplingParams
from support.engine_state import assert_drained, runner_parts
from support.lora import assert_kernel_products_match, build_adapter, cached_runs, check_outputs
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


def test_each_adapter_matches_peft_and_a_mixed_batch_matches_each_alone(dense):
    base, refs, requests = dense
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = {name: hf_greedy(ref, PROMPTS, 12) for name, ref in refs.items()}
    expected[None] = hf_greedy(plain, PROMPTS, 12)
    for name, request in [*requests.items(), (None, None)]:
        check_outputs(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=request), expected[name])
    # one step: three adapters and the base model, each prompt under each
    names = ["a", "b", "c", None] * 3
    mixed = llm.generate([prompts[i % 3] for i in range(12)], PARAMS, use_tqdm=False,
                         lora_request=[requests[n] if n else None for n in names])
    check_outputs(mixed, [expected[n][i % 3] for i, n in enumerate(names)])
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
    _, other = cached_runs(llm, {"prompt_token_ids": PROMPTS[2]}, PARAMS, requests["a"], requests["b"])
    check_outputs([other], hf_greedy(refs["b"], PROMPTS[2:], 12))
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
        check_outputs([out], hf_greedy(refs[name], PROMPTS[:1], 12))
    assert len(runner_parts(llm).loras.loaded) == 2
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
    check_outputs(llm.generate(prompt, PARAMS, use_tqdm=False), hf_greedy(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(),
        PROMPTS[:1], 12))
    assert_drained(llm)


def test_moe_attention_adapters_and_expert_adapters_refused(tmp_path):
    """On Qwen3 MoE: an adapter on the attention projections equals PEFT's; one on the experts is refused by name."""
    from support.checkpoints import build_moe_checkpoint

    moe = build_moe_checkpoint(tmp_path / "moe", num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    attention = build_adapter(moe, tmp_path / "att", 1, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    build_adapter(moe, tmp_path / "experts", 2, targets=("gate_proj", "up_proj", "down_proj"))
    llm = LLM(str(moe), dtype="float32", enable_lora=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    check_outputs(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=LoRARequest("att", 1, str(tmp_path / "att"))),
           hf_greedy(attention, PROMPTS[:2], 12))
    with pytest.raises(InvalidRequest, match="not supported|not a target MILI runs"):
        llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=LoRARequest("ex", 2, str(tmp_path / "experts")))
    assert_drained(llm)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_quantized_base_takes_adapters(dense, quantization):
    """--quantization int8 / fp8 (MILI's kernels on the CPU, bf16): each projection is the quantized layer's output
    plus the adapter's s B (A x), computed beside it (within bf16's rounding of the products)."""
    torch.manual_seed(0)
    from safetensors.torch import load_file

    base, _, requests = dense
    llm = LLM(str(base), dtype="bfloat16", enable_lora=True, quantization=quantization)
    loras = runner_parts(llm).loras
    loras.acquire(requests["a"])
    layer = llm.apply_model(lambda m: m.model.layers[1].self_attn.qkv_proj)
    loras.prepare([1, 1, None], torch.device("cpu"))  # rows 0 and 1 under adapter a, row 2 the base's
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, plain = layer(x).float(), layer.base(x).float()
    tensors = load_file(f"{requests['a'].lora_path}/adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.self_attn"
    delta = torch.cat([(x[:2].float() @ tensors[f"{prefix}.{p}.lora_A.weight"].T.bfloat16().float()
                        @ tensors[f"{prefix}.{p}.lora_B.weight"].T.bfloat16().float()) * 2.0
                       for p in ("q_proj", "k_proj", "v_proj")], dim=1)
    torch.testing.assert_close(got[:2] - plain[:2], delta, atol=0.05, rtol=0.02)  # (bf16 products)
    assert torch.equal(got[2], plain[2])
    loras.release(requests["a"])
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, lora_request=requests["a"])
    assert len(outs[0].outputs[0].token_ids) == 12
    assert_drained(llm)


def test_an_awq_checkpoint_takes_adapters(tmp_path):
    """An AWQ int4 checkpoint with an adapter, in float32 (its weights dequantized): PEFT's model of the same adapter
    on the dequantized weights gives the same greedy tokens and logprobs."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3ForCausalLM

    from support.checkpoints import build_checkpoint
    from support.quantized import awq_layout, write_quantized_checkpoint

    dense = build_checkpoint(tmp_path / "dense", "gqa_untied", hidden_size=128, num_attention_heads=4,
                             num_key_value_heads=4, head_dim=32, intermediate_size=256)
    tensors, dequantized = awq_layout(load_file(dense / "model.safetensors"), 128)
    awq = write_quantized_checkpoint(dense, tmp_path / "awq", tensors, {
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True,
        "modules_to_not_convert": None})
    plain = tmp_path / "plain"
    shutil.copytree(dense, plain)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, plain / "model.safetensors")
    build_adapter(dense, tmp_path / "adapter", 7)
    reference = PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(plain, dtype=torch.float32),
                                          tmp_path / "adapter").eval()
    llm = LLM(str(awq), dtype="float32", enable_lora=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False,
                        lora_request=LoRARequest("awq", 1, str(tmp_path / "adapter")))
    check_outputs(outs, hf_greedy(reference, PROMPTS, 12))


def test_qwen3_vl_adapter_with_an_image_matches_peft(tmp_path, vision_checkpoint):
    """Qwen3-VL: an adapter on the language model (keys under model.language_model), a prompt with an image beside
    a text-only one: greedy tokens and logprobs equal PEFT's model of the same adapter."""
    from PIL import Image
    from transformers import Qwen3VLForConditionalGeneration

    from support.vision import IMAGE, VISION_END, VISION_START, process_images, prompt_with_images, write_images

    base = vision_checkpoint("qwen3_vl")
    reference = build_adapter(base, tmp_path / "a", 4, std=0.1, model_class=Qwen3VLForConditionalGeneration,
                              targets=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")
    (tmp_path / "images").mkdir()
    paths = write_images(tmp_path / "images")[:1]
    texts = [[5, 17, 301, 42], [7, 7, 90]]
    pixels, grid = process_images(paths)
    ids = torch.tensor([prompt_with_images(grid, texts)])
    with torch.no_grad():
        out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0, pixel_values=pixels,
                                 image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())
    expected = [(out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.scores)[:, 0]),
                hf_greedy(reference, PROMPTS[:1], 8)[0]]
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    prompt = {"prompt_token_ids": texts[0] + [VISION_START, IMAGE, VISION_END] + texts[1],
              "multi_modal_data": {"image": [Image.open(paths[0])]}}
    outs = llm.generate([prompt, {"prompt_token_ids": PROMPTS[0]}],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(tmp_path / "a")))
    check_outputs(outs, expected)
    assert_drained(llm)


def test_adapters_with_speculation_preemption_and_n(dense):
    """Adapters a and b and the base model mixed in one run, each request's greedy tokens and logprobs PEFT's:
    with n-gram speculative decoding (drafts from the sequence's own tokens, verified under its adapter), under KV
    pages so few that sequences are preempted and recomputed (under their adapter), and with n = 2."""
    base, refs, requests = dense
    prompts = [PROMPTS[0] * 4 + PROMPTS[1], PROMPTS[1] * 6, PROMPTS[2]]
    expected = {name: hf_greedy(ref, prompts, 12) for name, ref in refs.items() if name != "c"}
    names = ["a", "b"] * 3
    batch = [{"prompt_token_ids": prompts[i // 2]} for i in range(6)]
    loras = [requests[n] for n in names]
    want = [expected[n][i // 2] for i, n in enumerate(names)]
    spec = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    check_outputs(spec.generate(batch, PARAMS, use_tqdm=False, lora_request=loras), want)
    assert spec.engine.spec_decode_stats()["num_accepted_tokens"] > 0
    assert_drained(spec)
    tight = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, num_kv_pages=8, page_size=8,
                max_num_batched_tokens=32, enable_prefix_caching=False)
    check_outputs(tight.generate(batch, PARAMS, use_tqdm=False, lora_request=loras), want)
    assert tight.engine.stats().num_preemptions > 0
    assert_drained(tight)
    two = LLM(str(base), dtype="float32", enable_lora=True).generate(
        batch[:2], SamplingParams(n=2, max_tokens=12, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False,
        lora_request=loras[:2])
    for out, expect in zip(two, want[:2]):
        assert len(out.outputs) == 2
        for sample in out.outputs:
            check_outputs([type("One", (), {"outputs": [sample]})], [expect])


def test_structured_outputs_under_an_adapter(tmp_path, qwen3_checkpoint):
    """A regular expression under an adapter (the real vocabulary): every sampled output matches it, and the
    adapter's outputs are not the base model's for the same seeds."""
    import re

    from mili import StructuredOutputsParams

    base = qwen3_checkpoint("gqa4_realvocab")
    build_adapter(base, tmp_path / "a", 6, std=0.5)
    pattern = r"[a-z]{3,6}-\d{2}"
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=pattern)) for s in range(6)]
    adapted = llm.generate(["Answer:"] * 6, params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(tmp_path / "a")))
    plain = llm.generate(["Answer:"] * 6, params, use_tqdm=False)
    for out in adapted:
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert [o.outputs[0].text for o in adapted] != [o.outputs[0].text for o in plain]
    assert_drained(llm)


def test_the_cpu_kernels_adapter_products_are_torchs(dense):
    """bf16 on MILI's CPU kernels (kernels.c's mili_lora_add: A over every slot, B per shard): every adapted layer's
    output equals base(x) + the row's own slot's (x A^T) B^T computed by torch in float32, within bf16's rounding,
    for rows under two adapters and the base model; base rows untouched."""
    base, _, requests = dense
    llm = LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=8)
    assert_kernel_products_match(llm, [requests["a"], requests["b"]])
