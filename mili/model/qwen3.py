"""Qwen3 dense (Qwen3ForCausalLM) and Qwen3 MoE (Qwen3MoeForCausalLM) over a paged KV cache, in one
readable file: the MoE model is the dense one with experts in place of the MLP in its sparse layers.

Differences from the HF module, all numerically neutral: q/k/v and gate/up projections are fused,
the batch is flat ([T] tokens of many sequences, positions explicit), attention goes through a
backend that reads and writes the paged pool, the residual stream is carried beside the hidden
state (so a kernel can fuse the add into the next norm), norms, RoPE and SwiGLU come from an ops
set (torch, Triton or MILI's CPU kernels), and logits are computed only for sampled positions.

MoE layers: a router (softmax over the experts in float32, the top k, renormalised when
``norm_topk_prob``, cast back, as HF) and the experts' weights stacked per projection, gate|up as
``w13`` [E, 2I, H] and down as ``w2`` [E, H, I]. The (token, expert) pairs are sorted by expert and each
expert multiplies its rows in one matrix product (a loop over experts, never over tokens); on the CPU
``swap_linears`` gives each expert MILI's kernel linears (bf16 or int8) over its slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mili.config import ModelConfig
from mili.distributed import all_reduce, gather_logits, vocab_shard
from mili.kernels.reference import TorchOps
from mili.model.fused import FusedExperts, FusedLinear, RouterLinear
from mili.model.layers import RMSNorm, RotaryEmbedding
from mili.model.batch import AttentionBackend, ForwardBatch

class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, ops=TorchOps):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg.hf_config, "attention_bias", False))
        self.qkv_proj = FusedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias, dtype)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.backend, self.ops = backend, ops
        self.tp_size = cfg.tp_size
        # FP8 KV pages hold K / k_scale and V / v_scale (1.0: checkpoints' k_scale / v_scale are not read yet)
        self.kv_scales = (1.0, 1.0)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj(h).split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k, v = k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        fused = getattr(self.backend, "qk_norm_rope_store", None)  # (Triton: the K/V store in the norm's launch)
        if fused is not None:
            q = fused(q, k, v, *norms, cos_sin, k_cache, v_cache, batch, self.kv_scales)
            o = self.backend.forward(q, None, None, k_cache, v_cache, batch, self.kv_scales, stored=True)
        else:
            q, k = self.ops.qk_norm_rope(q, k, *norms, *cos_sin)
            o = self.backend.forward(q, k, v, k_cache, v_cache, batch, self.kv_scales)
        return _reduce(self.o_proj(o.reshape(t, -1)), self.tp_size)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops=TorchOps):
        super().__init__()
        self.ops = ops
        inter = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, [inter, inter], False, dtype)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False, dtype=dtype)
        self.tp_size = cfg.tp_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _reduce(self.partial(h), self.tp_size)

    def partial(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (the whole output without tensor parallelism), before the all-reduce."""
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(h)))


def _reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum a row-parallel product's partial results over the ranks (tensor parallelism)."""
    return all_reduce(x) if tp_size > 1 else x


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r V/N, (r+1) V/N) of the table (V padded up to a multiple of N: the last rank's
    padded rows are zeros no id reaches): it looks up its own ids, zeros the others, and the ranks' sum is
    the embedding."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.start, part = vocab_shard(cfg.vocab_size, cfg.tp_rank, cfg.tp_size)
        self.weight = nn.Parameter(torch.empty(part, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)
        return all_reduce(out)


class Qwen3MoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops=TorchOps):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = RouterLinear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, ops)
        self.tp_size = cfg.tp_size  # tensor parallel: every rank has every expert, a slice of its columns

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _reduce(self.partial(h), self.tp_size)

    def partial(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (its expert columns), before the all-reduce."""
        logits = self.gate(h)
        weights, ids = logits.softmax(dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return self.experts(h, weights.to(h.dtype), ids)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, ops=TorchOps,
                 sparse: bool = False):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, backend, dtype, ops)
        self.mlp = Qwen3MoeBlock(cfg, dtype, ops) if sparse else Qwen3MLP(cfg, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(self, h, residual, batch, cos_sin, k_cache, v_cache):
        """HF's ``h = h + attn(norm(h)); h = h + mlp(norm(h))``, with each add fused into the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, batch, cos_sin, k_cache, v_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, ops=TorchOps):
        super().__init__()
        # from_pretrained: no random init (nn.Embedding's normal_ would pull in torch._dynamo and triton,
        # ~140 MB of resident memory, when the model is built on the meta device)
        self.embed_tokens = (VocabParallelEmbedding(cfg, dtype) if cfg.tp_size > 1 else
                             nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)))
        sparse = cfg.sparse_layers or (False,) * cfg.num_hidden_layers
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, backend, dtype, ops, sparse[i])
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class ClassifierHead(nn.Module):
    """A sequence-classification head (transformers' ``score``: a linear layer without bias), its logits computed
    in float32 from the model's dtype, as the pooler reads them (``mili/runtime/pooler.py``)."""

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight.float())


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, ops=TorchOps):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, backend, dtype, ops)
        # Tied checkpoints have no lm_head: logits come from the embedding table (unless a CPU linear
        # swap gives the head a copy of its own in another layout, see model/cpu_linear.py).
        self.lm_head = (None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, vocab_shard(cfg.vocab_size, cfg.tp_rank, cfg.tp_size)[1], bias=False, dtype=dtype))
        self.rotary: RotaryEmbedding | None = None  # built by init_rotary once weights are on the device
        # a sequence-classification checkpoint's head (``score.weight``): a plain module, which no linear swap takes
        self.score = ClassifierHead(cfg.hidden_size, cfg.num_labels, dtype) if cfg.num_labels else None

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.config.hf_config, max_positions, device)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The final hidden states of the rows in ``batch.logits_indices``: [S, hidden]."""
        h, residual = self.model.embed_tokens(batch.input_ids), None
        cos_sin = self.rotary.lookup(batch.positions)
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, batch, cos_sin, k_cache, v_cache)
        rows = batch.logits_indices
        return self.model.norm(h[rows], residual[rows])[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, vocab]; with tensor parallelism each rank computes its vocabulary shard, then all gather (cut to
        the vocabulary: the padding is never sampled)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return gather_logits(logits, self.config.vocab_size, self.config.tp_size)
