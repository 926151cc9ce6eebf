"""Tiny random checkpoints of the hybrid Qwen generation (Qwen3.5, Qwen3.5 MoE, Qwen3-Next), built with
transformers' own classes, and the hub's layouts made from them (the ForConditionalGeneration folder with
``mtp.*`` tensors added; the MoE experts fused per projection)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from support.checkpoints import add_tokenizer

# 4 layers: 3 Gated DeltaNet + 1 full attention (full_attention_interval 4); GQA in both kinds (2 key heads
# for 4 value heads), head_dim != hidden / heads, partial RoPE (a quarter of each head)
TEXT = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=1024,
            eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_hub", "qwen3_5_moe_fused")


def _model(kind: str, shape: dict | None = None):
    """``shape``: config fields that replace the defaults (TEXT, MOE and each kind's own)."""
    import transformers as tf

    shape = shape or {}
    if kind in ("qwen3_5", "qwen3_5_hub"):
        text = {**TEXT, "intermediate_size": 128, **shape}
        if kind == "qwen3_5":
            return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        return tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision,
                                                                   tie_word_embeddings=False))
    if kind in ("qwen3_5_moe", "qwen3_5_moe_fused"):
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**{**TEXT, **MOE, **shape}))
    # Qwen3-Next: layer 1 dense (mlp_only_layers), the others MoE with normalised top-k
    return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{**TEXT, **MOE, "intermediate_size": 96,
                                                         "mlp_only_layers": [1], "norm_topk_prob": True, **shape}))


def build_hybrid_checkpoint(path: Path, kind: str, seed: int = 0, weight_scale: float = 4.0,
                            mtp: bool = False, shape: dict | None = None) -> Path:
    """A random checkpoint folder of ``kind`` (see KINDS). Matrices are scaled up and norm weights randomised
    so logits are not flat (as checkpoints.build_checkpoint does). ``mtp``: random ``mtp.*`` tensors too (the hub
    layout has them always), the MoE head where the model is MoE (Qwen3-Next's config names no MTP layer)."""
    torch.manual_seed(seed)
    model = _model(kind, shape).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if p.dim() >= 2 and "embed" not in name and "conv1d" not in name:
                p.mul_(weight_scale)
            elif name.endswith("linear_attn.norm.weight"):  # the gated norm: a plain weight
                p.uniform_(0.5, 1.5)
            elif "norm" in name:  # zero-centred: the scale is 1 + w
                p.uniform_(-0.5, 0.5)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
    model.save_pretrained(path)
    add_tokenizer(path)
    if kind == "qwen3_5_hub" or mtp:
        _add_mtp_tensors(path, getattr(model.config, "text_config", model.config))
    if kind == "qwen3_5_moe_fused":
        _fuse_experts(path)
    return path


def build_scripted_hybrid_checkpoint(path: Path, chain: dict[int, int], hidden: int = 64, mtp: bool = False) -> Path:
    """A Qwen3.5 (``Qwen3_5ForCausalLM``, 3 Gated DeltaNet layers + 1 full attention, the real vocabulary) whose
    greedy next token is ``chain[current token]``: scripted.build_scripted_checkpoint's recipe on the hybrid class.
    Each token of the chain gets a one-hot embedding and every layer's residual branch is zeroed (out_proj,
    o_proj, down_proj), so the final hidden state is the current token's embedding (the zero-centred final norm
    scales by 1), which an untied lm_head maps to its successor. The linear-attention layers still run and keep
    their recurrent state in the engine's slots; they only add nothing to the residual stream. ``mtp``: with an
MTP head scripted alike: ``fc`` passes the token's normed embedding through, the layer's o_proj and down_proj
are zero, so mtp.norm's output is the token's embedding direction and the shared lm_head drafts its successor
(whatever the hidden state it is paired with)."""
    import transformers as tf
    from transformers import GenerationConfig

    assert len(chain) <= hidden
    torch.manual_seed(0)
    text = dict(TEXT, vocab_size=151936, hidden_size=hidden, intermediate_size=32, eos_token_id=151645,
                pad_token_id=151643, max_position_embeddings=2048)
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text)).float().eval()
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.normal_(0, 0.01)
        head.zero_()
        for name, p in model.named_parameters():
            if name.endswith(("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight")):
                p.zero_()
        model.model.norm.weight.zero_()
        for i, (current, nxt) in enumerate(chain.items()):
            emb[current].zero_()
            emb[current, i] = 1.0
            head[nxt, i] = 4.0  # a margin of 4 * sqrt(hidden) logits over every other token
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(path)
    add_tokenizer(path)
    if mtp:
        _add_mtp_tensors(path, model.config, scripted=True)
    return path


def _rewrite(path: Path, change) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _add_mtp_tensors(path: Path, text, scripted: bool = False) -> None:
    """The MTP head's tensors (mtp_tensors.md) at this model's sizes: the dense form's 15, or for an MoE model
    (``num_experts``) the routed experts one tensor each, the router and the shared expert with its gate
    (Qwen3-Next's layout). Random (norms in -0.5 .. 0.5, matrices of unit scale), or ``scripted`` (see
    build_scripted_hybrid_checkpoint)."""
    h, d = text.hidden_size, text.head_dim
    nq, nkv = text.num_attention_heads, text.num_key_value_heads
    shapes = {"fc.weight": (h, 2 * h), "norm.weight": (h,), "pre_fc_norm_embedding.weight": (h,),
              "pre_fc_norm_hidden.weight": (h,), "layers.0.input_layernorm.weight": (h,),
              "layers.0.post_attention_layernorm.weight": (h,),
              "layers.0.self_attn.q_proj.weight": (2 * nq * d, h), "layers.0.self_attn.k_proj.weight": (nkv * d, h),
              "layers.0.self_attn.v_proj.weight": (nkv * d, h), "layers.0.self_attn.o_proj.weight": (h, nq * d),
              "layers.0.self_attn.q_norm.weight": (d,), "layers.0.self_attn.k_norm.weight": (d,)}
    experts = getattr(text, "num_experts", 0) or 0
    mlps = {"layers.0.mlp": text.intermediate_size} if not experts else \
        {**{f"layers.0.mlp.experts.{e}": text.moe_intermediate_size for e in range(experts)},
         "layers.0.mlp.shared_expert": text.shared_expert_intermediate_size}
    for stem, inter in mlps.items():
        shapes.update({f"{stem}.gate_proj.weight": (inter, h), f"{stem}.up_proj.weight": (inter, h),
                       f"{stem}.down_proj.weight": (h, inter)})
    if experts:
        shapes.update({"layers.0.mlp.gate.weight": (experts, h), "layers.0.mlp.shared_expert_gate.weight": (1, h)})
    g = torch.Generator().manual_seed(1)
    tensors = {k: torch.rand(s, generator=g) - 0.5 if len(s) == 1 else torch.randn(s, generator=g) / s[1] ** 0.5
               for k, s in shapes.items()}
    if scripted:
        for k, t in tensors.items():
            if len(t.shape) == 1 or k.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
        tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    _rewrite(path, lambda t: t.update({f"mtp.{k}": v for k, v in tensors.items()}))


def _fuse_experts(path: Path) -> None:
    """Per-expert tensors -> ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]."""
    config = json.loads((path / "config.json").read_text())

    def fuse(t: dict) -> None:
        for layer in range(config["num_hidden_layers"]):
            stem = f"model.layers.{layer}.mlp.experts"
            experts = range(config["num_experts"])
            gate = [t.pop(f"{stem}.{e}.gate_proj.weight") for e in experts]
            up = [t.pop(f"{stem}.{e}.up_proj.weight") for e in experts]
            down = [t.pop(f"{stem}.{e}.down_proj.weight") for e in experts]
            t[f"{stem}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
            t[f"{stem}.down_proj"] = torch.stack(down)

    _rewrite(path, fuse)


def hf_reference(path: Path, kind: str, dtype: torch.dtype = torch.float32):
    """transformers' own model for the checkpoint (float32 unless ``dtype``), on its PyTorch path."""
    import transformers as tf

    from mili.tools.selftest.parity import hf_torch_paths

    hf_torch_paths()  # (not flash-linear-attention's Triton kernels, when installed: they need a GPU)

    cls = {"qwen3_5": tf.Qwen3_5ForCausalLM, "qwen3_5_hub": tf.Qwen3_5ForConditionalGeneration,
           "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM}[kind]
    return cls.from_pretrained(path, dtype=dtype).eval()
