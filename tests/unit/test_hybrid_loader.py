"""The hybrids' checkpoint layouts at their released sizes: every tensor transformers' own model has (built on
the meta device from the published configs in tests/data/qwen3.5) maps onto a MILI parameter of the same
shape, and together they fill every MILI parameter (the vision tower's too, where the release has one); what MILI
cannot run is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from support.checkpoints import DATA
from mili.config import ModelConfig
from mili.errors import ModelLoadError
from mili.model import loader
from mili.model.qwen3_5 import Qwen3_5ForCausalLM
from mili.runtime.attention.torch_backend import TorchAttentionBackend


@pytest.mark.parametrize("release", ["Qwen3.5-0.8B", "Qwen3.6-35B-A3B", "Qwen3-Next-80B-A3B-Instruct"])
def test_released_layouts_map_onto_the_model(release, tmp_path):
    import transformers
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text((DATA / "qwen3.5" / f"{release}.config.json").read_text())
    hf_config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        reference = getattr(transformers, hf_config.architectures[0])(hf_config)
        model = Qwen3_5ForCausalLM(ModelConfig.from_hf(hf_config), TorchAttentionBackend(), torch.bfloat16)
    mapped = loader.map_checkpoint(model, reference.state_dict())  # (the tower's Conv3d reordered as it loads)
    assert not mapped.unmapped and not mapped.mismatched and not mapped.missing, mapped
    assert mapped.complete
    assert (model.visual is not None) == (getattr(hf_config, "vision_config", None) is not None)
    assert all(n.startswith("model.visual.") or n == "lm_head.weight" for n in mapped.skipped)


def test_linear_attention_outside_the_hybrids_is_still_refused(tiny_checkpoint, tmp_path):
    from mili import LLM

    path = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["linear_attention", "full_attention"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"layer_types has 'linear_attention' \(layer 0.*Qwen3-Next / Qwen3\.5"):
        LLM(str(path))


def test_an_unknown_ssm_state_dtype_is_refused(tmp_path):
    from transformers import AutoConfig

    config = json.loads((DATA / "qwen3.5" / "Qwen3.5-0.8B.config.json").read_text())
    config["text_config"]["mamba_ssm_dtype"] = "float8_e4m3fn"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mamba_ssm_dtype"):
        ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))


def test_qwen_fp8_release_layout_loads(hybrid_checkpoint, tmp_path):
    """The hub layout with Qwen's block FP8 (quantization_config at the top of config.json, weight_scale_inv
    beside each linear-attention, attention and MLP projection, partial blocks at these sizes): MILI computes
    with the dequantized weights and writes HF's greedy tokens for them."""
    from safetensors.torch import load_file, save_file

    from support.hybrid import hf_reference
    from support.parity import greedy_matches
    from mili import LLM, SamplingParams
    from mili.model.quant import dequantize_fp8, quantize_fp8_blocks

    plain = tmp_path / "plain"  # (a copy: its weights are replaced by the dequantized ones below)
    shutil.copytree(hybrid_checkpoint("qwen3_5_hub"), plain)
    fp8 = tmp_path / "fp8"
    shutil.copytree(plain, fp8)
    tensors, dequantized = load_file(plain / "model.safetensors"), {}
    quantized = (".in_proj_qkv.weight", ".in_proj_z.weight", ".out_proj.weight", "_proj.weight")
    for name in [n for n in tensors if n.startswith("model.language_model.") and n.endswith(quantized)
                 and ".in_proj_a." not in n and ".in_proj_b." not in n]:
        q, scale = quantize_fp8_blocks(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        dequantized[name] = dequantize_fp8(q, scale, (128, 128))
    save_file(tensors, fp8 / "model.safetensors")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(config))
    plain_tensors = load_file(plain / "model.safetensors")
    save_file({**plain_tensors, **dequantized}, plain / "model.safetensors")  # the reference: the same values
    reference = hf_reference(plain, "qwen3_5_hub")
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (1, 40, 130)]
    llm = LLM(str(fp8), dtype="float32", max_num_batched_tokens=64)
    assert "fp8" in llm.engine.plan.weight_format
    greedy_matches(llm, reference, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
