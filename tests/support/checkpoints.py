"""Tiny random Qwen3 checkpoints (dense and MoE) built with transformers' own classes, and where the test data
lies. tests/conftest.py builds each one once per session; a test that needs another shape calls these itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "data"  # what the tests read: tests/data/README.md says where it came from
QWEN3_TOKENIZER = DATA / "qwen3-tokenizer"

# Three shapes: GQA with head_dim != hidden/heads and untied embeddings; MHA tied; GQA 4:1 on the
# real vocabulary size.
SHAPES = {
    "gqa_untied": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "mha_tied": dict(vocab_size=384, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=24, tie_word_embeddings=True),
    # heavy enough (~50M parameters, ~10 ms a decode step) that a request lasts about a second
    "slow": dict(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    "gqa4_realvocab": dict(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}


def add_tokenizer(path: Path, chat_template: str | None = None) -> None:
    """The real Qwen3 tokenizer in ``path`` as the hub's folders hold it: its tokenizer.json, and its
    tokenizer_config.json with the chat template inside (``chat_template`` replaces it). Copied, not written by
    ``save_pretrained``: transformers loads this form in about half the time (1.8 s against 3 s here), and every
    engine and server a test starts loads it. (The chat_template.jinja form save_pretrained writes is served by
    test_hybrid_serve.py and test_xml_tool_calls_serve.py.)"""
    shutil.copy(QWEN3_TOKENIZER / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((QWEN3_TOKENIZER / "tokenizer_config.json").read_text())
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def build_checkpoint(path: Path, shape: str, seed: int = 0, weight_scale: float = 8.0,
                     with_tokenizer: bool = True, **overrides) -> Path:
    """A random Qwen3 checkpoint folder. Non-embedding matrices are scaled up so logits are not flat
    (HF's default init gives near-ties everywhere, which makes greedy parity meaningless)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

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
        add_tokenizer(path)
    return path


def build_moe_checkpoint(path: Path, seed: int = 0, weight_scale: float = 8.0, hub_spelling: bool = False,
                         **overrides) -> Path:
    """A random Qwen3 MoE checkpoint (saved in the hub layout: one tensor per expert and projection).
    ``hub_spelling``: config.json says num_experts (as Qwen's releases) rather than num_local_experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                 mlp_only_layers=[], tie_word_embeddings=False)
    cfg = Qwen3MoeConfig(max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None, **{**shape, **overrides})
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.mul_(weight_scale)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    if hub_spelling:
        config = json.loads((path / "config.json").read_text())
        config["num_experts"] = config.pop("num_local_experts")
        (path / "config.json").write_text(json.dumps(config))
    add_tokenizer(path)
    return path


# MoE shapes (tests/conftest.py's moe_checkpoint): expert counts, top-k, norm_topk_prob, dense and sparse layers
MOE_SHAPES = {
    "e4_k2_sparse_dense": dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]),
    "e8_k3_norm_step2": dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2,
                             num_hidden_layers=4),
    "e6_k1_tied": dict(num_experts=6, num_experts_per_tok=1, norm_topk_prob=True, tie_word_embeddings=True),
}
