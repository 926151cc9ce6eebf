"""The demo's hybrid twin (``python -m mili.demo.train --arch hybrid``): a Qwen3.5 text model, HF
transformers' own ``Qwen3_5ForCausalLM`` (Gated DeltaNet linear attention in three layers of four, gated
full attention in the fourth), with a multi-token-prediction (MTP) head trained jointly.

The MTP head is wired as vLLM's ``Qwen3_5MultiTokenPredictor`` and llama.cpp's Qwen3.5 graph read the
released checkpoints' ``mtp.*`` tensors. For position i, with ``h[i]`` the trunk's last hidden state after
its final norm (the state the LM head scores)::

    e = pre_fc_norm_embedding(embed(token[i + 1]))
    x = fc(cat([e, pre_fc_norm_hidden(h[i])], -1))      # the embedding first
    x = layers.0(x)                                      # a gated full-attention decoder layer, causal over i,
                                                         # the backbone's rotary at position i
    logits = lm_head(norm(x))                            # the shared (here tied) LM head: token[i + 2]

The norms are Qwen3.5's zero-centred RMSNorm, x̂ · (1 + w). Saved, the head's tensors are ``mtp.*`` in the
backbone's ``model.safetensors`` (``mtp.layers.0.*`` named as a backbone full-attention layer's), and
``config.json`` says ``mtp_num_hidden_layers: 1``, as the hub's Qwen3.5 checkpoints have them; HF
transformers and MILI load the backbone and skip ``mtp.*``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

# The dense demo's widths (hidden 384, MLP 1024, 6 layers, 6 query / 2 KV heads of 64), laid out as Qwen3.5
# does: full attention every 4th layer (linear x3, full, linear x2), RoPE on a quarter of each head; the
# linear attention has 6 key and 6 value heads of 64.
HYBRID_SHAPE = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=64, full_attention_interval=4, linear_num_key_heads=6,
                    linear_num_value_heads=6, linear_key_head_dim=64, linear_value_head_dim=64,
                    linear_conv_kernel_dim=4)
MTP_WEIGHT = 0.3  # loss = next-token CE + MTP_WEIGHT * MTP CE (the token after next)
MTP_PREFIX = "mtp."


def hybrid_config(vocab_size: int, eot: int, im_end: int) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot, attn_implementation="sdpa",
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, **HYBRID_SHAPE)


class MTPHead(nn.Module):
    """The MTP head's parameters, named as the checkpoints' ``mtp.*`` tensors less the prefix."""

    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        layer_config = copy.deepcopy(config)  # the same layer as the backbone's full-attention ones
        layer_config.layer_types, layer_config.num_hidden_layers = ["full_attention"], 1
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps)
        for m in self.modules():  # as HF initialises the backbone: N(0, 0.02) linears, zero (= unit) norm gains
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=config.initializer_range)

    def forward(self, model: Qwen3_5ForCausalLM, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H]: the trunk's final (normed) hidden states at positions 0..T-1; next_ids [B, T]: the
        tokens at positions 1..T. Returns the head's normed states [B, T, H]; ``model.lm_head`` of them
        scores the tokens at positions 2..T+1."""
        e = self.pre_fc_norm_embedding(model.get_input_embeddings()(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        cos_sin = model.model.rotary_emb(x, positions)
        for layer in self.layers:  # no mask: SDPA's causal attention
            x = layer(x, position_embeddings=cos_sin, attention_mask=None)
        return self.norm(x)


def build_hybrid(tokenizer, seed: int) -> tuple[Qwen3_5ForCausalLM, MTPHead]:
    eot, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
    config = hybrid_config(len(tokenizer), eot, im_end)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float()
    return model, MTPHead(config).float()


def forward(model: Qwen3_5ForCausalLM, mtp: MTPHead, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of both heads over ``ids`` [B, N + 1] read as input ids[:, :N]: the main head's [B, N, V]
    (for ids[:, 1:]) and the MTP head's [B, N - 1, V] (for ids[:, 2:])."""
    hidden = model.model(input_ids=ids[:, :-1], use_cache=False).last_hidden_state  # after the final norm
    return model.lm_head(hidden), model.lm_head(mtp(model, hidden[:, :-1], ids[:, 1:-1]))


def losses(model: Qwen3_5ForCausalLM, mtp: MTPHead, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropy, MTP cross-entropy for the token after next), means over the batch."""
    logits, mtp_logits = forward(model, mtp, batch)
    v = logits.shape[-1]
    return (F.cross_entropy(logits.reshape(-1, v).float(), batch[:, 1:].reshape(-1)),
            F.cross_entropy(mtp_logits.reshape(-1, v).float(), batch[:, 2:].reshape(-1)))


@torch.no_grad()
def mtp_metrics(model: Qwen3_5ForCausalLM, mtp: MTPHead, ids: list[int], seq_len: int) -> dict:
    """The MTP head on the token list ``ids``, read in the windows ``train.cross_entropy`` reads: its
    cross-entropy and top-1 accuracy for the token after next, and how often its argmax equals the main
    head's greedy choice one position on (what a greedy verifier would accept of a one-token draft made
    from the true next token)."""
    model.eval()
    mtp.eval()
    ce, correct, agree, count = 0.0, 0, 0, 0
    for i in range(0, len(ids) - 1, seq_len):
        w = torch.tensor(ids[i:i + seq_len + 1])[None]
        if w.shape[1] < 3:
            continue
        logits, mtp_logits = forward(model, mtp, w)
        guess = mtp_logits[0].argmax(-1)
        ce += F.cross_entropy(mtp_logits[0].float(), w[0, 2:], reduction="sum").item()
        correct += (guess == w[0, 2:]).sum().item()
        agree += (guess == logits[0, 1:].argmax(-1)).sum().item()
        count += guess.shape[0]
    return {"mtp_heldout_ce": round(ce / count, 4), "mtp_heldout_accuracy": round(correct / count, 4),
            "mtp_agreement": round(agree / count, 4), "mtp_positions": count}


def save_mtp(mtp: MTPHead, folder: Path) -> None:
    """Add the head's tensors, bf16, as ``mtp.*`` to ``folder/model.safetensors`` (a backbone's save_pretrained)."""
    from safetensors.torch import load_file, save_file

    file = Path(folder) / "model.safetensors"
    tensors = load_file(file)
    tensors.update({MTP_PREFIX + k: v.detach().to(torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()})
    save_file(tensors, file, metadata={"format": "pt"})


def load_hybrid(folder, dtype: torch.dtype = torch.float32) -> tuple[Qwen3_5ForCausalLM, MTPHead]:
    """The backbone (HF's loader, which skips ``mtp.*``) and the MTP head, from a checkpoint folder."""
    from safetensors import safe_open

    model = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    mtp = MTPHead(model.config).to(dtype).eval()
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        state = {k.removeprefix(MTP_PREFIX): f.get_tensor(k).to(dtype) for k in f.keys() if k.startswith(MTP_PREFIX)}
    mtp.load_state_dict(state)  # strict: exactly the head's tensors
    return model, mtp
