"""What MILI refuses to load, by name, before a weight is read: a checkpoint it cannot run faithfully.

A quantized checkpoint read as if it held plain weights, a sliding-window model run with full
attention, or a tensor the model does not have would all load "fine" and answer garbage. vLLM and
SGLang refuse such checkpoints by name; so does MILI. Each check here raises ``ModelLoadError``
saying what was found and why it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from mili.errors import ModelLoadError

# RoPE types whose tables MILI computes once, as transformers does (no length-dependent rescaling).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# Keys of a quantization_config that tell a user which variant of a method the checkpoint uses.
_QUANT_DETAILS = ("fmt", "format", "weight_block_size", "bits", "group_size", "load_in_8bit", "load_in_4bit",
                  "bnb_4bit_quant_type", "version")
# Checkpoint tensors the model computes itself or shares with another tensor: harmless to skip.
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors dtypes a weight of a floating-point model can be stored in (converted on load).
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_DTYPE_NAMES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8",
                "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool"}


@dataclass(frozen=True)
class WeightQuant:
    """A quantized checkpoint MILI loads: Qwen's block-wise ``fp8`` (``weight_scale_inv`` per block),
    compressed-tensors ``float-quantized`` FP8 (``weight_scale`` per output channel or per tensor), or
    ``awq`` GEMM int4 (``qweight``/``qzeros`` packed 8 per int32, fp16 ``scales`` per group of input
    channels). The loader dequantizes each weight as it loads; the CPU then computes with those weights
    (float32) or maps them onto its int8 / int4 kernels (bf16)."""

    method: str
    block: tuple[int, int] | None  # fp8: weight_block_size
    scale_suffix: str  # the scale tensor beside each quantized weight
    ignore: tuple[str, ...] = ()
    bits: int = 8
    group_size: int = 0  # awq: input channels per scale and zero point
    file_type: str = ""  # gguf: the mix's name (Q4_K_M, Q8_0...)
    tensor_types: dict | None = None  # gguf: {type: tensors of it}

    def describe(self) -> str:
        if self.method == "gguf":
            from mili.model.gguf import describe_types

            return f"gguf {self.file_type} ({describe_types(self.tensor_types or {})})"
        if self.method == "awq":
            return f"awq int4 (group {self.group_size}, zero points)"
        if self.block is not None:
            return f"fp8 e4m3 ({self.block[0]}x{self.block[1]} blocks)"
        return "compressed-tensors fp8 e4m3 (per channel or tensor)"


def weight_quant(raw_config: dict) -> WeightQuant | None:
    """The quantization MILI loads that ``config.json`` declares, or None (none, or one MILI refuses)."""
    q = raw_config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    block = q.get("weight_block_size")
    if (q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") == "e4m3" and isinstance(block, list)
            and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return WeightQuant("fp8", (block[0], block[1]), "weight_scale_inv", tuple(q.get("modules_to_not_convert") or ()))
    groups = q.get("config_groups")
    if q.get("quant_method") == "compressed-tensors" and q.get("format") == "float-quantized" and groups \
            and isinstance(groups, dict) and all(_fp8_group(g) for g in groups.values()):
        return WeightQuant("compressed-tensors", None, "weight_scale", tuple(q.get("ignore") or ()))
    if q.get("quant_method") == "gguf" and isinstance(q.get("tensor_types"), dict):  # (model/gguf.py writes it)
        return WeightQuant("gguf", None, "", file_type=str(q.get("file_type")), tensor_types=q["tensor_types"])
    group = q.get("group_size")
    if (q.get("quant_method") == "awq" and str(q.get("version", "gemm")).lower() == "gemm" and q.get("bits") == 4
            and q.get("zero_point", True) is True and isinstance(group, int) and group > 0 and group % 8 == 0):
        return WeightQuant("awq", None, "scales", tuple(q.get("modules_to_not_convert") or ()), bits=4,
                           group_size=group)
    return None


def _fp8_group(group) -> bool:
    weights = group.get("weights") if isinstance(group, dict) else None
    return (isinstance(weights, dict) and weights.get("num_bits") == 8 and weights.get("type") == "float"
            and weights.get("strategy") in ("channel", "tensor"))


def check_quantization(raw_config: dict) -> None:
    """Refuse a checkpoint quantized by a method MILI does not load (any but those ``weight_quant`` reads)."""
    if weight_quant(raw_config) is not None and not raw_config.get("compression_config"):
        return
    for key in ("quantization_config", "compression_config"):
        qconfig = raw_config.get(key)
        if not qconfig:
            continue
        fields = qconfig if isinstance(qconfig, dict) else {}
        method = fields.get("quant_method")
        details = ", ".join(f"{k} {fields[k]}".replace("'", "") for k in _QUANT_DETAILS
                            if fields.get(k) not in (None, False))
        described = f"{method or 'an unnamed method'!r}".replace('"', "'") + (f" ({details})" if details else "")
        raise ModelLoadError(f"this checkpoint is quantized with {described} (config.json {key}), which MILI "
                             f"does not load yet (it loads Qwen's block-wise fp8, compressed-tensors FP8 and "
                             f"AWQ GEMM int4 with zero points); "
                             f"use the unquantized release of the model (MILI's own --quantization int8 "
                             f"quantizes it on load)")


def check_architecture_settings(hf_config, hybrid: bool = False) -> None:
    """Refuse config settings that change the math and that MILI does not implement. ``hybrid``: a Qwen3-Next /
    Qwen3.5 model, whose layers may also be linear_attention (Gated DeltaNet)."""
    if getattr(hf_config, "use_sliding_window", False):
        raise ModelLoadError(f"config.json sets use_sliding_window: true (sliding_window "
                             f"{getattr(hf_config, 'sliding_window', None)}, max_window_layers "
                             f"{getattr(hf_config, 'max_window_layers', None)}): MILI runs full attention only")
    layer_types = getattr(hf_config, "layer_types", None) or []
    kinds = ("full_attention", "linear_attention") if hybrid else ("full_attention",)
    other = sorted({t for t in layer_types if t not in kinds})
    if other:
        first = next(i for i, t in enumerate(layer_types) if t not in kinds)
        raise ModelLoadError(f"config.json layer_types has {', '.join(map(repr, other))} (layer {first} first): "
                             f"MILI runs {' and '.join(kinds)} layers only"
                             + ("" if hybrid else " (linear_attention in the Qwen3-Next / Qwen3.5 architectures)"))
    if hybrid:
        _check_hybrid(hf_config)
    rope_type = rope_parameters(hf_config).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelLoadError(f"config.json asks for rope type {rope_type!r}, which MILI does not compute "
                             f"(static types only: {', '.join(STATIC_ROPE_TYPES)})")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"config.json sets hidden_act {act!r}: MILI's Qwen3 MLP is SwiGLU (silu)")


def _check_hybrid(hf_config) -> None:
    """The Gated DeltaNet settings MILI computes: SiLU, key heads that divide the value heads, a float SSM state."""
    if getattr(hf_config, "attn_output_gate", True) is not True:
        raise ModelLoadError("config.json sets attn_output_gate false: MILI's gated attention always gates")
    hk, hv = getattr(hf_config, "linear_num_key_heads", 0), getattr(hf_config, "linear_num_value_heads", 0)
    if not hk or not hv or hv % hk:
        raise ModelLoadError(f"config.json: linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}")
    ssm = getattr(hf_config, "mamba_ssm_dtype", None) or "float32"
    if str(ssm).removeprefix("torch.") not in ("float32", "bfloat16", "float16"):
        raise ModelLoadError(f"config.json mamba_ssm_dtype {ssm!r}: MILI keeps the SSM state in float32, bfloat16 "
                             f"or float16")


def rope_parameters(hf_config) -> dict:
    """The RoPE settings in either config spelling (transformers 5's rope_parameters, 4's rope_scaling)."""
    params = getattr(hf_config, "rope_parameters", None) or {
        **(getattr(hf_config, "rope_scaling", None) or {}), "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def check_tensors(found: dict[str, str], unexpected: list[str]) -> None:
    """Refuse tensors the model lacks and integer/fp8 tensors posing as weights (name -> safetensors dtype)."""
    if unexpected:
        dtypes = sorted({_dtype_name(found[n]) for n in unexpected})
        hints = [n.rsplit(".", 1)[-1] for n in unexpected]
        quantized = any(h.startswith(("weight_scale", "input_scale", "qweight", "qzeros", "scales", "SCB",
                                      "weight_format", "absmax", "quant_")) for h in hints)
        cause = ("a quantized checkpoint (scale or packed tensors)" if quantized else
                 "a checkpoint of another architecture, or a fine-tune with extra modules")
        raise ModelLoadError(f"the checkpoint has {len(unexpected)} tensors that are not part of "
                             f"Qwen3ForCausalLM, e.g. {', '.join(unexpected[:4])} ({'/'.join(dtypes)}); "
                             f"likely {cause}")
    for name, dtype in found.items():
        if dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"checkpoint tensor {name} is stored as {_dtype_name(dtype)}, which cannot be a "
                                 f"weight of this floating-point model without a quantization method "
                                 f"(config.json has no quantization_config); MILI does not cast it")


def _dtype_name(safetensors_dtype: str) -> str:
    return FLOAT_DTYPES.get(safetensors_dtype) or _DTYPE_NAMES.get(safetensors_dtype, safetensors_dtype)
