"""The offline demo checkpoint: built locally, deterministically, loadable by transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mili.model.demo import DEMO_MODEL, DEMO_VERSION, demo_checkpoint


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory) -> Path:
    return Path(demo_checkpoint(tmp_path_factory.mktemp("cache-a")))


def test_builds_into_cache_dir(demo_path):
    assert DEMO_MODEL == "demo"
    assert demo_path.name == DEMO_VERSION
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"):
        assert (demo_path / f).is_file(), f
    # no temporary folders left beside it
    assert [p.name for p in demo_path.parent.iterdir()] == [DEMO_VERSION]
    # a second call reuses it
    mtime = (demo_path / "model.safetensors").stat().st_mtime_ns
    assert demo_checkpoint(demo_path.parent) == str(demo_path)
    assert (demo_path / "model.safetensors").stat().st_mtime_ns == mtime


def test_deterministic(demo_path, tmp_path):
    torch.manual_seed(99)
    state = torch.random.get_rng_state()
    other = Path(demo_checkpoint(tmp_path))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    for f in sorted(os.listdir(demo_path)):
        assert (demo_path / f).read_bytes() == (other / f).read_bytes(), f


def test_env_cache_dir(monkeypatch, tmp_path, demo_path):
    monkeypatch.setenv("MILI_CACHE_DIR", str(tmp_path / "envcache"))
    path = Path(demo_checkpoint())
    assert path == tmp_path / "envcache" / DEMO_VERSION
    assert (path / "model.safetensors").read_bytes() == (demo_path / "model.safetensors").read_bytes()


def test_config_and_tokenizer(demo_path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(demo_path)
    tok = AutoTokenizer.from_pretrained(demo_path)
    assert cfg.model_type == "qwen3"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 384, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 4096
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tok) == 261
    assert str(cfg.dtype).endswith("bfloat16")

    ids = {t: tok.convert_tokens_to_ids(t)
           for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]}
    assert list(ids.values()) == [256, 257, 258, 259, 260]
    assert tok.eos_token_id == ids["<|im_end|>"] == cfg.eos_token_id
    assert tok.pad_token_id == ids["<|endoftext|>"] == cfg.pad_token_id
    gen = json.loads((demo_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]

    # byte-level: every byte is one token, round trip is exact
    text = "Hi 👋🏽 你好 <think>x</think>"
    enc = tok.encode(text, add_special_tokens=False)
    assert enc[:3] == [ord("H"), ord("i"), ord(" ")] and ids["<think>"] in enc
    assert tok.decode(enc) == text
    assert tok.decode(enc + [ids["<|im_end|>"]], skip_special_tokens=True) == text  # think: not special

    from mili.tokenizer.tokenizer import apply_chat_template, load_eos_token_ids

    assert load_eos_token_ids(str(demo_path), tok, cfg) == [258, 256]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"}]
    assert apply_chat_template(tok, messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert apply_chat_template(tok, messages, True, {"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert apply_chat_template(tok, messages, False).endswith("Hello<|im_end|>\n")


def test_hf_forward(demo_path):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(demo_path)
    model = Qwen3ForCausalLM.from_pretrained(demo_path).eval()
    assert model.dtype == torch.bfloat16
    ids = tok.encode("<|im_start|>user\nHello<|im_end|>\n", add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits.float()).all()
    assert logits.float().std() > 0.1  # not flat
