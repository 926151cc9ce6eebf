"""Quantized checkpoints MILI loads, written in their exact on-disk layouts from a random model: Qwen's
block-wise FP8 (``weight_scale_inv`` per 128 x 128 block, bf16 or float32) and compressed-tensors FP8
(``weight_scale`` per output channel or per tensor). In float32 MILI computes with the dequantized
weights; its greedy tokens are HF transformers' for the same checkpoint (HF's own FP8 dequantization)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import build_checkpoint
from mili import LLM, SamplingParams

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=256,
             vocab_size=512)  # whole 128 x 128 blocks, as every Qwen3 FP8 release has
FP8_MAX = 448.0
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("quant") / "dense", "gqa_untied", **SHAPE)


def _write(dense, dest, tensors, qconfig):
    shutil.copytree(dense, dest)
    save_file(tensors, dest / "model.safetensors")
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def qwen_fp8(weights: dict, scale_dtype: torch.dtype) -> tuple[dict, dict]:
    """(Qwen's layout, the dequantized weights): e4m3 weights, one scale per 128 x 128 block."""
    out, dequantized = {}, {}
    for name, w in weights.items():
        if not name.endswith(tuple(f"{p}.weight" for p in LINEARS)):
            out[name] = dequantized[name] = w
            continue
        rows, cols = w.shape
        blocks = w.float().reshape(rows // 128, 128, cols // 128, 128)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).to(scale_dtype)
        q = (blocks / scale.float()[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
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


def _greedy_equal(path, reference, prompts):
    ours = LLM(str(path), dtype="float32").generate(prompts, PARAMS, use_tqdm=False)
    exact = 0
    for p, out in zip(prompts, ours):
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            ref = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        got, want = out.outputs[0].token_ids, ref.sequences[0, ids.shape[1]:].tolist()
        parted = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if parted is None:
            exact += 1
        else:  # paths may part only at an HF near-tie (the dense parity test's rule)
            top2 = ref.scores[parted][0].topk(2).values
            assert top2[0] - top2[1] < 1e-3, f"diverged at step {parted} without a near-tie"
    assert exact >= len(prompts) - 1


PROMPTS = [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
           for n in (1, 8, 33)]


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_qwen_block_fp8_matches_hf(dense, tmp_path, scale_dtype):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    tensors, dequantized = qwen_fp8(load_file(dense / "model.safetensors"), scale_dtype)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    path = _write(dense, tmp_path / "fp8", tensors, {"quant_method": "fp8", "fmt": "e4m3",
                                                     "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    q = reference.model.layers[0].self_attn.q_proj.weight  # HF's own dequantization agrees with the test's
    assert torch.allclose(q, dequantized["model.layers.0.self_attn.q_proj.weight"])
    _greedy_equal(path, reference, PROMPTS)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_matches_the_dequantized_model(dense, tmp_path, strategy):
    from transformers import Qwen3ForCausalLM

    tensors, dequantized = compressed_fp8(load_file(dense / "model.safetensors"), strategy)
    qconfig = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
               "config_groups": {"FP8_DYNAMIC": {"targets": ["Linear"],
                                                 "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                                                 "input_activations": {"num_bits": 8, "type": "float",
                                                                       "strategy": "token", "dynamic": True}}}}
    path = _write(dense, tmp_path / f"ct_{strategy}", tensors, qconfig)
    plain = tmp_path / "plain"  # the reference: the dequantized weights as a plain checkpoint
    shutil.copytree(dense, plain, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, plain / "model.safetensors")
    reference = Qwen3ForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    _greedy_equal(path, reference, PROMPTS)
    # and the quantization is real: the dequantized model differs from the original one
    original = load_file(dense / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(dequantized["model.layers.0.mlp.down_proj.weight"], original)


def test_a_quantized_weight_without_its_scale_is_refused(dense, tmp_path):
    from mili import ModelLoadError

    tensors, _ = qwen_fp8(load_file(dense / "model.safetensors"), torch.bfloat16)
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    path = _write(dense, tmp_path / "noscale", tensors, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ModelLoadError, match="up_proj.weight is stored as float8_e4m3fn"):
        LLM(str(path), dtype="float32")


# -- AWQ --------------------------------------------------------------------------------------------------
def autoawq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM packing, as it is written there: [rows, cols] 4-bit -> [rows, cols / 8] int32,
    word nibble i holding column order_map[i] of its 8."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    return packed


def awq_layout(weights: dict, group: int) -> tuple[dict, dict]:
    """(AutoAWQ's GEMM layout, the dequantized weights): asymmetric 4-bit per group of input channels."""
    out, dequantized = {}, {}
    for name, w in weights.items():
        if not name.endswith(tuple(f"{p}.weight" for p in LINEARS)):
            out[name] = dequantized[name] = w
            continue
        wt = w.float().t()  # AWQ stores [in, out]
        k, n = wt.shape
        g = wt.reshape(k // group, group, n)
        lo, hi = g.amin(dim=1), g.amax(dim=1)
        scales = ((hi - lo).clamp(min=1e-5) / 15).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, 15)
        q = torch.round(g / scales.float()[:, None] + zeros[:, None]).clamp(0, 15).reshape(k, n)
        stem = name.removesuffix("weight")
        out[stem + "qweight"] = autoawq_pack(q.to(torch.int32))
        out[stem + "qzeros"] = autoawq_pack(zeros.to(torch.int32))
        out[stem + "scales"] = scales
        deq = (q.reshape(k // group, group, n) - zeros[:, None]) * scales.float()[:, None]
        dequantized[name] = deq.reshape(k, n).t().contiguous()
    return out, dequantized


def test_awq_packing_order():
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
    from transformers import Qwen3ForCausalLM

    tensors, dequantized = awq_layout(load_file(dense / "model.safetensors"), group)
    assert tensors["model.layers.0.self_attn.q_proj.qweight"].shape == (128, 128 // 8)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True,
               "modules_to_not_convert": None}
    path = _write(dense, tmp_path / f"awq{group}", tensors, qconfig)
    plain = tmp_path / "plain"
    shutil.copytree(dense, plain, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, plain / "model.safetensors")
    reference = Qwen3ForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    _greedy_equal(path, reference, PROMPTS)
    original = load_file(dense / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(dequantized["model.layers.0.mlp.down_proj.weight"], original)


def test_awq_without_zero_points_or_scales_is_refused(dense, tmp_path):
    from mili import ModelLoadError

    tensors, _ = awq_layout(load_file(dense / "model.safetensors"), 128)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
    del tensors["model.layers.1.mlp.up_proj.scales"]
    path = _write(dense, tmp_path / "noscales", tensors, qconfig)
    with pytest.raises(ModelLoadError, match="up_proj.qweight has no model.layers.1.mlp.up_proj.scales"):
        LLM(str(path), dtype="float32")
    for other in ({**qconfig, "version": "gemv"}, {**qconfig, "zero_point": False}, {**qconfig, "bits": 3}):
        path = _write(dense, tmp_path / f"awq-{len(list(tmp_path.iterdir()))}", tensors, other)
        with pytest.raises(ModelLoadError, match="quantized with 'awq'"):
            LLM(str(path), dtype="float32")
