"""Loading a checkpoint's safetensors into a built model (the folder itself: ``checkpoint.py``)."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from mili.distributed import kv_head_range, vocab_shard
from mili.errors import ModelLoadError
from mili.model import quant
from mili.model.checkpoint import safetensors_files
from mili.model.gguf import GGUFWeights, gguf_folder_files
from mili.model.checks import HARMLESS_SUFFIXES, WeightQuant, check_tensors, weight_quant
from mili.model.fused import EXPERT_PARAMS, STACKED_PARAMS, FusedExperts, FusedLinear
from mili.model.qwen3 import Qwen3ForCausalLM

log = logging.getLogger("mili")

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# the experts stacked in one tensor per projection (transformers 5's layout, Qwen3.6 MoE's releases)
_FUSED_EXPERTS = {"gate_up_proj": "w13", "down_proj": "w2"}


def _target(model: Qwen3ForCausalLM, name: str, params: dict[str, torch.nn.Parameter]):
    """(keys, the view of a parameter) that checkpoint tensor ``name`` fills, or None; a key names a view
    (parameter, expert, shard) so that every part of every parameter is seen to be loaded."""
    stem, _, last = name.rpartition(".")
    if stem.endswith(".mlp.experts") and last in _FUSED_EXPERTS:  # every expert's projection in one tensor
        pname = f"{stem}.{_FUSED_EXPERTS[last]}"
        if pname not in params:
            return None
        shards = 2 if last == "gate_up_proj" else 1
        return [(pname, e, s) for e in range(params[pname].shape[0]) for s in range(shards)], params[pname]
    expert = _EXPERT.match(name)
    if expert is not None:  # hub layout: one tensor per expert and projection, stacked here
        prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
        stacked, shard = EXPERT_PARAMS[proj]
        pname = f"{prefix}.{stacked}"
        if pname not in params or e >= params[pname].shape[0]:
            return None
        param = params[pname][e]
        if stacked == "w13":
            inter = param.shape[0] // 2
            param = param[shard * inter:(shard + 1) * inter]
        return [(pname, e, shard)], param
    for ckpt_name, (fused_name, shard) in getattr(model, "stacked_params", STACKED_PARAMS).items():
        if f".{ckpt_name}." in name:
            fused = name.replace(f".{ckpt_name}.", f".{fused_name}.")
            if fused in params:
                module: FusedLinear = model.get_submodule(fused.rsplit(".", 1)[0])
                offset, rows = module.shard_offset(shard), module.shard_sizes[shard]
                return [(fused, 0, offset)], params[fused][offset:offset + rows]
    if name in params:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, FusedLinear):  # a checkpoint that fuses the same projections (Qwen3-Next's)
            return [(name, 0, module.shard_offset(s)) for s in range(len(module.shard_sizes))], params[name]
        return [(name, 0, 0)], params[name]
    return None


def _tp_slice(name: str, cfg) -> tuple[int, list[tuple[int, int]]] | None:
    """(dimension, [(start, length), ...]) of checkpoint tensor ``name`` that this rank loads (the ranges
    concatenated), None for all of it."""
    if cfg.tp_size == 1:
        return None
    name = name.replace(".language_model.", ".")  # (the hub's Qwen3.5 layout)
    r, n, d = cfg.tp_rank, cfg.tp_size, cfg.head_dim
    if ".linear_attn." in name:
        return _linear_attention_slice(name, cfg)
    if name.endswith(".q_proj.weight"):  # the hybrids' gated attention: each head's query then its gate
        q = cfg.num_attention_heads * d * (2 if cfg.is_hybrid else 1)
        return 0, [(r * q, q)]
    if name.endswith((".k_proj.weight", ".v_proj.weight")):
        first, count = kv_head_range(cfg.total_num_key_value_heads, r, n)
        return 0, [(first * d, count * d)]
    if name.endswith(".o_proj.weight"):
        return 1, [(r * cfg.num_attention_heads * d, cfg.num_attention_heads * d)]
    if ".shared_expert." in name:
        inter = cfg.shared_expert_intermediate_size
    else:
        inter = cfg.moe_intermediate_size if ".experts." in name else cfg.intermediate_size
    if name.endswith((".gate_proj.weight", ".up_proj.weight")):
        return 0, [(r * inter, inter)]
    if name.endswith(".down_proj.weight"):
        return 1, [(r * inter, inter)]
    if name.endswith(".experts.gate_up_proj"):  # every expert's gate|up in one tensor [E, 2I, H]
        return 1, [(r * inter, inter), (n * inter + r * inter, inter)]
    if name.endswith(".experts.down_proj"):  # [E, H, I]
        return 2, [(r * inter, inter)]
    # (past the vocabulary: zeros, see _take; a decoder saved without its head keeps its table at the top)
    if name in ("model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight"):
        return 0, [vocab_shard(cfg.vocab_size, r, n)]
    return None


def _linear_attention_slice(name: str, cfg) -> tuple[int, list[tuple[int, int]]] | None:
    """A Gated DeltaNet tensor's rows (or ``out_proj``'s columns) for this rank's key heads [r Hk/N, (r+1) Hk/N)
    and the value heads they serve (consecutive: value head j belongs to key head j // (Hv / Hk)); the gated
    norm's weight (per value channel of a head) is replicated."""
    c, r, n = cfg.hf_config, cfg.tp_rank, cfg.tp_size
    hk, hv, dk, dv = c.linear_num_key_heads // n, c.linear_num_value_heads // n, c.linear_key_head_dim, \
        c.linear_value_head_dim
    key = n * hk * dk  # the checkpoint's q (and k) width
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):  # q | k | v, each sliced
        return 0, [(r * hk * dk, hk * dk), (key + r * hk * dk, hk * dk), (2 * key + r * hv * dv, hv * dv)]
    if name.endswith(".in_proj_z.weight"):
        return 0, [(r * hv * dv, hv * dv)]
    if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".dt_bias", ".A_log")):
        return 0, [(r * hv, hv)]
    # Qwen3-Next's fused projections, interleaved per key head: the rank's key heads are one run of rows
    # (reordered to q|k|v|z and b|a once read, by the model's reorder_checkpoint_tensor)
    if name.endswith(".in_proj_qkvz.weight"):
        group = 2 * dk + 2 * (hv // hk) * dv
        return 0, [(r * hk * group, hk * group)]
    if name.endswith(".in_proj_ba.weight"):
        group = 2 * (hv // hk)
        return 0, [(r * hk * group, hk * group)]
    if name.endswith(".out_proj.weight"):
        return 1, [(r * hv * dv, hv * dv)]
    return None


def _take(source, part: tuple[int, list[tuple[int, int]]]) -> torch.Tensor:
    """The ranges of ``part`` from a tensor or a safetensors slice (read from the file as slices), concatenated;
    what a range holds past the tensor's end (the padding of a vocabulary split over ranks) is zeros."""
    dim, ranges = part
    pieces = []
    for start, length in ranges:
        piece = source[(slice(None),) * dim + (slice(start, start + length),)]
        if piece.shape[dim] < length:
            missing = list(piece.shape)
            missing[dim] = length - piece.shape[dim]
            piece = torch.cat([piece, piece.new_zeros(missing)], dim)
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _read(f, name: str, cfg, dequant=None, keep_quantized: bool = False) -> torch.Tensor:
    """The checkpoint tensor, or only this rank's slice of it (read from the file as a slice); a quantized
    weight is read whole, dequantized, then sliced. Its quantized parts are kept too (``keep_quantized``)
    where a linear layer can use them: a whole matrix (no tensor-parallel slice), not an expert's."""
    if dequant is not None and dequant.quantized(name, f.get_slice(name).get_dtype()):
        weight = dequant.weight_name(name)
        part = _tp_slice(weight, cfg)
        tensor = dequant(name, f.get_tensor(name), keep_quantized and part is None and not _EXPERT.match(weight))
        return tensor if part is None else _take(tensor, part)
    part = _tp_slice(name, cfg)
    if part is None:
        return f.get_tensor(name)
    return _take(f.get_slice(name), part)


def _expected_keys(model: Qwen3ForCausalLM, params: dict[str, torch.nn.Parameter]) -> set[tuple]:
    keys = set()
    for n, p in params.items():
        module = model.get_submodule(n.rsplit(".", 1)[0])
        if isinstance(module, FusedLinear):
            keys |= {(n, 0, module.shard_offset(s)) for s in range(len(module.shard_sizes))}
        elif isinstance(module, FusedExperts):
            shards = 2 if n.endswith(".w13") else 1
            keys |= {(n, e, s) for e in range(p.shape[0]) for s in range(shards)}
        else:
            keys.add((n, 0, 0))
    return keys


def _skipped(model: Qwen3ForCausalLM, name: str) -> bool:
    """A checkpoint tensor the model does not need: computed by the model, tied to the embedding, or one the
    model's ``checkpoint_name`` leaves out (the hybrids' MTP head and vision tower)."""
    if hasattr(model, "checkpoint_name") and model.checkpoint_name(name) is None:
        return True
    return name.endswith(HARMLESS_SUFFIXES) or (name == "lm_head.weight" and model.config.tie_word_embeddings)


def _param_name(model, name: str) -> str:
    """The model's name for a checkpoint tensor (the hub's Qwen3.5 keeps its language model under
    ``model.language_model.``; a Qwen3 decoder saved without its head, as sentence-transformers saves Qwen3-Embedding,
    keeps it at the top: ``layers.0...`` for ``model.layers.0...``)."""
    if hasattr(model, "checkpoint_name"):
        return model.checkpoint_name(name)
    return name if name.startswith(("model.", "lm_head.", "score.")) else f"model.{name}"


@dataclass
class CheckpointMap:
    """What loading a checkpoint's tensors into a model would do (``map_checkpoint``), nothing copied."""

    skipped: list[str] = field(default_factory=list)  # tensors the model does not need (see ``_skipped``)
    unmapped: list[str] = field(default_factory=list)  # tensors no parameter of the model takes
    mismatched: list[str] = field(default_factory=list)  # tensors whose shape is not their parameter's
    missing: list[str] = field(default_factory=list)  # parameters (or parts) no tensor fills

    @property
    def complete(self) -> bool:
        return not (self.unmapped or self.mismatched or self.missing)


def map_checkpoint(model: Qwen3ForCausalLM, tensors: dict[str, torch.Tensor]) -> CheckpointMap:
    """Map a checkpoint's tensors (by name, as stored; meta tensors do: only names and shapes are read) onto
    ``model``'s parameters as ``load_weights`` does, copying nothing: a release's layout checked from its config."""
    params = dict(model.named_parameters())
    out, loaded = CheckpointMap(), set()
    for stored, tensor in tensors.items():
        if _skipped(model, stored):
            out.skipped.append(stored)
            continue
        name = _param_name(model, stored)
        target = _target(model, name, params)
        if target is None:
            out.unmapped.append(stored)
            continue
        keys, dest = target
        if hasattr(model, "reorder_checkpoint_tensor"):
            tensor = model.reorder_checkpoint_tensor(name, tensor)
        if tuple(tensor.shape) != tuple(dest.shape):
            out.mismatched.append(stored)
        loaded.update(keys)
    out.missing = sorted({f"{n}[{e}, {s}]" for n, e, s in _expected_keys(model, params) - loaded})
    return out


class _Dequantizer:
    """A quantized checkpoint's weights in float32, each from the tensors stored beside it (FP8: its scale;
    AWQ: its ``qweight``, ``qzeros`` and ``scales``). Asked to, it keeps a layer's quantized parts too, in
    ``kept`` by weight name (``quant.Fp8Parts`` / ``quant.Int4Parts``), for the linears that compute with
    them as they are (the CPU's int4 kernel, the Triton GEMMs)."""

    def __init__(self, quant: WeightQuant, where: dict[str, str]):
        self.quant, self.where = quant, where
        self.kept: dict = {}
        self.awq = quant.method == "awq"

    def is_aux(self, name: str) -> bool:
        """A tensor read only beside its weight (activation scales: activations are quantized dynamically)."""
        if self.awq:
            return name.endswith((".qzeros", ".scales"))
        return name.endswith((f".{self.quant.scale_suffix}", ".input_scale"))

    def weight_name(self, name: str) -> str:
        """The plain weight a checkpoint tensor stands for (AWQ's ``x.qweight`` is ``x.weight``)."""
        return name.removesuffix("qweight") + "weight" if self.awq and name.endswith(".qweight") else name

    def quantized(self, name: str, dtype: str) -> bool:
        if self.awq:
            return name.endswith(".qweight")
        return dtype.startswith("F8") and self._aux(name, self.quant.scale_suffix) in self.where

    def _aux(self, name: str, suffix: str) -> str:
        return name.removesuffix("qweight" if self.awq else "weight") + suffix

    def _get(self, name: str, suffix: str) -> torch.Tensor:
        aux = self._aux(name, suffix)
        if aux not in self.where:
            raise ModelLoadError(f"the quantized weight {name} has no {aux} beside it")
        with safe_open(self.where[aux], framework="pt") as f:
            return f.get_tensor(aux)

    def __call__(self, name: str, stored: torch.Tensor, keep: bool = False) -> torch.Tensor:
        if self.awq:
            try:
                parts = quant.awq_int4(stored, self._get(name, "qzeros"), self._get(name, "scales"),
                                       self.quant.group_size)
            except ValueError as e:
                raise ModelLoadError(f"{name}: {e}") from e
            if keep:
                self.kept[self.weight_name(name)] = parts
            return quant.dequantize_int4(*parts)
        scale = self._get(name, self.quant.scale_suffix)
        block = self.quant.block
        if block is not None and tuple(scale.shape) != quant.fp8_block_scale_shape(tuple(stored.shape), block):
            raise ModelLoadError(f"{self._aux(name, self.quant.scale_suffix)} has shape {tuple(scale.shape)}, the "
                                 f"weight {name} {tuple(stored.shape)} in {block[0]}x{block[1]} blocks needs "
                                 f"{quant.fp8_block_scale_shape(tuple(stored.shape), block)}")
        if keep:
            self.kept[name] = quant.fp8_parts(stored, scale, block)
        return quant.dequantize_fp8(stored, scale, block)


def _check_checkpoint(model: Qwen3ForCausalLM, files: list[str], params: dict,
                      quant: WeightQuant | None) -> _Dequantizer | None:
    """Read only the headers: every tensor must be a floating-point weight the model has (or harmless), or,
    in a quantized checkpoint MILI loads, a quantized weight (with its scales, checked as it loads)."""
    dtypes: dict[str, str] = {}
    where: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                dtypes[name], where[name] = f.get_slice(name).get_dtype(), file
    dequant = _Dequantizer(quant, where) if quant is not None else None
    found: dict[str, str] = {}
    unexpected: list[str] = []
    for name, dtype in dtypes.items():
        if _skipped(model, name) or (dequant is not None and dequant.is_aux(name)):
            continue
        if dequant is None or not dequant.quantized(name, dtype):
            found[name] = dtype
        if _target(model, _param_name(model, dequant.weight_name(name) if dequant else name), params) is None:
            unexpected.append(name)
    check_tensors(found, unexpected)
    visual = sum(n.startswith("model.visual.") and _skipped(model, n) for n in dtypes)
    if visual:
        log.info("skipping the vision tower's %d tensors (model.visual.*): MILI serves text only", visual)
    return dequant


@torch.no_grad()
def load_weights(model: Qwen3ForCausalLM, path: str, keep_quantized: bool = False) -> dict:
    """Copy every checkpoint tensor into ``model`` (converting the dtype); fail on missing, mismatched,
    unexpected or non-floating tensors before the first copy. Quantized weights are dequantized; with
    ``keep_quantized``, their layers' quantized parts are returned too (by weight name, see _Dequantizer)."""
    params = dict(model.named_parameters())
    expected = _expected_keys(model, params)
    gguf_files = gguf_folder_files(path)
    if gguf_files is not None:
        return _load_gguf(model, path, gguf_files, params, expected, keep_quantized)
    loaded: set[tuple] = set()
    files = safetensors_files(path)
    quant = weight_quant({"quantization_config": getattr(model.config.hf_config, "quantization_config", None)})
    dequant = _check_checkpoint(model, files, params, quant)
    if quant is not None:
        log.info("weights: %s, dequantized to %s as they load", quant.describe(),
                 str(next(iter(params.values())).dtype).removeprefix("torch."))
    with tqdm(total=len(expected), desc="Loading weights", unit="tensor", leave=False,
              disable=os.environ.get("MILI_NO_PROGRESS") == "1") as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:  # memory-mapped
                for stored in f.keys():
                    if _skipped(model, stored) or (dequant is not None and dequant.is_aux(stored)):
                        continue
                    name = _param_name(model, dequant.weight_name(stored) if dequant else stored)
                    keys, dest = _target(model, name, params)
                    tensor = _read(f, stored, model.config, dequant, keep_quantized)
                    if hasattr(model, "reorder_checkpoint_tensor"):
                        tensor = model.reorder_checkpoint_tensor(name, tensor)
                    if tensor.shape != dest.shape:
                        raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, the config "
                                             f"implies {tuple(dest.shape)}")
                    dest.copy_(tensor)
                    loaded.update(keys)
                    bar.update(1)
    missing = sorted({n for n, *_ in expected - loaded})
    if missing:
        raise ModelLoadError(f"checkpoint {path!r} lacks {len(missing)} weights, e.g. {missing[:3]}")
    return dequant.kept if dequant is not None else {}


def _load_gguf(model: Qwen3ForCausalLM, path: str, files: list[str], params: dict, expected: set,
               keep_quantized: bool) -> dict:
    """A GGUF model's tensors into ``model`` (model/gguf.py): each dequantized as gguf-py does, in float32, into the
    model's dtype; with ``keep_quantized``, each block-typed linear weight's quants too (``quant.GroupParts``, by
    weight name), for the kernels that compute with them as stored."""
    cfg = model.config
    weights = GGUFWeights(path, cfg.num_hidden_layers, getattr(cfg, "num_experts", 0) or 0)
    kept, loaded = {}, set()
    for gguf_name, name, value, parts in weights.items(keep_quantized):
        if _skipped(model, name) and name != "lm_head.weight":
            continue
        if parts is not None:
            kept[name] = parts
        target = _target(model, _param_name(model, name), params)
        if target is None and name != "lm_head.weight":
            raise ModelLoadError(f"GGUF tensor {gguf_name} ({name}) is not a weight of this model")
        if value is None:  # a tied head's parts (the table loads as the embedding), or an expert's parts alone
            if target is not None:  # (the expert: its layer is made from the parts, model_builder.apply_formats)
                loaded.update(target[0])
            continue
        keys, dest = target
        if value.shape != dest.shape:
            raise ModelLoadError(f"GGUF tensor {gguf_name} has shape {tuple(value.shape)}, the metadata implies "
                                 f"{tuple(dest.shape)}")
        dest.copy_(value)
        loaded.update(keys)
    missing = sorted({n for n, *_ in expected - loaded})
    if missing:
        raise ModelLoadError(f"the GGUF model {files[0]!r} lacks {len(missing)} weights, e.g. {missing[:3]}")
    log.info("weights: GGUF %s", ", ".join(f"{t} {n}" for t, n in weights.types.most_common()))
    return kept
