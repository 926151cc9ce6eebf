"""EngineConfig and ModelConfig: what the engine is asked to run, validated on construction."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

import torch

from mili.cpu_isas import ISAS
from mili.errors import InvalidRequest, ModelLoadError
from mili.model.checks import check_architecture_settings
from mili.model.demo import DEMO_HYBRID_MODEL, DEMO_MODEL, DEMO_RANDOM_MODEL
from mili.options import check, option

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
           "float": torch.float32}
SUPPORTED_ARCHITECTURES = {  # -> model_type
    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
    # a Qwen3 decoder with a classification head instead of the lm_head (a converted Qwen3-Reranker): --task rerank
    "Qwen3ForSequenceClassification": "qwen3",
    # the decoder without a head (what sentence-transformers saves: an embedding model, --task embed)
    "Qwen3Model": "qwen3",
    # the hybrids (Gated DeltaNet + gated attention, model/qwen3_5.py); the hub's Qwen3.5/3.6 checkpoints are
    # the ForConditionalGeneration ones (the language model under text_config; its vision tower is skipped)
    "Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    # Qwen3-VL: the Qwen3 decoder with M-RoPE and DeepStack, and its vision tower (model/qwen3_vl.py, vision.py)
    "Qwen3VLForConditionalGeneration": "qwen3_vl", "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe"}
# the hub's image-capable layouts: the language model's config under text_config, the tower's under vision_config
_MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe")
# transformers' M-RoPE sections where a config names none (Qwen3VLTextRotaryEmbedding's default)
_DEFAULT_MROPE_SECTION = {"qwen3_vl_text": [24, 20, 20], "qwen3_vl_moe_text": [24, 20, 20],
                          "qwen3_5_text": [11, 11, 10], "qwen3_5_moe_text": [11, 11, 10]}
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # (the text models')


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise InvalidRequest(f"unknown device {device!r}", param="device") from e


@dataclass
class ModelConfig:
    """The shape of a Qwen3 checkpoint, read from its config.json (either spelling, see loader)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    checkpoint_dtype: torch.dtype
    hf_config: object = field(repr=False, default=None)  # the transformers config (rope parameters)
    # Qwen3 MoE (Qwen3MoeForCausalLM); num_experts 0: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP (False)
    # tensor parallelism: this rank's share (heads, KV heads, intermediate sizes are then the rank's own)
    tp_rank: int = 0
    tp_size: int = 1
    total_num_key_value_heads: int = 0  # the checkpoint's (0: num_key_value_heads)
    # the hybrids: each layer's kind (full_attention | linear_attention), and the MoE's shared expert
    layer_types: tuple[str, ...] = ()
    shared_expert_intermediate_size: int = 0
    # image-capable checkpoints (Qwen3-VL, the hub's Qwen3.5 / 3.6): the vision tower's config and the image-pad
    # token's id (None for text-only checkpoints)
    vision_config: object = field(repr=False, default=None)
    image_token_id: int | None = None
    # a sequence-classification checkpoint (Qwen3ForSequenceClassification): its head's outputs (``score.weight``'s
    # rows); 0: a causal LM
    num_labels: int = 0

    def shard(self, rank: int, size: int) -> "ModelConfig":
        """This config as rank ``rank`` of ``size`` sees it: attention heads, MLP and expert columns split evenly
        (the vocabulary too, padded to split: distributed.vocab_shard); KV heads split too, or replicated when
        there are fewer than ranks. The hybrids' linear-attention heads split too (``hf_config`` keeps the checkpoint's counts: the rank's
        are ``LinearAttentionShape.of(hf_config, tp_size)``)."""
        if size == 1:
            return self
        kv = self.num_key_value_heads

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise InvalidRequest(f"tensor_parallel_size {size}: {what}", param="tensor_parallel_size")

        need(not self.num_labels, "a sequence-classification checkpoint runs on one rank")
        need(self.num_attention_heads % size == 0, f"{self.num_attention_heads} attention heads do not split evenly")
        need(kv % size == 0 or size % kv == 0, f"{kv} KV heads neither split evenly nor replicate evenly")
        need(self.intermediate_size % size == 0, f"intermediate_size {self.intermediate_size} does not split evenly")
        need(self.moe_intermediate_size % size == 0,
             f"moe_intermediate_size {self.moe_intermediate_size} does not split evenly")
        need(not getattr(self.hf_config, "attention_bias", False), "attention_bias is not supported")
        need(getattr(self.hf_config, "model_type", None) != "qwen3_vl_moe_text",
             "Qwen3-VL MoE is not split yet (the hub stores its experts transposed)")
        if self.is_hybrid:  # Gated DeltaNet: key heads split, each with the value heads it serves
            hk, hv = self.hf_config.linear_num_key_heads, self.hf_config.linear_num_value_heads
            need(hk % size == 0, f"{hk} linear-attention key heads do not split evenly")
            need(hv % size == 0, f"{hv} linear-attention value heads do not split evenly")
            need(self.shared_expert_intermediate_size % size == 0,
                 f"shared_expert_intermediate_size {self.shared_expert_intermediate_size} does not split evenly")
        return dataclasses.replace(
            self, num_attention_heads=self.num_attention_heads // size, num_key_value_heads=max(kv // size, 1),
            intermediate_size=self.intermediate_size // size, moe_intermediate_size=self.moe_intermediate_size // size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size // size,
            tp_rank=rank, tp_size=size, total_num_key_value_heads=kv)

    def without_head(self) -> "ModelConfig":
        """This config for a model that computes no logits (``--task embed``): no lm_head is built or loaded (the
        hub's Qwen3-Embedding names Qwen3ForCausalLM but holds Qwen3Model's weights, without one); the embedding
        table stands as a tied head that nothing samples from."""
        return dataclasses.replace(self, tie_word_embeddings=True)

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def is_hybrid(self) -> bool:
        """Gated DeltaNet layers beside the attention ones: a recurrent state per sequence."""
        return "linear_attention" in self.layer_types

    @property
    def num_attention_layers(self) -> int:
        """The layers that keep K/V in the paged pool."""
        return self.layer_types.count("full_attention") if self.layer_types else self.num_hidden_layers

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        archs = list(getattr(hf_config, "architectures", None) or [])
        model_type = getattr(hf_config, "model_type", None)
        if not any(SUPPORTED_ARCHITECTURES.get(a) == model_type for a in archs):
            raise ModelLoadError(
                f"unsupported architecture {archs or model_type!r} (model_type {model_type!r}): MILI runs "
                + ", ".join(f"{a} (model_type {t!r})" for a, t in SUPPORTED_ARCHITECTURES.items()))
        top = hf_config
        if model_type in _MULTIMODAL_MODEL_TYPES:  # the hub layout: the language model's config inside
            hf_config = hf_config.get_text_config()
            model_type = hf_config.model_type
            if getattr(top, "quantization_config", None) and not getattr(hf_config, "quantization_config", None):
                hf_config.quantization_config = top.quantization_config  # (Qwen's FP8 releases keep it on top)
        vision = _vision_fields(top, hf_config) if model_type in _DEFAULT_MROPE_SECTION else {}
        hybrid = model_type in HYBRID_MODEL_TYPES
        check_architecture_settings(hf_config, hybrid)
        moe_types = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_vl_moe_text")
        moe = _moe_fields(hf_config) if model_type in moe_types else {}
        if model_type == "qwen3_5_moe_text":  # every layer has experts, and the top k are always renormalised
            moe.update(norm_topk_prob=True, sparse_layers=(True,) * hf_config.num_hidden_layers)
        if model_type == "qwen3_vl_moe_text":  # its router always renormalises the top k (no norm_topk_prob)
            moe.update(norm_topk_prob=True)
        if hybrid:
            moe.update(layer_types=tuple(hf_config.layer_types),
                       shared_expert_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
        heads = hf_config.num_attention_heads
        dtype = (getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or getattr(top, "dtype", None)
                 or torch.float32)
        if isinstance(dtype, str):
            dtype = _DTYPES[dtype]
        # a classification head instead of the lm_head: no head weights to load (the table stands as the tied head,
        # which nothing samples from: such a checkpoint only scores)
        num_labels = hf_config.num_labels if "Qwen3ForSequenceClassification" in archs else 0
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=getattr(hf_config, "intermediate_size", 0) or 0,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)) or bool(num_labels),
            checkpoint_dtype=dtype,
            hf_config=hf_config,
            num_labels=num_labels,
            **moe,
            **vision,
        )


def _vision_fields(top, text_config) -> dict:
    """An image-capable checkpoint's tower config and image token (none for a text-only one); transformers' M-RoPE
    sections where the text config names none (it computes with them all the same)."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and not params.get("mrope_section"):
        text_config.rope_parameters = {**params, "mrope_section": _DEFAULT_MROPE_SECTION[text_config.model_type]}
    vision = getattr(top, "vision_config", None)
    return {"vision_config": vision, "image_token_id": getattr(top, "image_token_id", None)} if vision else {}


def _moe_fields(hf_config) -> dict:
    """Qwen3 MoE's settings, either config spelling (num_experts, or transformers 5's num_local_experts);
    a layer has experts unless ``mlp_only_layers`` lists it or ``decoder_sparse_step`` skips it (as HF)."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
    top_k = getattr(hf_config, "num_experts_per_tok", None) or 0
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    if experts and not 1 <= top_k <= experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok {top_k} must be in [1, num_experts {experts}]")
    sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                   for i in range(hf_config.num_hidden_layers))
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": getattr(hf_config, "moe_intermediate_size", None) or 0,
            "norm_topk_prob": bool(getattr(hf_config, "norm_topk_prob", False)), "sparse_layers": sparse}


SPEC_METHODS = ("ngram", "mtp")
# Batch sizes (running sequences) above which speculation stops paying: benchmarks/speculative.py measures it
DEFAULT_SPEC_DISABLE_BATCH = 8


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's field names): ``method`` ngram (drafts copied from the sequence's own
    earlier tokens: the longest suffix of ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens seen
    before, and the tokens that followed it) or mtp (the checkpoint's MTP head); ``num_speculative_tokens``
    drafts a step; off for a step whose running batch exceeds ``disable_by_batch_size``."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BATCH

    def __post_init__(self) -> None:
        def positive(name: str, value, upper: int | None = None) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (upper and value > upper):
                within = f" and at most {upper}" if upper else ""
                raise InvalidRequest(f"speculative_config: {name} must be a positive integer{within}, got "
                                     f"{value!r}", param="speculative_config")

        if self.method not in SPEC_METHODS:
            raise InvalidRequest(f"speculative_config: method must be one of {', '.join(SPEC_METHODS)}, got "
                                 f"{self.method!r}", param="speculative_config")
        positive("num_speculative_tokens", self.num_speculative_tokens, upper=15)  # (a verify chunk stays short)
        positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "ngram":  # as vLLM: one bound given sets the other; neither: 1 .. 4
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            self.prompt_lookup_min = lo if lo is not None else (min(hi, 1) if hi is not None else 1)
            self.prompt_lookup_max = hi if hi is not None else max(lo, 4) if lo is not None else 4
            positive("prompt_lookup_min", self.prompt_lookup_min)
            positive("prompt_lookup_max", self.prompt_lookup_max)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise InvalidRequest(f"speculative_config: prompt_lookup_min {self.prompt_lookup_min} exceeds "
                                     f"prompt_lookup_max {self.prompt_lookup_max}", param="speculative_config")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict of its fields or that dict as JSON text (the CLI's)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidRequest(f"speculative_config is not valid JSON: {e}", param="speculative_config")
        if not isinstance(value, dict):
            raise InvalidRequest(f"speculative_config must be an object, got {type(value).__name__}",
                                 param="speculative_config")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise InvalidRequest(f"speculative_config: unknown field(s) {', '.join(unknown)} (known: "
                                 f"{', '.join(sorted(names))})", param="speculative_config")
        missing = [n for n in ("method", "num_speculative_tokens") if n not in value]
        if missing:
            raise InvalidRequest(f"speculative_config needs {' and '.join(missing)}", param="speculative_config")
        return cls(**value)


DEFAULT_MM_LIMITS = {"image": 4}


def parse_mm_limits(value) -> dict[str, int]:
    """``--limit-mm-per-prompt``: None (the default, 4 images), a mapping or its JSON text; "image" (and "video",
    accepted and kept for vLLM's spelling) each a non-negative count."""
    if value is None:
        return dict(DEFAULT_MM_LIMITS)
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequest(f"limit_mm_per_prompt is not valid JSON: {e}", param="limit_mm_per_prompt") from e
    if not isinstance(value, dict):
        raise InvalidRequest(f"limit_mm_per_prompt must be an object such as {{\"image\": 4}}, got "
                             f"{type(value).__name__}", param="limit_mm_per_prompt")
    unknown = sorted(set(value) - {"image", "video"})
    if unknown:
        raise InvalidRequest(f"limit_mm_per_prompt: unknown modality {', '.join(unknown)} (known: image, video)",
                             param="limit_mm_per_prompt")
    for name, count in value.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidRequest(f"limit_mm_per_prompt: {name} must be a non-negative integer, got {count!r}",
                                 param="limit_mm_per_prompt")
    return {**DEFAULT_MM_LIMITS, **value}


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is asked to run. Each field is one engine option: its ``option(...)`` metadata (mili/options.py)
    makes the CLI flag (in this order), the config-file key, the checks below and the docs' option table. Frozen once
    validated: what the start-up decides is the plan's (runtime/plan.py), never written back here."""

    model: str = option(
        help=f"local checkpoint folder, hub id (e.g. Qwen/Qwen3-0.6B), '{DEMO_MODEL}' (default: a small Qwen3 trained "
             f"on the King James Bible, shipped with MILI), '{DEMO_HYBRID_MODEL}' (its Qwen3.5 twin, also shipped) or "
             f"'{DEMO_RANDOM_MODEL}' (a tiny random-weight model built offline)", cli_default=DEMO_MODEL)
    tokenizer: str | None = option(None, "an HF tokenizer's folder or hub id, used instead of the model's (a GGUF "
                                         "file's: instead of the one its metadata makes)")
    task: str = option(
        "auto", "what the model serves: generate (text), embed (/v1/embeddings: last-token pooling, Qwen3-Embedding) or "
                "rerank (/v1/rerank and /score: Qwen3-Reranker's P(yes), or a sequence-classification head); auto: embed "
                "for sentence-transformers files with a Pooling module, rerank for a sequence-classification head, "
                "else generate (a Qwen3-Reranker is a causal LM: it needs --task rerank)",
        choices=("auto", "generate", "embed", "rerank"))
    # (device before dtype, page_size before num_kv_pages: the config file's sections list their keys in this order)
    device: str = option("auto", "auto | cpu | cuda | cuda:N", section="inference.device")
    dtype: str = option("auto", "weights and activations dtype (auto: the checkpoint's)",
                        choices=("auto", "bfloat16", "float16", "float32"),
                        accepts=tuple(name for name in _DTYPES if name not in ("bfloat16", "float16", "float32")),
                        section="inference.dtype")
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens (default: the model's, capped by the KV cache)", minimum=2)
    kv_cache_memory: int | None = option(
        None, "bytes for the paged KV cache (default 2 GiB, or env MILI_KV_CACHE_MEMORY)", minimum=1)
    page_size: int = option(16, "tokens per KV page", minimum=1, section="kv_cache.page_size")
    num_kv_pages: int | None = option(
        None, "the KV cache's exact number of pages (overrides --kv-cache-memory)", minimum=1,
        section="kv_cache.num_pages")
    num_state_slots: int | None = option(
        None, "hybrid models (Qwen3-Next, Qwen3.5): recurrent-state slots, one per running sequence (default: "
              "max-num-seqs within a quarter of the KV budget)", minimum=1)
    num_state_snapshots: int | None = option(
        None, "hybrid models: recurrent-state snapshots the prefix cache keeps (default: another quarter of the KV "
              "budget, 2 to 4 per slot; 0 turns their prefix cache off)", minimum=0)
    # (auto: the execution plan sizes both by the device, mili/runtime/plan.py's BATCH_LIMITS; an engine's config
    # holds the values it chose once it has planned)
    max_num_seqs: int | None = option(
        None, "most sequences in one batch; auto: by the device (the CPU 256; a GPU 256, 512 from 36 GiB, 1024 from "
              "70 GiB)", minimum=1, auto=True, section="inference.max_batch_size")
    max_num_batched_tokens: int | None = option(
        None, "token budget of one step (decodes + prefill chunks); auto: by the device (the CPU 2048; a GPU 2048, "
              "4096 from 36 GiB, 8192 from 70 GiB)", minimum=1, auto=True)
    seed: int = option(0, "global random seed")
    num_threads: int | None = option(None, "CPU threads for torch", minimum=1)
    attention_backend: str = option(
        "auto", "attention and norm kernels: auto = Triton on CUDA, torch elsewhere (Triton on the CPU needs "
                "TRITON_INTERPRET=1: slow, for testing)", choices=("auto", "torch", "triton"))
    enforce_eager: bool = option(
        False, "decode steps module by module: no CUDA graphs on CUDA, no fused one-call-per-layer step on the CPU")
    async_scheduling: str = option(
        "auto", "schedule each step while the device runs the one before (the sampled tokens stay on the device and "
                "feed the next step; stop checks apply one step late, and a finished sequence's extra token is "
                "dropped): auto = on CUDA, off on the CPU (whose steps have run when they return: nothing would "
                "overlap). Off with speculative decoding or tensor parallelism; steps of requests with grammars or "
                "penalties run in turn", choices=("auto", "on", "off"))
    gpu_memory_utilization: float = option(
        0.9, "CUDA: share of the GPU's memory for weights, activations and the KV cache", above=0, maximum=1)
    quantization: str | None = option(
        None, "quantize an unquantized checkpoint as it loads, one scale per output channel: int8 (a Triton "
              "weight-only GEMM on CUDA, MILI's int8 kernels on the CPU), or fp8 (e4m3; FP8 GEMMs on CUDA SM 89+, "
              "int8 before; int8 kernels on the CPU in bf16). Quantized checkpoints (FP8, AWQ) need no flag; "
              "default: none", choices=("int8", "fp8"))
    lm_head_dtype: str = option(
        "auto", "the lm_head's weights on the CPU: int8 (per output channel, on MILI's int8 kernel), bf16 (the model's "
                "dtype), or auto = int8 where the body is quantized (--quantization, an AWQ checkpoint), else as the "
                "body", choices=("auto", "bf16", "int8"))
    kv_cache_dtype: str = option(
        "auto", "KV cache pages: auto = the model's dtype; fp8 = e4m3 (twice the tokens in the same memory; the Triton "
                "attention backend on GPUs with FP8, SM 89+); int8 = int8 with a float32 scale per token and kv head "
                "(~1.9x the tokens; MILI's CPU kernels)", choices=("auto", "fp8", "int8"), section="kv_cache.dtype")
    tensor_parallel_size: int = option(
        1, "split the model over N ranks on this node (torch.distributed: NCCL on CUDA, one GPU a rank; gloo on the "
           "CPU)", aliases=("-tp",), minimum=1)
    cpu_kernels: bool = option(
        True, "CPU bf16: torch ops and oneDNN instead of MILI's C kernels (AVX-512 BF16 or AMX linear layers, fused "
              "norms, paged attention; built on first use with the system C compiler)")
    cpu_isa: str = option(
        "auto", "the ISA path of MILI's CPU kernels, at most: auto = $MILI_CPU_ISA where set, else the best this CPU "
                "runs; one the CPU lacks is refused by name in the log and the best it runs serves instead; none = "
                "torch's ops (a lower path runs and tests what a lesser CPU runs)", choices=("auto",) + ISAS)
    cpu_weight_prepack: bool = option(
        True, "CPU bf16 without MILI's kernels: plain weights instead of oneDNN's prepacked layout")
    enable_prefix_caching: bool = option(
        True, "turn off the radix-tree prefix cache (RadixAttention)", flag="--no-prefix-cache")
    # None (off), a SpeculativeConfig, or its fields as a dict or JSON text; __post_init__ makes it a SpeculativeConfig
    speculative_config: "SpeculativeConfig | dict | str | None" = option(
        None, 'speculative decoding, as vLLM spells it: \'{"method": "ngram", "num_speculative_tokens": 3}\' (drafts '
              "looked up in the sequence itself; prompt_lookup_min/max: the n-gram sizes, default 1 to 4); "
              "disable_by_batch_size: off for a step with more running sequences (default 8). Greedy output is "
              "unchanged; sampled output keeps its distribution", mapping="method, num_speculative_tokens, ...")
    language_model_only: bool = option(
        False, "image-capable checkpoints (Qwen3-VL, the hub's Qwen3.5 / 3.6): do not load the vision tower (text "
               "only, less memory)")
    # a dict or its JSON text; __post_init__ makes it the dict with every modality ({"image": 0}: the tower not loaded)
    limit_mm_per_prompt: "dict | str | None" = option(
        None, 'the most images one prompt may carry, as vLLM spells it: \'{"image": 4}\' (the default); a prompt with '
              "more is a 400, and the vision encoder's memory is budgeted for that many", mapping='{"image": 4}')
    encoder_cache_tokens: int | None = option(
        None, "the vision tower's outputs kept by image content, in image tokens (default: vLLM's size, the largest of "
              "max_num_batched_tokens and the image processor's largest image)", minimum=0, cli=False)
    # where a chat's image parts may come from besides data: URLs (mili/engine/media.py), as vLLM's flags;
    # __post_init__ makes the hosts a list
    allowed_media_domains: "list[str] | str | None" = option(
        None, "chat image parts may be http(s) URLs on these hosts (vLLM's flag); default: none, only data: URLs",
        metavar="HOST,HOST", listed=True)
    allow_remote_media: bool = option(  # (off by default: the server would fetch whatever address a client names)
        False, "chat image parts may be http(s) URLs on any host (the server fetches what a client names: only where "
               "that is safe)")
    allowed_local_media_path: str | None = option(
        None, "chat image parts may be file:// URLs (or paths) of files under DIR (vLLM's flag)", metavar="DIR")
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT folders) on the base model, several in one batch: a request names its "
               "adapter (offline: lora_request=LoRARequest(name, id, path))")
    max_loras: int = option(4, "LoRA: the most different adapters in one step (each holds a slot of weights)",
                            minimum=1)
    max_lora_rank: int = option(16, "LoRA: the highest adapter rank the slots hold", minimum=1)
    max_cpu_loras: int | None = option(
        None, "LoRA: adapters kept loaded in memory, the least recently used dropped past it (default: max_loras)",
        minimum=1)
    schedule_policy: str = option(
        "fcfs", "order of waiting requests: first come first served, or longest cached prefix first (with a "
                "starvation guard)", choices=("fcfs", "lpm"))

    def __post_init__(self) -> None:
        # the checks the metadata states (choices, ranges; auto is None), then those it cannot: a folder that must
        # exist, the mappings' contents, and those between fields
        check(self, InvalidRequest)
        normalize = functools.partial(object.__setattr__, self)  # (frozen: the parsed forms replace the given ones)
        normalize("limit_mm_per_prompt", parse_mm_limits(self.limit_mm_per_prompt))
        if isinstance(self.allowed_media_domains, str):
            normalize("allowed_media_domains", [d.strip().lower() for d in self.allowed_media_domains.split(",")
                                                 if d.strip()])
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise InvalidRequest(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a folder",
                                 param="allowed_local_media_path")
        if self.lm_head_dtype == "int8" and self.tensor_parallel_size > 1:
            raise InvalidRequest("--lm-head-dtype int8 runs on the CPU's linear layers, one rank (not with tensor "
                                 "parallelism)", param="lm_head_dtype")
        normalize("speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise InvalidRequest("LoRA adapters run on one rank: --enable-lora with --tensor-parallel-size 1",
                                 param="enable_lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequest(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})",
                                 param="max_cpu_loras")
        normalize("torch_device", resolve_device(self.device))

    def with_batch_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> "EngineConfig":
        """This config with the batch limits an engine runs (its execution plan's: auto sized by the device) in
        place of auto: what the engine core builds from once it has planned, and what the API side validates
        requests by once the core's ``Ready`` says them."""
        return dataclasses.replace(self, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)

    def takes_images(self, model_config: ModelConfig) -> bool:
        """Whether the vision tower is loaded and requests may carry images: an image-capable checkpoint, not
        language_model_only, images allowed (limit_mm_per_prompt image > 0, as vLLM skips the tower at 0), one rank
        (tensor parallelism runs text only)."""
        return (model_config.vision_config is not None and not self.language_model_only
                and self.limit_mm_per_prompt["image"] > 0 and self.tensor_parallel_size == 1)

    def resolve_max_model_len(self, model_config: ModelConfig) -> int:
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise InvalidRequest(f"max_model_len {self.max_model_len} exceeds the model's "
                                 f"max_position_embeddings {limit}", param="max_model_len")
        return self.max_model_len


def default_kv_cache_bytes() -> int:
    """Default KV pool budget on the CPU: MILI_KV_CACHE_MEMORY or 2 GiB."""
    return int(os.environ.get("MILI_KV_CACHE_MEMORY", 2 << 30))
