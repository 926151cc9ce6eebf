"""Checkpoints MILI cannot run faithfully are refused by name before a weight loads, never run as garbage."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from mili import LLM, ModelLoadError

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def derived(base, dest, config_changes=None, tensors=None):
    """A copy of checkpoint ``base`` with config.json keys changed and model.safetensors rewritten."""
    shutil.copytree(base, dest)
    if config_changes:
        cfg = json.loads((dest / "config.json").read_text())
        cfg.update(config_changes)
        (dest / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, dest / "model.safetensors")
    return dest


def quantize(weights: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """The linear layers' weights in a quantized checkpoint's own layout (the rest stays bf16)."""
    out = {}
    for name, w in weights.items():
        if not name.endswith(tuple(f"{p}.weight" for p in LINEARS)):
            out[name] = w.to(torch.bfloat16)
            continue
        stem = name[: -len("weight")]
        rows, cols = w.shape
        if layout == "fp8_block":  # Qwen's FP8 releases: one bf16 scale per 128 x 128 block
            out[name] = (w / 4).to(torch.float8_e4m3fn)
            out[stem + "weight_scale_inv"] = torch.full((-(-rows // 128), -(-cols // 128)), 4.0, dtype=torch.bfloat16)
        elif layout == "compressed_tensors":  # llm-compressor FP8: one scale per output channel
            scale = w.abs().amax(dim=1, keepdim=True) / 448
            out[name] = (w / scale).to(torch.float8_e4m3fn)
            out[stem + "weight_scale"] = scale.float()
        else:  # bitsandbytes LLM.int8: int8 rows with a per-row absmax (SCB)
            scb = w.abs().amax(dim=1)
            out[name] = (w / scb[:, None] * 127).round().to(torch.int8)
            out[stem + "SCB"] = scb.float()
            out[stem + "weight_format"] = torch.tensor(0, dtype=torch.uint8)
    return out


# Methods MILI does not load (Qwen's block-wise fp8 and compressed-tensors FP8 load: test_quantized_checkpoints)
QUANTIZED = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False},
                     r"quantized with 'bitsandbytes' \(load_in_8bit True\)"),
    "compressed_tensors_int4": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                     "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
                                r"quantized with 'compressed-tensors' \(format pack-quantized\)"),
    "fp8_per_tensor_e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"},
                            r"quantized with 'fp8' \(fmt e5m2\)"),
}


@pytest.fixture(scope="module")
def plain_weights(tiny_checkpoint):
    return load_file(tiny_checkpoint / "model.safetensors")


@pytest.mark.parametrize("layout", list(QUANTIZED))
def test_quantized_checkpoint_is_refused_by_method(tiny_checkpoint, plain_weights, tmp_path, layout):
    qconfig, message = QUANTIZED[layout]
    path = derived(tiny_checkpoint, tmp_path / layout, {"quantization_config": qconfig},
                   quantize(plain_weights, layout))
    with pytest.raises(ModelLoadError, match=message + ".*does not load yet"):
        LLM(str(path))
    # Refused from config.json alone, before any weight is read: the same error with the weights gone.
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path))


def test_older_compression_config_spelling_is_refused(tiny_checkpoint, tmp_path):
    path = derived(tiny_checkpoint, tmp_path / "ck", {"compression_config": {"quant_method": "compressed-tensors",
                                                                              "format": "pack-quantized"}})
    with pytest.raises(ModelLoadError, match=r"'compressed-tensors' \(format pack-quantized\).*compression_config"):
        LLM(str(path))


def test_mili_serve_exits_nonzero_naming_the_method(tiny_checkpoint, plain_weights, tmp_path):
    qconfig, _ = QUANTIZED["bitsandbytes"]
    path = derived(tiny_checkpoint, tmp_path / "bnb", {"quantization_config": qconfig},
                   quantize(plain_weights, "bitsandbytes"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mili.cli", "serve", str(path), "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "quantized with 'bitsandbytes' (load_in_8bit True)" in proc.stderr
    assert "Uvicorn running" not in proc.stderr and elapsed < 60


def test_extra_tensor_is_an_error_naming_it(tiny_checkpoint, plain_weights, tmp_path):
    extra = {**plain_weights, "model.layers.0.mlp.adapter.weight": torch.zeros(4, 4)}
    path = derived(tiny_checkpoint, tmp_path / "ck", tensors=extra)
    with pytest.raises(ModelLoadError, match=r"not part of Qwen3ForCausalLM, e\.g\. model\.layers\.0\.mlp\.adapter"
                                             r"\.weight.*another architecture"):
        LLM(str(path))


def test_scale_tensors_without_quantization_config_are_named_as_quantized(tiny_checkpoint, plain_weights,
                                                                          tmp_path):
    path = derived(tiny_checkpoint, tmp_path / "ck", tensors=quantize(plain_weights, "fp8_block"))
    with pytest.raises(ModelLoadError, match=r"weight_scale_inv.*likely a quantized checkpoint"):
        LLM(str(path))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.int32])
def test_integer_or_fp8_weight_without_quantization_config_is_refused(tiny_checkpoint, plain_weights, tmp_path,
                                                                      dtype):
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors = {**plain_weights, name: plain_weights[name].to(dtype)}
    path = derived(tiny_checkpoint, tmp_path / "ck", tensors=tensors)
    dtype_name = str(dtype).removeprefix("torch.")
    with pytest.raises(ModelLoadError, match=rf"{name} is stored as {dtype_name}.*does not cast it"):
        LLM(str(path))


@pytest.mark.parametrize("changes, message", [
    ({"use_sliding_window": True, "sliding_window": 64}, r"use_sliding_window: true \(sliding_window 64"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types has 'sliding_attention' \(layer 1"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, r"rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
])
def test_math_changing_settings_are_refused_before_weights(tiny_checkpoint, tmp_path, changes, message):
    path = derived(tiny_checkpoint, tmp_path / "ck", changes)
    (path / "model.safetensors").unlink()  # refused from the config alone
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path))


def test_harmless_tensors_still_load(tiny_checkpoint, plain_weights, tmp_path):
    """A rotary inv_freq buffer is computed by the model: skipping it changes nothing."""
    tensors = {**plain_weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}
    path = derived(tiny_checkpoint, tmp_path / "ck", tensors=tensors)
    greedy = dict(prompts={"prompt_token_ids": list(range(3, 20))}, use_tqdm=False)
    from mili import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = LLM(str(path), dtype="float32").generate(sampling_params=params, **greedy)[0].outputs[0].token_ids
    want = LLM(str(tiny_checkpoint), dtype="float32").generate(sampling_params=params, **greedy)[0].outputs[0].token_ids
    assert got == want
