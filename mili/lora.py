"""LoRA adapters: many fine-tunes of one base model, batched together in one step.

A PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) holds, for each target linear layer,
``lora_A`` [r, in] and ``lora_B`` [out, r]; the layer computes ``base(x) + s * B (A x)``, with s = alpha / r (rsLoRA:
alpha / sqrt(r)). MILI fuses q|k|v and gate|up into one layer each, so an adapter's shards of a fused layer are
stacked: A = [A_q; A_k; A_v] (3 r rows) and B block-diagonal (q's rows read A_q's part), one low-rank product for
the fused layer as for any other.

- ``Adapter.load``: a folder read, checked against the base (targets MILI runs, shapes, rank), refused by name
  where MILI cannot run it faithfully (DoRA, modules_to_save, trained biases, embeddings, the lm_head, MoE experts
  and the router).
- ``LoRALinear``: a linear layer (of any kind: bf16, int8, AWQ, FP8 kernels) with its adapters beside it, in
  ``max_loras`` slots of rank up to ``max_lora_rank``: every row's low-rank product in two matrix products over all
  slots, each row keeping its own slot's part (``LoRAStep``): no loop over sequences or adapters, no weight merge.
- ``LoRASlots``: the core's adapters: loaded ones kept in memory (``max_cpu_loras``, least recently used evicted),
  and which sits in which slot for a step.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mili.errors import InvalidRequest

# PEFT's module names in a decoder layer -> (MILI's module under the layer, shard; None: the whole of a fused layer
# that the checkpoint holds as one tensor, in the checkpoint's row order). Qwen3's attention and MLP; the hybrids'
# gated attention (q_proj holds each head's query and its gate) and Gated DeltaNet: Qwen3.5's
# separate in_proj_qkv / z / b / a, Qwen3-Next's interleaved in_proj_qkvz / ba.
_TARGETS = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
            "self_attn.v_proj": ("self_attn.qkv_proj", 2), "self_attn.o_proj": ("self_attn.o_proj", 0),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
            "mlp.down_proj": ("mlp.down_proj", 0),
            "linear_attn.in_proj_qkv": ("linear_attn.in_proj_qkvz", 0),
            "linear_attn.in_proj_z": ("linear_attn.in_proj_qkvz", 1),
            "linear_attn.in_proj_b": ("linear_attn.in_proj_ba", 0),
            "linear_attn.in_proj_a": ("linear_attn.in_proj_ba", 1),
            "linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkvz", None),
            "linear_attn.in_proj_ba": ("linear_attn.in_proj_ba", None),
            "linear_attn.out_proj": ("linear_attn.out_proj", 0)}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.(?:language_model\.)?layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's names): ``lora_name`` (what a server's clients send as ``model``),
    ``lora_int_id`` (a positive id, one per adapter), ``lora_path`` (the PEFT folder)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequest(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}",
                                 param="lora_request")


class Adapter:
    """One adapter's weights, in MILI's modules: {module name: (A [R, in], B [out, R])} with R = shards x rank
    (a fused layer's shards stacked, B block-diagonal) and the scale folded into B."""

    def __init__(self, name: str, rank: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.name, self.rank, self.weights = name, rank, weights

    @classmethod
    def load(cls, request: LoRARequest, layers: dict[str, tuple[int, list[int]]], max_rank: int,
             reorder=None) -> "Adapter":
        """Read and check ``request``'s folder against the base's layers ({module name: (in features, shard
        sizes)}: ``model_layers`` of the model, or ``config_layers`` of its config); InvalidRequest naming what is
        wrong. ``reorder(name, tensor)``: the model's row order of a fused layer's checkpoint tensor (Qwen3-Next's
        interleaved projections), applied to the B of an adapter on the whole layer."""
        folder = Path(request.lora_path)

        def bad(why: str) -> InvalidRequest:
            return InvalidRequest(f"LoRA adapter {request.lora_name!r} ({folder}): {why}", param="lora_request")

        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except FileNotFoundError:
            raise bad("no adapter_config.json (a PEFT adapter folder holds it)") from None
        except (OSError, ValueError) as e:
            raise bad(f"adapter_config.json cannot be read: {e}") from None
        if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise bad(f"peft_type {config.get('peft_type') if isinstance(config, dict) else None!r}: MILI runs LoRA "
                      "adapters")
        for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (whole trained layers)"),
                         ("target_parameters", "target_parameters (MoE experts)"), ("alpha_pattern", "alpha_pattern"),
                         ("fan_in_fan_out", "fan_in_fan_out"), ("lora_bias", "trained LoRA biases")):
            if config.get(key):
                raise bad(f"{why} is not supported")
        if config.get("bias", "none") != "none":
            raise bad(f"bias {config['bias']!r}: adapters that train the base's biases are not supported")
        alpha, rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))
        file = folder / "adapter_model.safetensors"
        if not file.is_file():
            raise bad("no adapter_model.safetensors")
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(file))
        except Exception as e:
            raise bad(f"adapter_model.safetensors cannot be read: {type(e).__name__}: {e}") from None
        parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if match is None:
                raise bad(f"tensor {key!r} targets a module MILI does not run adapters on (it runs them on the "
                          "decoder layers' attention, MLP and Gated DeltaNet projections: "
                          f"{', '.join(sorted({t.rsplit('.', 1)[1] for t in _TARGETS}))})")
            layer, target, which = int(match.group(1)), match.group(2), match.group(3)
            if target not in _TARGETS:
                raise bad(f"tensor {key!r}: {target} is not a target MILI runs (experts, the router, the shared "
                          "expert and its gate, embeddings and the lm_head are refused)")
            module, shard = _TARGETS[target]
            name = f"model.layers.{layer}.{module}"
            if name not in layers:
                raise bad(f"tensor {key!r}: the base model has no {name} (an adapter made for another base?)")
            if shard is None and which == "B" and reorder is not None:
                tensor = reorder(f"{name}.weight", tensor)
            parts.setdefault(name, {}).setdefault(shard, {})[which] = tensor
        if not parts:
            raise bad("no LoRA tensors")
        rank = max(t.shape[0] for shards in parts.values() for ab in shards.values() for k, t in ab.items() if k == "A")
        if rank > max_rank:
            raise bad(f"rank {rank} exceeds --max-lora-rank {max_rank}")
        weights = {name: _stack(shards, *layers[name], alpha, rslora, max_rank, bad) for name, shards in parts.items()}
        return cls(request.lora_name, rank, weights)


def _stack(shards: dict[int | None, dict[str, torch.Tensor]], in_features: int, shard_sizes: list[int],
           alpha: float, rslora: bool, max_rank: int, bad) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's A [shards x max_rank, in] and B [out, shards x max_rank] for one layer (its scale in B), B
    block-diagonal: shard j's rows read only its max_rank columns (what the kernels read). An adapter on the whole
    fused layer (shard None) is stored so too: its A in every shard's rows, and each shard's rows of its B in that
    shard's columns (B_j (A x) for each shard: the same product)."""
    width = len(shard_sizes) * max_rank
    a = torch.zeros(width, in_features, dtype=torch.float32)
    b = torch.zeros(sum(shard_sizes), width, dtype=torch.float32)
    if None in shards and len(shards) > 1:
        raise bad("an adapter on a fused projection both whole and by its parts")
    for shard, ab in shards.items():
        if set(ab) != {"A", "B"}:
            raise bad(f"a lora_A without its lora_B (or the reverse) in shard {shard} of a layer")
        la, lb = ab["A"].float(), ab["B"].float()
        rows, offset = (sum(shard_sizes), 0) if shard is None else (shard_sizes[shard], sum(shard_sizes[:shard]))
        r = la.shape[0]
        if la.shape != (r, in_features) or lb.shape != (rows, r):
            raise bad(f"lora_A {tuple(la.shape)} and lora_B {tuple(lb.shape)} do not fit the base's layer "
                      f"({in_features} in, {rows} out): an adapter made for another base?")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        for j in range(len(shard_sizes)) if shard is None else (shard,):
            start, n = sum(shard_sizes[:j]), shard_sizes[j]
            a[j * max_rank:j * max_rank + r] = la
            b[start:start + n, j * max_rank:j * max_rank + r] = lb[start - offset:start - offset + n] * scale
    return a, b


def model_layers(model: nn.Module) -> dict[str, tuple[int, list[int]]]:
    """The LoRALinear layers of a model: {name: (in features, shard sizes)}."""
    return {name: (m.in_features, m.shard_sizes) for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def config_layers(cfg) -> dict[str, tuple[int, list[int]]]:
    """The same, from a model's config (``mili.config.ModelConfig``: Qwen3 dense and MoE, the hybrids, Qwen3-VL's
    language model): what an API process checks an adapter against before any request uses it."""
    hidden, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sparse = cfg.sparse_layers or (False,) * cfg.num_hidden_layers
    kinds = cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers
    layers = {}
    for i in range(cfg.num_hidden_layers):
        at = f"model.layers.{i}"
        if kinds[i] == "linear_attention":
            from mili.model.qwen3_5 import LinearAttentionShape

            s = LinearAttentionShape.of(cfg.hf_config)
            layers[f"{at}.linear_attn.in_proj_qkvz"] = (hidden, [s.conv_dim, s.value_dim])
            layers[f"{at}.linear_attn.in_proj_ba"] = (hidden, [s.num_v_heads, s.num_v_heads])
            layers[f"{at}.linear_attn.out_proj"] = (s.value_dim, [hidden])
        else:  # (a hybrid's gated attention: q_proj holds each head's query and its gate)
            layers[f"{at}.self_attn.qkv_proj"] = (hidden, [2 * q if cfg.is_hybrid else q, kv, kv])
            layers[f"{at}.self_attn.o_proj"] = (q, [hidden])
        if not sparse[i]:
            layers[f"{at}.mlp.gate_up_proj"] = (hidden, [cfg.intermediate_size] * 2)
            layers[f"{at}.mlp.down_proj"] = (cfg.intermediate_size, [hidden])
    return layers


class LoRAStep:
    """A step's token rows by adapter slot, shared by every LoRALinear (set before the model runs): ``active`` when
    any row runs an adapter, and per slot width W the [T, slots x W] mask that keeps each row's own slot; on the
    Triton path (``triton``) the rows grouped by slot instead (``segments``, made once a step for every layer)."""

    def __init__(self, max_loras: int, triton: bool = False):
        self.max_loras, self.triton = max_loras, triton
        self.active = False
        self.slots: torch.Tensor | None = None  # [T] each row's slot (-1: the base model alone)
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.segments = None  # (Triton) mili.kernels.triton.lora.LoRASegments of the step's adapter rows

    def set(self, token_slots: list[int], device: torch.device) -> None:
        self.active = any(s >= 0 for s in token_slots)
        self.slots = torch.tensor(token_slots, dtype=torch.long, device=device) if self.active else None
        self._masks = {}
        self.segments = None
        if self.active and self.triton:
            from mili.kernels.triton import lora as triton_lora

            self.segments = triton_lora.segments(token_slots, device)

    def mask(self, width: int, dtype: torch.dtype, columns: int) -> torch.Tensor:
        """[T, columns]: 1 in the max_loras x ``width`` columns of each row's slot, 0 elsewhere (a base row, and
        the padding past max_loras x width: all 0)."""
        key = (width, dtype, columns)
        mask = self._masks.get(key)
        if mask is None:
            slots = torch.arange(self.max_loras, device=self.slots.device)
            mask = (self.slots[:, None] == slots[None, :]).to(dtype)
            mask = mask[:, :, None].expand(-1, -1, width).reshape(len(self.slots), -1)
            mask = self._masks[key] = torch.nn.functional.pad(mask, (0, columns - mask.shape[1]))
        return mask


class LoRALinear(nn.Module):
    """``base`` (any linear layer) with ``max_loras`` adapter slots: y = base(x) + B_s (A_s x) for the rows of slot
    s (B holds the scale). A fused layer's shards (``shard_sizes``) each have their own A rows and B columns.

    Every slot's A is stacked into one [slots x W, in] matrix and every B into one [out, slots x W]: a step computes
    u = x A^T for all slots at once, keeps each row's own slot's columns (``LoRAStep.mask``), and adds u B^T. Two
    products a layer whatever the adapters in the step. On MILI's CPU kernels (bf16) kernels.c's mili_lora_add runs
    it on the linear kernel, A and each shard's B packed as weights (B per shard: its block-diagonal zeros never
    read), the same call in the module path and in the fused decode layer (a decode step's rows are few: gathering
    each adapter's rows, or torch's bf16 products on small shapes, cost more than the slots' extra columns). On the
    Triton path (``triton``: CUDA, or the CPU under TRITON_INTERPRET) each row computes its own slot's product only
    (``mili.kernels.triton.lora.lora_add``: the rows grouped by slot, ``LoRAStep.segments``), added into base(x) in
    place."""

    def __init__(self, base: nn.Module, in_features: int, shard_sizes: list[int], max_loras: int, max_rank: int,
                 step: LoRAStep, dtype: torch.dtype, device: torch.device, kernels: bool = False,
                 triton: bool = False):
        super().__init__()
        self.base, self.shard_sizes, self.step = base, shard_sizes, step
        self.in_features, self.max_rank, self.max_loras = in_features, max_rank, max_loras
        self.width = len(shard_sizes) * max_rank
        out = sum(shard_sizes)
        # (the slots' columns padded to a multiple of 32: the width MILI's CPU kernels take)
        self.columns = -(-max_loras * self.width // 32) * 32
        self.lora_a = torch.zeros(self.columns, in_features, dtype=dtype, device=device)  # [slots x W (+pad), in]
        self.lora_b = torch.zeros(out, self.columns, dtype=dtype, device=device)  # [out, slots x W (+pad)]
        # on MILI's CPU kernels (bf16): A and each shard's B packed (again when a slot changes), kernels.c's view
        self.desc = None
        if kernels and len(shard_sizes) <= 3:
            from mili.kernels.cpu import ops as cpu_ops

            self.kb = -(-max_loras * max_rank // 32) * 32  # (each shard's columns of every slot, padded)
            self.packed_a = cpu_ops.pack_weight(self.lora_a)
            self.packed_b = [cpu_ops.pack_weight(torch.zeros(n, self.kb, dtype=dtype)) for n in shard_sizes]
            self.desc = cpu_ops.LoRADesc(self.packed_a.data_ptr(), (ctypes.c_void_p * 3)(
                *(b.data_ptr() for b in self.packed_b)), (ctypes.c_int64 * 3)(*shard_sizes), len(shard_sizes),
                self.columns, self.width, max_rank, max_loras, self.kb)
        self.triton = triton
        self.shard_ends = None  # (Triton) each shard's end, for the kernel
        if triton:
            from mili.kernels.triton import lora as triton_lora

            self.shard_ends = triton_lora.shard_ends(shard_sizes, device)

    def load_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's weights for this layer in ``slot`` (None: it does not target this layer: zeros)."""
        cols = slice(slot * self.width, (slot + 1) * self.width)
        if weights is None:
            self.lora_a[cols].zero_()
            self.lora_b[:, cols].zero_()
        else:
            self.lora_a[cols].copy_(weights[0])
            self.lora_b[:, cols].copy_(weights[1])
        if self.desc is not None:  # (packed in place: the kernels' pointers stay valid)
            from mili.kernels.cpu import ops as cpu_ops

            self.packed_a.copy_(cpu_ops.pack_weight(self.lora_a))
            r, offset = self.max_rank, 0
            for j, (n, packed) in enumerate(zip(self.shard_sizes, self.packed_b)):
                columns = torch.tensor([s * self.width + j * r + i for s in range(self.max_loras) for i in range(r)])
                b = self.lora_b.new_zeros(n, self.kb)
                b[:, :len(columns)] = self.lora_b[offset:offset + n, columns]
                packed.copy_(cpu_ops.pack_weight(b))
                offset += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.step.active:
            return y
        if self.triton:
            from mili.kernels.triton import lora as triton_lora

            y = y if y.is_contiguous() else y.contiguous()
            return triton_lora.lora_add(y, x.reshape(-1, self.in_features), self.lora_a, self.lora_b,
                                        self.step.segments, self.width, self.max_rank, self.shard_sizes,
                                        self.shard_ends)
        if self.desc is not None:
            from mili.kernels.cpu import ops as cpu_ops

            return cpu_ops.lora_add(self.desc, x, y, self.step.slots)
        mask = self.step.mask(self.width, x.dtype, self.columns)
        return y + ((x @ self.lora_a.T) * mask) @ self.lora_b.T


def add_lora_layers(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                    device: torch.device, kernels: bool = False, triton: bool = False) -> LoRAStep:
    """Wrap every attention and MLP projection of ``model``'s decoder layers in a LoRALinear (after the linear layers
    are on their kernels; ``kernels``: the adapters' products on MILI's CPU kernels too; ``triton``: on the Triton
    kernel, which computes each row's own slot's product only); the LoRAStep they share is returned."""
    step = LoRAStep(max_loras, triton)
    for layer in model.model.layers:
        for path in sorted({module for module, _ in _TARGETS.values()}):
            parent_name, _, attr = path.rpartition(".")
            try:
                parent = layer.get_submodule(parent_name)
            except AttributeError:  # (a linear-attention layer has no self_attn, a dense one no shared expert)
                continue
            base = getattr(parent, attr, None)
            if base is None:  # (an MoE layer has no dense MLP)
                continue
            shards = list(getattr(base, "shard_sizes", None) or [_out_features(base)])
            setattr(parent, attr, LoRALinear(base, _in_features(base), shards, max_loras, max_rank, step, dtype,
                                             device, kernels, triton))
    return step


def _in_features(linear: nn.Module) -> int:
    return getattr(linear, "in_features", None) or linear.k


def _out_features(linear: nn.Module) -> int:
    return getattr(linear, "out_features", None) or linear.n


class LoRASlots:
    """The engine core's adapters: loaded ones kept in memory (``max_cpu_loras``: past it the least recently used
    one that no request in flight uses is dropped), and which adapter holds each of the model's ``max_loras``
    slots."""

    def __init__(self, model: nn.Module, step: LoRAStep, max_loras: int, max_rank: int, max_cpu_loras: int):
        self.model, self.step = model, step
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
        self.shapes = model_layers(model)
        self.loaded: OrderedDict[int, Adapter] = OrderedDict()  # by lora_int_id, least recently used first
        self.users: dict[int, int] = {}  # lora_int_id -> requests in flight that use it (never dropped meanwhile)
        self.slots: list[int | None] = [None] * max_loras  # the lora_int_id in each slot

    def acquire(self, request: LoRARequest) -> Adapter:
        """A new request's adapter, loaded (and checked) on first use, held until ``release``."""
        adapter = self.loaded.get(request.lora_int_id)
        if adapter is None:
            adapter = Adapter.load(request, self.shapes, self.max_rank,
                                   getattr(self.model, "reorder_checkpoint_tensor", None))
            self.loaded[request.lora_int_id] = adapter
        self.loaded.move_to_end(request.lora_int_id)
        self.users[request.lora_int_id] = self.users.get(request.lora_int_id, 0) + 1
        self._evict()
        return adapter

    def release(self, request: LoRARequest) -> None:
        """A request that used the adapter has left."""
        left = self.users.get(request.lora_int_id, 0) - 1
        if left > 0:
            self.users[request.lora_int_id] = left
        else:
            self.users.pop(request.lora_int_id, None)
        self._evict()

    def _evict(self) -> None:
        idle = [lora_id for lora_id in self.loaded if lora_id not in self.users]  # (least recently used first)
        while len(self.loaded) > self.max_cpu_loras and idle:
            lora_id = idle.pop(0)
            del self.loaded[lora_id]
            if lora_id in self.slots:
                self.slots[self.slots.index(lora_id)] = None

    def prepare(self, token_ids: list[int | None], device: torch.device) -> None:
        """Slots for the step's adapters (each token row's lora_int_id, or None for the base; the scheduler keeps
        them to max_loras), then the rows grouped by slot on every layer."""
        wanted = set(token_ids) - {None}
        for lora_id in wanted:
            if lora_id in self.slots:
                continue
            free = next(i for i, held in enumerate(self.slots) if held not in wanted)
            adapter = self.loaded[lora_id]
            for name, layer in self.layers.items():
                layer.load_slot(free, adapter.weights.get(name))
            self.slots[free] = lora_id
        self.step.set([-1 if t is None else self.slots.index(t) for t in token_ids], device)
