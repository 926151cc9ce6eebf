"""The hybrid Qwen generation: Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 / 3.6 (Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM and the hub's ...ForConditionalGeneration checkpoints with their vision tower), in one
readable file beside qwen3.py, whose MLP, experts and fused linears it reuses.

Three layers in four are Gated DeltaNet linear attention (``linear_attn``: a per-sequence recurrent state,
a conv state and an SSM state, in the runner's state pool), the others gated full attention over the
paged KV pool (``q_proj`` holds each head's query then its output gate; q/k norms; RoPE on the first
``partial_rotary_factor`` of each head). Norms are zero-centred, x̂ · (1 + w), but the gated norm inside
the linear attention (plain weight). Numerics follow HF transformers; as in qwen3.py the batch is flat
([T] tokens of many sequences, decodes first) and the residual stream is carried beside the hidden state.

Checkpoint layouts: Qwen3.5's separate ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a`` load into
the fused ``in_proj_qkvz`` / ``in_proj_ba`` (shards q|k|v, z and b, a); Qwen3-Next's fused projections are
interleaved per key head ([q k v z] of each key head's group, [b a] likewise) and are reordered on load
(``reorder_checkpoint_tensor``). ``model.visual.*`` is the vision tower (model/vision.py: Qwen3-VL's without
DeepStack; skipped with ``vision=False``): images replace their tokens' embeddings, positions are then M-RoPE
(model/mrope.py). ``mtp.*`` (the MTP head) loads only when speculative decoding asks for it (``mtp=True``:
``MultiTokenPredictor``, below).

Tensor parallelism (as qwen3.py's): each rank holds an even share of the linear attention's key heads and the
value heads they serve (value heads are grouped consecutively per key head), of the attention heads (each
with its gate) and KV heads, of the MLP and expert columns and of the vocabulary; ``out_proj``, ``o_proj``
and the MLP / experts (with the shared expert, weighted by its replicated gate) are row-parallel, one
all-reduce each. The loader reads each rank's slices (loader._tp_slice).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mili.config import ModelConfig
from mili.distributed import gather_logits, vocab_shard
from mili.host_copy import tensor_on
from mili.kernels.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_step,
)
from mili.kernels.reference import TorchOps, rotate_half
from mili.model.batch import AttentionBackend, ForwardBatch
from mili.model.fused import STACKED_PARAMS, FusedLinear
from mili.model.layers import GatedRMSNorm, RotaryEmbedding, ZeroCentredRMSNorm
from mili.model.qwen3 import Qwen3MLP, Qwen3MoeBlock, VocabParallelEmbedding, _reduce
from mili.model.vision import VisionOutput, VisionTower, flatten_patch_weight

# a prefill chunk this short runs on the CPU kernel's recurrence, token by token, rather than as a chunk of 64
SHORT_PREFILL = 16
# checkpoint name -> (fused parameter, shard): Qwen3's, and Qwen3.5's separate linear-attention projections
HYBRID_STACKED_PARAMS = {**STACKED_PARAMS, "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
                         "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}


def ssm_state_dtype(hf_config) -> torch.dtype:
    """The SSM state's storage dtype (``mamba_ssm_dtype``, float32 when absent); it is computed in float32."""
    return getattr(torch, str(getattr(hf_config, "mamba_ssm_dtype", None) or "float32").removeprefix("torch."))


@dataclass(frozen=True)
class LinearAttentionShape:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @classmethod
    def of(cls, hf_config, tp_size: int = 1) -> "LinearAttentionShape":
        """The checkpoint's shape, or a tensor-parallel rank's share of its heads (``tp_size`` > 1)."""
        c = hf_config
        return cls(c.linear_num_key_heads // tp_size, c.linear_num_value_heads // tp_size, c.linear_key_head_dim,
                   c.linear_value_head_dim, c.linear_conv_kernel_dim)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # q | k | v, the channels the conv runs over
        return 2 * self.key_dim + self.value_dim

    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv_dim, self.conv_kernel - 1

    def ssm_state_shape(self) -> tuple[int, int, int]:
        return self.num_v_heads, self.head_k_dim, self.head_v_dim


@dataclass
class RecurrentBatch:
    """Where each sequence of a step keeps its recurrent state (built once per step from the ForwardBatch):
    the decodes' slots as one index and which of them start a sequence (their state is zeros, not the
    slot's); each prefill chunk's (first row, last row + 1, slot, starts the sequence)."""

    decode_slots: torch.Tensor
    decode_keep: torch.Tensor | None  # [decodes] False where a decode is a sequence's first token, else None
    prefills: list[tuple[int, int, int, bool]]

    @classmethod
    def of(cls, batch: ForwardBatch) -> "RecurrentBatch":
        nd, slots = batch.num_decodes, batch.state_slots
        fresh = [batch.context_lens[i] == batch.query_lens[i] for i in range(batch.num_seqs)]
        device = batch.input_ids.device
        keep = tensor_on([not f for f in fresh[:nd]], device, torch.bool) if any(fresh[:nd]) else None
        prefills, start = [], nd
        for i in range(nd, batch.num_seqs):
            prefills.append((start, start + batch.query_lens[i], slots[i], fresh[i]))
            start += batch.query_lens[i]
        return cls(tensor_on(slots[:nd], device), keep, prefills)


class GatedDeltaNet(nn.Module):
    # the conv + gated delta rule's implementation, the execution plan's (set by the model builder): None for the
    # torch code below, or mili.kernels.gated_delta_fla's (flash-linear-attention's Triton kernels, on CUDA)
    kernels = None

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.shape = s = LinearAttentionShape.of(cfg.hf_config, cfg.tp_size)  # (this rank's heads)
        self.in_proj_qkvz = FusedLinear(cfg.hidden_size, [s.conv_dim, s.value_dim], False, dtype)
        self.in_proj_ba = FusedLinear(cfg.hidden_size, [s.num_v_heads, s.num_v_heads], False, dtype)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads, dtype=dtype))
        self.norm = GatedRMSNorm(s.head_v_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = nn.Linear(s.value_dim, cfg.hidden_size, bias=False, dtype=dtype)
        self.fused_decode = None  # MILI's C kernel for the decode step (the model builder's: use_cpu_kernel)
        self._float32: tuple[torch.Tensor, ...] | None = None

    def use_cpu_kernel(self) -> None:
        """Decode steps through kernels.c's mili_gdn_decode: the conv, the gates and the delta rule in one call,
        in place on the state slots (float32 copies of the conv weight and the gate parameters, made once)."""
        from mili.kernels.cpu import ops as cpu_ops

        self._float32 = (self.conv1d.weight[:, 0, :].float().contiguous(), self.A_log.float().contiguous(),
                         self.dt_bias.float().contiguous())
        self.fused_decode = cpu_ops

    def _split(self, x: torch.Tensor):
        s = self.shape
        q, k, v = x.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        lead = x.shape[:-1]
        return (q.reshape(*lead, s.num_k_heads, s.head_k_dim), k.reshape(*lead, s.num_k_heads, s.head_k_dim),
                v.reshape(*lead, s.num_v_heads, s.head_v_dim))

    def forward(self, h: torch.Tensor, rb: RecurrentBatch, conv_states: torch.Tensor,
                ssm_states: torch.Tensor) -> torch.Tensor:
        """h [T, hidden]; conv_states [slots, conv_dim, K - 1] and ssm_states [slots, Hv, Dk, Dv] are read at
        each sequence's slot and written back."""
        s, t = self.shape, h.shape[0]
        qkv, z = self.in_proj_qkvz(h).split(self.in_proj_qkvz.shard_sizes, dim=-1)
        ba = self.in_proj_ba(h)
        b, a = ba.split(self.in_proj_ba.shard_sizes, dim=-1)
        weight = self.conv1d.weight[:, 0, :]
        if self.kernels is not None:  # fla's (CUDA)
            core = self.kernels(qkv, *self._gates(b, a), weight, rb, conv_states, ssm_states, s)
            return self._output(core, z, h.dtype)
        core = torch.empty(t, s.num_v_heads, s.head_v_dim, dtype=torch.float32, device=h.device)
        nd = rb.decode_slots.shape[0]
        kernel = self.fused_decode
        if kernel is not None and not kernel.gdn_decode_supported(qkv, conv_states, ssm_states, s.head_k_dim,
                                                                   s.head_v_dim):
            kernel = None
        short = [p for p in rb.prefills if p[1] - p[0] <= SHORT_PREFILL] if kernel is not None else []
        if kernel is not None:  # the decodes in one call; a short prefill chunk's tokens one call each
            if nd:
                fresh = None if rb.decode_keep is None else ~rb.decode_keep
                core[:nd] = kernel.gdn_decode(qkv[:nd], ba[:nd], conv_states, ssm_states, rb.decode_slots, fresh,
                                              *self._float32, s.num_k_heads, s.head_k_dim, s.head_v_dim)
            for start, end, slot, fresh in short:  # (the recurrence beats a chunk padded to 64 here)
                slot_t = torch.tensor([slot])
                for i in range(start, end):
                    core[i:i + 1] = kernel.gdn_decode(
                        qkv[i:i + 1], ba[i:i + 1], conv_states, ssm_states, slot_t,
                        torch.tensor([fresh and i == start]), *self._float32, s.num_k_heads, s.head_k_dim,
                        s.head_v_dim)
            if nd + sum(end - start for start, end, _, _ in short) == t:
                return self._output(core, z, h.dtype)
        g, beta = self._gates(b, a)
        if nd and kernel is None:  # every decode in one pass
            conv0 = conv_states.index_select(0, rb.decode_slots)
            ssm0 = ssm_states.index_select(0, rb.decode_slots)
            if rb.decode_keep is not None:  # a sequence's first token starts from zeros, whatever the slot held
                conv0 = torch.where(rb.decode_keep[:, None, None], conv0, 0)
                ssm0 = torch.where(rb.decode_keep[:, None, None, None], ssm0, 0)
            x, conv1 = causal_conv1d_step(qkv[:nd], conv0, weight)
            core[:nd], ssm1 = recurrent_gated_delta_step(*self._split(x), g[:nd], beta[:nd], ssm0)
            conv_states.index_copy_(0, rb.decode_slots, conv1.to(conv_states.dtype))
            ssm_states.index_copy_(0, rb.decode_slots, ssm1.to(ssm_states.dtype))
        for start, end, slot, fresh in rb.prefills:  # each prefill chunk from its sequence's state
            if kernel is not None and end - start <= SHORT_PREFILL:
                continue  # (done above)
            conv0 = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
            x, conv1 = causal_conv1d(qkv[start:end], conv0, weight)
            core[start:end], ssm1 = chunk_gated_delta_rule(*self._split(x), g[start:end], beta[start:end],
                                                           None if fresh else ssm_states[slot])
            conv_states[slot] = conv1.to(conv_states.dtype)
            ssm_states[slot] = ssm1.to(ssm_states.dtype)
        return self._output(core, z, h.dtype)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta): the log decay -exp(A_log) softplus(a + dt_bias) in float32, and sigmoid(b)."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def _output(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        s, t = self.shape, core.shape[0]
        out = self.norm(core.to(dtype), z.reshape(t, s.num_v_heads, s.head_v_dim))
        return self.out_proj(out.reshape(t, s.value_dim))


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by sigmoid(gate), the gate coming from q_proj."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg.hf_config, "attention_bias", False))
        self.qkv_proj = FusedLinear(cfg.hidden_size, [2 * q_size, kv_size, kv_size], bias, dtype)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=bias, dtype=dtype)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.backend = backend

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        q_gate, k, v = self.qkv_proj(h).split(self.qkv_proj.shard_sizes, dim=-1)
        q, gate = q_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        q, k = _partial_rope(q, *cos_sin), _partial_rope(k, *cos_sin)
        o = self.backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim), k_cache, v_cache, batch)
        return self.o_proj(o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] channels of each head; the rest pass through."""
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


class SharedExpertMoeBlock(Qwen3MoeBlock):
    """Routed experts plus a shared expert, weighted by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__(cfg, dtype)
        shared = dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
        self.shared_expert = Qwen3MLP(shared, dtype)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # tensor parallel: the gate is replicated and the sum is linear, so one all-reduce of the ranks' shares
        shared = torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert.partial(h)
        return _reduce(super().partial(h) + shared, self.tp_size)


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, index: int):
        super().__init__()
        self.is_linear = cfg.layer_types[index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype)
        else:
            self.self_attn = GatedAttention(cfg, backend, dtype)
        sparse = cfg.sparse_layers and cfg.sparse_layers[index]
        self.mlp = SharedExpertMoeBlock(cfg, dtype) if sparse else Qwen3MLP(cfg, dtype)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.tp_size = cfg.tp_size

    def forward(self, h, residual, mix):
        """``mix(normed h)``: this layer's token mixer with its batch and cache bound (tensor parallel: its
        row-parallel output projection's share, summed over the ranks here)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(_reduce(mix(h), self.tp_size), residual)
        return self.mlp(h), residual


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(cfg, dtype) if cfg.tp_size > 1 else
                             nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)))
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, backend, dtype, i) for i in range(cfg.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class MultiTokenPredictor(nn.Module):
    """The checkpoint's MTP head (``mtp.*``; vLLM's Qwen3_5MultiTokenPredictor / Qwen3NextMultiTokenPredictor):
    for the pair (h, t) of the main model's final-normed hidden state at position p - 1 and the token at p,
    ``fc(cat([pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h)]))`` (embedding first), one gated
    full-attention decoder layer (the model's own layer class, dense MLP or the MoE block with its shared
    expert as the model's layers have) attending causally over the head's own KV of earlier pairs, at
    rotary position p, then ``mtp.norm``; the shared lm_head scores it (the token at p + 1) and its output is
    the h of the next pair when drafting on."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, cfg.rms_norm_eps, dtype)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, cfg.rms_norm_eps, dtype)
        self.fc = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        one = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=("full_attention",),
                                  sparse_layers=(cfg.is_moe,))
        self.layers = nn.ModuleList([HybridDecoderLayer(one, backend, dtype, 0)])
        self.norm = ZeroCentredRMSNorm(h, cfg.rms_norm_eps, dtype)

    def _input(self, input_ids: torch.Tensor, hidden: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        e = self.pre_fc_norm_embedding(embed(input_ids))
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, cos_sin, k_cache,
                v_cache, embed: nn.Module) -> torch.Tensor:
        """input_ids [T], hidden [T, H] (the pairs, at ``batch``'s positions and slots) -> [T, H] after mtp.norm."""
        layer = self.layers[0]
        x, residual = layer(self._input(input_ids, hidden, embed), None,
                            lambda y: layer.self_attn(y, batch, cos_sin, k_cache, v_cache))
        return self.norm(x, residual)[0]

    def write_kv(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, cos_sin, k_cache,
                 v_cache, embed: nn.Module) -> None:
        """Only the pairs' K/V into the head's pages (the attention runs, its output and the MLP do not)."""
        layer = self.layers[0]
        layer.self_attn(layer.input_layernorm(self._input(input_ids, hidden, embed)), batch, cos_sin, k_cache,
                        v_cache)


class Qwen3_5ForCausalLM(nn.Module):
    stacked_params = HYBRID_STACKED_PARAMS

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, ops=TorchOps,
                 mtp: bool = False, vision: bool = True):
        """``mtp``: build (and load) the MTP head too; the forward then keeps every row's final-normed hidden
        state in ``hidden_states`` for it. ``vision``: the checkpoint's vision tower (``model.visual.*``, where it
        has one: the hub's Qwen3.5 / 3.6) is built and loaded, and images replace their tokens' embeddings."""
        super().__init__()
        self.visual = VisionTower(cfg.vision_config, dtype) if vision and cfg.vision_config is not None else None
        self.config = cfg
        self.model = HybridModel(cfg, backend, dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, vocab_shard(cfg.vocab_size, cfg.tp_rank, cfg.tp_size)[1], bias=False, dtype=dtype))
        self.mtp = MultiTokenPredictor(cfg, backend, dtype) if mtp else None
        self.hidden_states: torch.Tensor | None = None  # (mtp) the last forward's rows, final-normed
        self.rotary: RotaryEmbedding | None = None
        self.linear_shape = LinearAttentionShape.of(cfg.hf_config, cfg.tp_size)  # (this rank's heads)

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.config.hf_config, max_positions, device)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                state_caches: list[tuple[torch.Tensor, torch.Tensor]],
                rb: RecurrentBatch | None = None) -> torch.Tensor:
        """The final hidden states of the rows in ``batch.logits_indices``. ``kv_caches``: one (K, V) pair per
        full-attention layer; ``state_caches``: one (conv states, SSM states) pair per linear-attention layer;
        ``rb``: where the states are (CUDA graphs pass their static slot buffers), else built from ``batch``."""
        h, residual = self.model.embed_tokens(batch.input_ids), None
        if batch.images is not None:  # (no DeepStack in this generation)
            h = h.index_copy(0, batch.images.rows, batch.images.embeds.to(h.dtype))
        cos_sin = self.rotary.lookup(batch.positions)
        rb = RecurrentBatch.of(batch) if rb is None else rb
        kv, states = iter(kv_caches), iter(state_caches)
        for layer in self.model.layers:
            if layer.is_linear:
                conv, ssm = next(states)
                mix = lambda x, layer=layer, conv=conv, ssm=ssm: layer.linear_attn(x, rb, conv, ssm)  # noqa: E731
            else:
                k_cache, v_cache = next(kv)
                mix = lambda x, layer=layer, k=k_cache, v=v_cache: layer.self_attn(x, batch, cos_sin, k, v)  # noqa: E731
            h, residual = layer(h, residual, mix)
        rows = batch.logits_indices
        if self.mtp is not None:  # every row's, for the MTP head's pairs (the norm is row by row)
            self.hidden_states = self.model.norm(h, residual)[0]
            return self.hidden_states[rows]
        return self.model.norm(h[rows], residual[rows])[0]

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], write_only: bool = False) -> torch.Tensor | None:
        """The MTP head over the pairs (``hidden`` [T, H], ``input_ids`` [T]) at ``batch``'s positions, with its
        KV pages ``kv_cache``: [T, H] after mtp.norm (None with ``write_only``: their K/V written only)."""
        cos_sin = self.rotary.lookup(batch.positions)
        run = self.mtp.write_kv if write_only else self.mtp
        return run(input_ids, hidden, batch, cos_sin, *kv_cache, self.model.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, vocab]; with tensor parallelism each rank computes its vocabulary shard, then all gather (cut to
        the vocabulary: the padding is never sampled)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return gather_logits(logits, self.config.vocab_size, self.config.tp_size)

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionOutput:
        """The vision tower over the image processor's output for one or more images (their tokens in order)."""
        return self.visual(pixel_values.to(self.visual.pos_embed.weight.device), grid_thw)

    # -- checkpoint layouts (the loader asks) ----------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """The parameter name a checkpoint tensor loads as, or None for tensors not loaded: the MTP head
        (``mtp.*``) unless the model has one, and the vision tower (``model.visual.*``) unless it has one."""
        if name.startswith("model.visual."):
            return name.removeprefix("model.") if self.visual is not None else None
        if name.startswith("mtp.") and self.mtp is None:
            return None
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name

    def reorder_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's fused projections, interleaved per key head, in the order q|k|v|z and b|a (with tensor
        parallelism the loader has read this rank's key-head groups, contiguous in that layout, and this
        reorders them: ``linear_shape`` is the rank's)."""
        if name == "visual.patch_embed.proj.weight":
            return flatten_patch_weight(tensor)
        s = self.linear_shape
        rep = s.num_v_heads // s.num_k_heads
        if name.endswith(".in_proj_qkvz.weight") and tensor.shape[0] == s.conv_dim + s.value_dim:
            groups = tensor.view(s.num_k_heads, -1, tensor.shape[-1])
            parts = groups.split([s.head_k_dim, s.head_k_dim, rep * s.head_v_dim, rep * s.head_v_dim], dim=1)
            return torch.cat([p.reshape(-1, tensor.shape[-1]) for p in parts])
        if name.endswith(".in_proj_ba.weight") and tensor.shape[0] == 2 * s.num_v_heads:
            b, a = tensor.view(s.num_k_heads, 2 * rep, tensor.shape[-1]).split([rep, rep], dim=1)
            return torch.cat([b.reshape(-1, tensor.shape[-1]), a.reshape(-1, tensor.shape[-1])])
        return tensor
