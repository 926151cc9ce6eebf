"""Shared fixtures: tiny random Qwen3 checkpoints built by the tests, and the real Qwen3 tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHARED = Path(os.environ.get("MILI_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
QWEN3_TOKENIZER = SHARED / "qwen3-tokenizer"

# Three shapes: GQA with head_dim != hidden/heads and untied embeddings; MHA tied; GQA 4:1 on the
# real vocabulary size.
SHAPES = {
    "gqa_untied": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "mha_tied": dict(vocab_size=384, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=24, tie_word_embeddings=True),
    "gqa4_realvocab": dict(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}


def build_checkpoint(path: Path, shape: str, seed: int = 0, weight_scale: float = 8.0,
                     with_tokenizer: bool = True, **overrides) -> Path:
    """A random Qwen3 checkpoint folder. Non-embedding matrices are scaled up so logits are not flat
    (HF's default init gives near-ties everywhere, which makes greedy parity meaningless)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None, **{**SHAPES[shape], **overrides})
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(weight_scale)
            elif "norm" in name:  # non-trivial norm weights exercise the q/k norms
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    if with_tokenizer:
        AutoTokenizer.from_pretrained(QWEN3_TOKENIZER).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_checkpoint(root / name, name) for name in SHAPES}


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoints) -> Path:
    return checkpoints["gqa_untied"]


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
