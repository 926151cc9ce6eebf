"""Quantized checkpoints MILI loads, written in their exact on-disk layouts from a random model: Qwen's
block-wise FP8 (``weight_scale_inv`` per 128 x 128 block, bf16 or float32) and compressed-tensors FP8
(``weight_scale`` per output channel or per tensor). In float32 MILI computes with the dequantized
weights; its greedy tokens are HF transformers' for the same checkpoint (HF's own FP8 dequantization)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.checkpoints import build_checkpoint
from support.engine_state import forward_logits
from support.parity import greedy_matches
from support.quantized import autoawq_pack, awq_layout, write_quantized_checkpoint
from mili import LLM, SamplingParams
from mili.kernels import cpu
from mili.model.quant import quantize_fp8_blocks
from mili.runtime.plan import StepKind

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=256,
             vocab_size=512)  # whole 128 x 128 blocks, as every Qwen3 FP8 release has
FP8_MAX = 448.0
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("quant") / "dense", "gqa_untied", **SHAPE)


def qwen_fp8(weights: dict, scale_dtype: torch.dtype) -> tuple[dict, dict]:
    """(Qwen's layout, the dequantized weights): e4m3 weights, one scale per 128 x 128 block."""
    out, dequantized = {}, {}
    for name, w in weights.items():
        if not name.endswith(tuple(f"{p}.weight" for p in LINEARS)):
            out[name] = dequantized[name] = w
            continue
        rows, cols = w.shape
        q, scale = quantize_fp8_blocks(w, scale_dtype=scale_dtype)
        out[name], out[name + "_scale_inv"] = q, scale
        dequantized[name] = (q.float().reshape(rows // 128, 128, cols // 128, 128)
                             * scale.float()[:, None, :, None]).reshape(rows, cols)
    return out, dequantized


def compressed_fp8(weights: dict, strategy: str) -> tuple[dict, dict]:
    """(llm-compressor's float-quantized layout, the dequantized weights); lm_head left out (ignore)."""
    out, dequantized = {}, {}
    for name, w in weights.items():
        if not name.endswith(tuple(f"{p}.weight" for p in LINEARS)):
            out[name] = dequantized[name] = w
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
        scale = (amax / FP8_MAX).float()
        q = (w / scale).to(torch.float8_e4m3fn)
        stem = name.removesuffix("weight")
        out[name], out[stem + "weight_scale"] = q, scale if strategy == "channel" else scale.reshape(1)
        out[stem + "input_scale"] = torch.ones(1)  # static activation scales: activations are not quantized here
        dequantized[name] = q.float() * scale
    return out, dequantized


def _dequantized_reference(dense, tmp_path, dequantized: dict):
    """HF transformers on the dequantized weights, saved as a plain checkpoint."""
    from transformers import Qwen3ForCausalLM

    plain = tmp_path / "plain"
    shutil.copytree(dense, plain, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, plain / "model.safetensors")
    return Qwen3ForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()


def _greedy_equal(path, reference, prompts):
    greedy_matches(LLM(str(path), dtype="float32"), reference, prompts, PARAMS)


PROMPTS = [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
           for n in (1, 8, 33)]


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_qwen_block_fp8_matches_hf(dense, tmp_path, scale_dtype):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    tensors, dequantized = qwen_fp8(load_file(dense / "model.safetensors"), scale_dtype)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    path = write_quantized_checkpoint(dense, tmp_path / "fp8", tensors, {"quant_method": "fp8", "fmt": "e4m3",
                                                     "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    q = reference.model.layers[0].self_attn.q_proj.weight  # HF's own dequantization agrees with the test's
    assert torch.allclose(q, dequantized["model.layers.0.self_attn.q_proj.weight"])
    _greedy_equal(path, reference, PROMPTS)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_matches_the_dequantized_model(dense, tmp_path, strategy):
    tensors, dequantized = compressed_fp8(load_file(dense / "model.safetensors"), strategy)
    qconfig = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
               "config_groups": {"FP8_DYNAMIC": {"targets": ["Linear"],
                                                 "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                                                 "input_activations": {"num_bits": 8, "type": "float",
                                                                       "strategy": "token", "dynamic": True}}}}
    path = write_quantized_checkpoint(dense, tmp_path / f"ct_{strategy}", tensors, qconfig)
    _greedy_equal(path, _dequantized_reference(dense, tmp_path, dequantized), PROMPTS)
    # and the quantization is real: the dequantized model differs from the original one
    original = load_file(dense / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(dequantized["model.layers.0.mlp.down_proj.weight"], original)


def test_a_quantized_weight_without_its_scale_is_refused(dense, tmp_path):
    from mili import ModelLoadError

    tensors, _ = qwen_fp8(load_file(dense / "model.safetensors"), torch.bfloat16)
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    path = write_quantized_checkpoint(dense, tmp_path / "noscale", tensors,
                                      {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ModelLoadError, match="up_proj.weight is stored as float8_e4m3fn"):
        LLM(str(path), dtype="float32")


# -- AWQ --------------------------------------------------------------------------------------------------
def test_awq_packing_order():
    torch.manual_seed(0)
    from mili.model.quant import pack_awq, unpack_awq

    # columns 0..7 holding the values 0..7 pack as AutoAWQ's nibble order 0 2 4 6 1 3 5 7 (low to high)
    word = autoawq_pack(torch.arange(8, dtype=torch.int32)[None])
    assert word.item() == 0x75316420
    assert unpack_awq(word).tolist() == [list(range(8))]
    values = torch.randint(0, 16, (5, 32))
    assert torch.equal(pack_awq(values), autoawq_pack(values.to(torch.int32)))
    assert torch.equal(unpack_awq(pack_awq(values)), values.to(torch.uint8))


@pytest.mark.parametrize("group", [128, 64])
def test_awq_matches_the_dequantized_model(dense, tmp_path, group):
    tensors, dequantized = awq_layout(load_file(dense / "model.safetensors"), group)
    assert tensors["model.layers.0.self_attn.q_proj.qweight"].shape == (128, 128 // 8)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True,
               "modules_to_not_convert": None}
    path = write_quantized_checkpoint(dense, tmp_path / f"awq{group}", tensors, qconfig)
    _greedy_equal(path, _dequantized_reference(dense, tmp_path, dequantized), PROMPTS)
    original = load_file(dense / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(dequantized["model.layers.0.mlp.down_proj.weight"], original)


def test_awq_without_zero_points_or_scales_is_refused(dense, tmp_path):
    from mili import ModelLoadError

    tensors, _ = awq_layout(load_file(dense / "model.safetensors"), 128)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
    del tensors["model.layers.1.mlp.up_proj.scales"]
    path = write_quantized_checkpoint(dense, tmp_path / "noscales", tensors, qconfig)
    with pytest.raises(ModelLoadError, match="up_proj.qweight has no model.layers.1.mlp.up_proj.scales"):
        LLM(str(path), dtype="float32")
    for other in ({**qconfig, "version": "gemv"}, {**qconfig, "zero_point": False}, {**qconfig, "bits": 3}):
        path = write_quantized_checkpoint(dense, tmp_path / f"awq-{len(list(tmp_path.iterdir()))}", tensors, other)
        with pytest.raises(ModelLoadError, match="quantized with 'awq'"):
            LLM(str(path), dtype="float32")


# -- the CPU in bf16: quantized weights on MILI's kernels ---------------------------------------------------
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}


def _model(llm):
    return llm.apply_model(lambda model: model)


@pytest.mark.skipif(not cpu.int8_available(), reason=f"MILI's int kernels do not run here ({cpu.isa()}; the next "
                                                     "test covers their absence)")
def test_awq_in_bf16_runs_on_the_int4_kernel(dense, tmp_path):
    from mili.model.cpu_linear import Int4Linear, Int8Linear, KernelLinear

    tensors, _ = awq_layout(load_file(dense / "model.safetensors"), 128)
    path = write_quantized_checkpoint(dense, tmp_path / "awq", tensors, AWQ_CONFIG)
    fused = LLM(str(path), dtype="bfloat16")
    model, plan = _model(fused), fused.engine.plan
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    # not quantized in the checkpoint: int8 on the int8 kernel (lm_head_dtype auto), or bf16 when asked
    assert isinstance(model.lm_head, Int8Linear)
    assert plan.weight_format.endswith("lm_head int8 (W8A8 kernel)")
    assert isinstance(_model(LLM(str(path), dtype="bfloat16", lm_head_dtype="bf16")).lm_head, KernelLinear)
    assert plan.step is StepKind.CPU_DECODE and "int4" in plan.weight_format
    # the fused decode layer runs the int4 kernel: the same tokens as the module path
    eager = LLM(str(path), dtype="bfloat16", enforce_eager=True)
    a = fused.generate(PROMPTS, PARAMS, use_tqdm=False)
    b = eager.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # and W4A8 in bf16 stays near the float32 dequantized model: the first greedy token agrees
    exact = LLM(str(path), dtype="float32").generate(PROMPTS, PARAMS, use_tqdm=False)
    assert sum(x.outputs[0].token_ids[0] == y.outputs[0].token_ids[0] for x, y in zip(a, exact)) >= 2


def test_awq_in_bf16_without_the_int_kernels_is_dequantized(dense, tmp_path, monkeypatch):
    """Where the int kernels do not run (AVX-512 without VNNI, as on Skylake-X, simulated here by a CPU that lacks
    avx512_vnni; or no kernels at all) an AWQ checkpoint is dequantized to bf16 and int8 is aten's weight-only:
    no int kernel is called, so no instruction the CPU lacks runs, and the output stays the dequantized model's."""
    from mili.model.cpu_linear import Int4Linear, Int8Linear, KernelLinear

    tensors, _ = awq_layout(load_file(dense / "model.safetensors"), 128)
    path = write_quantized_checkpoint(dense, tmp_path / "awq", tensors, AWQ_CONFIG)
    if "avx512" in cpu.runnable_isas():  # AVX-512 without VNNI: its own build, the int kernels refused
        lacking = cpu.simulated(features=cpu.cpu_features() - {"avx512_vnni"})
        monkeypatch.setenv("MILI_CPU_ISA", "avx512")
    else:  # no kernels at all
        lacking = contextlib.nullcontext()
        monkeypatch.setenv("MILI_CPU_ISA", "none")
    from mili.kernels.cpu import ops

    def refused(*args, **kwargs):
        raise AssertionError("an int kernel was called where the CPU lacks its instructions")

    monkeypatch.setattr(ops, "linear_int8", refused)
    monkeypatch.setattr(ops, "linear_int4", refused)
    with lacking:
        if "avx512" in cpu.runnable_isas():
            assert cpu.available() and not cpu.int8_available() and "-mavx512vnni" not in cpu.compile_flags("avx512")
        else:
            assert not cpu.available()
        awq = LLM(str(path), dtype="bfloat16")
        model = _model(awq)
        layer = model.model.layers[0]
        awq.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert not any(isinstance(m, Int4Linear) for m in model.modules())
        assert "dequantized" in awq.engine.plan.weight_format
        int8_llm = LLM(str(dense), dtype="bfloat16", quantization="int8")
        int8 = _model(int8_llm)
        assert isinstance(int8.model.layers[0].mlp.down_proj, Int8Linear)
        int8_llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # runs: aten's weight-only int8, no refused kernel
        assert not int8.model.layers[0].mlp.down_proj.kernel
        assert isinstance(layer.mlp.down_proj, KernelLinear) == cpu.available()  # bf16: the kernel where it runs


def test_fp8_checkpoint_in_bf16_maps_onto_int8(dense, tmp_path):
    from mili.model.cpu_linear import Int8Linear

    tensors, _ = qwen_fp8(load_file(dense / "model.safetensors"), torch.bfloat16)
    path = write_quantized_checkpoint(dense, tmp_path / "fp8", tensors,
                                      {"quant_method": "fp8", "weight_block_size": [128, 128]})
    llm = LLM(str(path), dtype="bfloat16")
    plan = llm.engine.plan
    assert isinstance(_model(llm).model.layers[1].mlp.gate_up_proj, Int8Linear)
    assert "int8 per channel" in plan.weight_format and "fp8" in plan.weight_format
    assert llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_quantization_flag_on_a_quantized_checkpoint_is_refused(dense, tmp_path):
    from mili.errors import InvalidRequest

    tensors, _ = awq_layout(load_file(dense / "model.safetensors"), 128)
    path = write_quantized_checkpoint(dense, tmp_path / "awq", tensors, AWQ_CONFIG)
    with pytest.raises(InvalidRequest, match="already quantized \\(awq int4"):
        LLM(str(path), dtype="float32", quantization="fp8")


def test_fp8_linear_is_scaled_mm_of_per_channel_weights_and_per_token_activations():
    """The CUDA FP8 layer (torch._scaled_mm), checked on the CPU's _scaled_mm against its definition."""
    from mili.model.cpu_linear import Fp8Linear
    from mili.model.quant import FP8_MAX

    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(5, 64) * 3
    layer = Fp8Linear(w.to(torch.bfloat16))
    assert layer.qweight.dtype == torch.float8_e4m3fn and layer.scales.shape == (1, 96)
    sw = w.to(torch.bfloat16).float().abs().amax(dim=1) / FP8_MAX
    sx = x.to(torch.bfloat16).float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    wq = (w.to(torch.bfloat16).float() / sw[:, None]).to(torch.float8_e4m3fn).float() * sw[:, None]
    xq = (x.to(torch.bfloat16).float() / sx).to(torch.float8_e4m3fn).float() * sx
    got = layer(x.to(torch.bfloat16)).float()
    torch.testing.assert_close(got, xq @ wq.T, rtol=1e-2, atol=1e-2)
    assert (got - x @ w.T).abs().max() > 1e-2  # and it is quantized


def _next_token_logprobs(llm, prompts: list[list[int]]) -> torch.Tensor:
    """The full next-token log-distribution after each prompt, through the engine's own forward."""
    rows = []
    for prompt in prompts:
        request = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
        rows.append(forward_logits(llm)[0].float().log_softmax(-1))
        llm.engine.abort_request(request.request_id)
    return torch.stack(rows)


def test_fp8_quantization_kl_within_its_rounding_budget(qwen3_checkpoint, qwen3_tokenizer):
    """``--quantization fp8`` on real text through the real tokenizer: the next-token distributions' mean
    KL divergence from the unquantized model (float32, so only the weights' FP8 rounding differs).

    The bound: e4m3 keeps 3 mantissa bits, so rounding a weight changes it by a relative error uniform in
    +-2^-4 of its binade's top, an RMS of 2^-4 / sqrt(3) ~ 3.6% at most (~2.7% averaged over a binade). The
    same model with every linear weight times (1 + N(0, 3.6%^2)) is the budget: FP8 must cost less than that
    (any scale misapplied, a channel's scale on another, or a dropped layer costs far more), and more than a
    tenth of it (the rounding is really applied)."""
    dense = qwen3_checkpoint("gqa4_realvocab")
    text = ("The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces; a language model "
            "predicts the next piece from the ones before it, one distribution at a time.")
    ids = qwen3_tokenizer(text)["input_ids"]
    fp8, budget = _fp8_kl_and_budget(str(dense), [ids[:n] for n in range(4, len(ids), 3)])
    assert 0.1 * budget < fp8 < budget, (fp8, budget)


def test_fp8_quantization_kl_on_the_trained_demo():
    """The same budget on a trained model and the text it was trained for: the shipped `demo` on Bible
    chapters it never saw (tests/data/demo/heldout.txt), whose next-token distributions are peaked where a
    random model's are flat."""
    from transformers import AutoTokenizer

    from mili.model.demo import demo_checkpoint

    path = demo_checkpoint()
    text = (Path(__file__).resolve().parents[1] / "data" / "demo" / "heldout.txt").read_text()
    verses = [line.split(" ", 1)[1] for line in text.splitlines()[:40] if line.startswith("  ")]
    ids = AutoTokenizer.from_pretrained(path)(" ".join(verses), add_special_tokens=False)["input_ids"][:160]
    fp8, budget = _fp8_kl_and_budget(path, [ids[:n] for n in range(4, len(ids), 4)])
    assert 0.1 * budget < fp8 < budget, (fp8, budget)


def _fp8_kl_and_budget(path: str, prompts: list[list[int]]) -> tuple[float, float]:
    """Mean KL of the next-token distributions from the float32 model's: with ``--quantization fp8``, and with
    every linear weight times (1 + N(0, 3.6%^2)) (the budget)."""
    common = dict(dtype="float32", enable_prefix_caching=False)
    ref = _next_token_logprobs(LLM(path, **common), prompts)
    fp8 = _next_token_logprobs(LLM(path, quantization="fp8", **common), prompts)
    noisy = LLM(path, **common)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in _model(noisy).named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.mul_(1 + torch.randn(p.shape, generator=generator) * (2 ** -4 / 3 ** 0.5))
    budget = _next_token_logprobs(noisy, prompts)

    def kl(q):
        return (ref.exp() * (ref - q)).sum(-1).mean().item()

    return kl(fp8), kl(budget)
