"""The loader on the forms checkpoints come in: sharded safetensors, both config spellings, dtypes; the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mili import LLM, SamplingParams
from mili.cli import main as cli_main

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(3, 40))}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), dtype="float32").generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_safetensors(tiny_checkpoint, tmp_path, reference):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / f, tmp_path / f)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    out = LLM(str(tmp_path), dtype="float32").generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == reference
    (tmp_path / sorted(set(index["weight_map"].values()))[1]).unlink()
    from mili import ModelLoadError

    with pytest.raises(ModelLoadError, match="missing"):
        LLM(str(tmp_path))


def test_real_qwen3_config_spelling(tiny_checkpoint, tmp_path, reference):
    """Real Qwen3 folders carry rope_theta and torch_dtype at the top level (transformers 4 style)."""
    shutil.copytree(tiny_checkpoint, tmp_path / "ck")
    cfg_path = tmp_path / "ck" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert "rope_parameters" in cfg and "dtype" in cfg  # what transformers 5 wrote
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_theta"], cfg["rope_scaling"] = theta, None
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg_path.write_text(json.dumps(cfg))
    out = LLM(str(tmp_path / "ck"), dtype="float32").generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == reference


def test_dtype_auto_and_conversion(tiny_checkpoint):
    assert LLM(str(tiny_checkpoint)).engine.plan.dtype == torch.float32  # the checkpoint's
    bf16 = LLM(str(tiny_checkpoint), dtype="bfloat16")
    assert bf16.apply_model(lambda m: m.model.embed_tokens.weight.dtype) == torch.bfloat16
    assert len(bf16.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10
    from mili import InvalidRequest

    with pytest.raises(InvalidRequest, match="dtype"):
        LLM(str(tiny_checkpoint), dtype="int3")


def test_cli_generate(qwen3_checkpoint, tiny_checkpoint, capsys):
    code = cli_main(["generate", str(qwen3_checkpoint("gqa4_realvocab")), "--dtype", "float32", "--prompt", "Hi",
                     "--prompt", "Yo", "--max-tokens", "5"])
    out = capsys.readouterr().out
    assert code == 0 and "--- 'Hi'" in out and "--- 'Yo'" in out
    assert cli_main(["generate", str(tiny_checkpoint / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
