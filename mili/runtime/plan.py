"""The execution plan: every choice of how a model runs, made once, before anything is built.

``plan(EngineConfig, ModelConfig, DeviceInfo) -> ExecutionPlan`` is a pure function: the dtype, the attention
back-end and its ops, each layer family's linear format and the lm_head's, the CPU kernels' ISA, the KV dtype,
the Gated DeltaNet implementation, how a decode step runs (eagerly, as CUDA graphs, or as the C decode layer),
the speculative method, the prefix cache the engine core keeps (``PrefixCacheKind``), where LoRA adapters' products
run (``LoRAKernel``), the memory split's rules, the batch limits (``max_num_seqs``, ``max_num_batched_tokens``:
auto sizes them by the device, ``BATCH_LIMITS``) and the CUDA graphs' batch sizes, and the Triton GEMMs' tiles
for the device. It raises every
refusal of a setting MILI cannot run faithfully, by name. ``DeviceInfo`` describes the device (``probe`` reads
the real one; the tests write H100s, AVX2 laptops and aarch64 boards by hand), so the plan needs no device.

The runner applies the plan and nothing else decides: the model builder (``model_builder.py``) builds the model
on its ops and swaps its layers, the memory planner (``memory.py``) sizes the pools, the runner picks the step
and the LoRA kernel, the engine core makes the prefix cache of the plan's kind.
The engine core runs on ``plan.resolve(config)``: the config with the plan's batch limits in place of auto, which
the scheduler, the pools and the API side (through the core's ``Ready``) all read.
The plan is printed at start-up, and ``/health`` and ``mili selftest`` show it.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from dataclasses import dataclass, field

import torch

from mili.config import _DTYPES, EngineConfig, ModelConfig
from mili.errors import InvalidRequest
from mili.kernels.cpu import family_paths
from mili.kernels.triton.launch import (INTERPRETER, MIN_CAPABILITY, DeviceSpec, GemmConfig, check_device,
                                        gemm_config)
from mili.model.checks import weight_quant
from mili.model.formats import LinearFormat
from mili.model.formats.fp8 import Fp8
from mili.model.formats.int8 import Int8, TritonInt8
from mili.model.formats.kernel import Kernel
from mili.model.formats.plain import Packed, Plain
from mili.model.formats.triton import Triton

GIB = 1 << 30
# What auto makes of max_num_seqs and max_num_batched_tokens (vLLM's API-server defaults, by the device's memory):
# the CPU keeps MILI's long-standing 256 / 2048; a GPU takes the first row whose memory it has, as
# (GiB at least, max_num_seqs, max_num_batched_tokens). The thresholds sit below the nominal sizes, which cards
# report less of: an 80 GB H100 or A100 has 79 GiB, a 141 GB H200 140 GiB, a 40 GB A100 39.5 GiB, a 48 GB L40S
# 44 GiB; 24 and 32 GB cards (L4, RTX 4090, V100, RTX 5090: under 32 GiB) and a card of unknown memory keep 256 / 2048.
BATCH_LIMITS = {"cpu": ((0, 256, 2048),), "cuda": ((70, 1024, 8192), (36, 512, 4096), (0, 256, 2048))}
# CUDA graphs capture decode batches of up to this many sequences (vLLM's cap): a larger batch runs eagerly
MAX_GRAPH_BATCH = 512
GRAPH_LADDER = (1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH + 1, 16))
# the token counts a mixed step (prefill chunks, and decodes) is padded up to for its CUDA graph: padding at most
# doubles a step of under 512 tokens and adds at most half above; a dozen graphs up to vLLM's largest default budget
MIXED_LADDER = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def batch_limits(device: "DeviceInfo") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that auto picks on ``device``: ``BATCH_LIMITS``' row for its memory."""
    rows = BATCH_LIMITS["cuda" if device.type == "cuda" else "cpu"]
    return next((seqs, tokens) for gib, seqs, tokens in rows if device.memory >= gib * GIB)


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes CUDA graphs capture: the ladder below min(max_num_seqs, MAX_GRAPH_BATCH), and that
    size itself (a batch is padded up to the nearest; one above the largest runs eagerly)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    return (*(b for b in GRAPH_LADDER if b < top), top)


class AttentionBackend(enum.Enum):
    """The attention back-end, and the ops table of that name (model_builder.py): torch's, MILI's C kernels (the
    CPU: bf16, one rank), or Triton's (CUDA, or the CPU under TRITON_INTERPRET)."""

    TORCH = "torch"
    CPU = "cpu"
    TRITON = "triton"


class StepKind(enum.Enum):
    """How a decode step runs: eagerly, as CUDA graphs (the Triton back-end on CUDA), or as the C decode layer (one
    C call per layer: MILI's CPU kernels)."""

    EAGER = "eager"
    CUDA_GRAPHS = "cuda-graphs"
    CPU_DECODE = "cpu-decode"


class SpeculativeMethod(enum.Enum):
    """Where the drafts come from (mili/speculative): n-gram lookup in the sequence, or the model's MTP head."""

    NGRAM = "ngram"
    MTP = "mtp"


class DrawKind(enum.Enum):
    """How a sampled row draws its token (sampler.py ``DRAWS``): inverse-cdf (one cumulative sum, a uniform per row:
    the CPU) or exponential-race (argmax of p / Exp(1): no host sync, for GPUs)."""

    INVERSE_CDF = "inverse-cdf"
    EXPONENTIAL_RACE = "exponential-race"


class GatedDeltaImpl(enum.Enum):
    """The hybrids' Gated DeltaNet layers: flash-linear-attention's Triton kernels (CUDA), the model's torch code
    with each decode step in one call of MILI's C kernel, or the torch code alone."""

    FLA = "fla"
    TORCH_CPU = "torch+cpu"
    TORCH = "torch"


class PrefixCacheKind(enum.Enum):
    """The prefix cache the engine core keeps (mili/cache): none, a radix tree of KV pages, or (the hybrids) a radix
    tree of KV pages and snapshots of the recurrent state, from which a hybrid resumes."""

    NONE = "off"
    RADIX = "radix tree of KV pages"
    HYBRID_RADIX = "radix tree of KV pages and recurrent-state snapshots"


class LoRAKernel(enum.Enum):
    """Where the LoRA adapters' products run, beside each projection (mili/lora.py): torch's matmuls over every slot,
    MILI's CPU kernels (bf16; a layer of more than 3 shards on torch's), or the Triton kernel (each row its own
    slot's product only: CUDA, or the CPU under TRITON_INTERPRET)."""

    TORCH = "torch"
    CPU = "cpu kernels"
    TRITON = "triton"


@dataclass(frozen=True)
class DeviceInfo:
    """What the plan needs to know of a device. CUDA: its SM version, shared memory per block, SM count and memory.
    CPU: whether MILI's kernels load (``cpu_kernels``: their ISA; "" where none builds or passes its check, with
    ``cpu_kernels_why``), whether their int8/int4 paths run, whether oneDNN's bf16 packing runs."""

    type: str  # "cpu" | "cuda"
    name: str = ""
    index: int | None = None  # CUDA: the card
    capability: tuple[int, int] | None = None
    smem_per_block: int = 0
    num_sms: int = 0
    memory: int = 0  # CUDA: the card's total memory in bytes (0: unknown); what auto sizes the batch limits by
    cpu_kernels: str = ""  # the ISA MILI's CPU kernels run (avx512, avx2, neon-dot...), "" if none loads
    cpu_kernels_why: str = ""  # why none loads
    int8_kernels_why: str = "no CPU kernels"  # "" where their int8 / int4 paths run (byte dot products), else why not
    cpu_headline: str = ""  # the ISA, why, the CPU's SIMD flags (the start-up log's)
    onednn_bf16: str = "no CPU"  # "" where oneDNN's bf16 packing runs, else why not
    triton: bool = False  # the triton package imports
    triton_interpret: bool = False  # TRITON_INTERPRET=1: the Triton kernels run on the CPU
    fla: bool = False  # flash-linear-attention (fla-core) imports
    cpu_count: int = 1  # the CPU's threads (the torch thread count a tensor-parallel rank takes a share of)

    @property
    def spec(self) -> DeviceSpec:
        """The Triton kernels' view of the device (the CPU under TRITON_INTERPRET picks what an H100 picks)."""
        if self.type != "cuda":
            return INTERPRETER
        return DeviceSpec(self.name, self.capability, self.smem_per_block, self.num_sms)

    @classmethod
    def probe(cls, device: torch.device, cpu_kernels: bool = True, cpu_isa: str = "auto") -> "DeviceInfo":
        """The real ``device``; ``cpu_kernels`` False (--no-cpu-kernels): MILI's CPU kernels are not built;
        ``cpu_isa``: the ISA path asked for (auto: MILI_CPU_ISA, else the best this CPU runs; kernels.cpu.choose)."""
        common = dict(cpu_count=os.cpu_count() or 1, triton=importlib.util.find_spec("triton") is not None,
                      triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
                      fla=importlib.util.find_spec("fla") is not None)
        if device.type == "cuda":
            from mili.kernels.triton.launch import device_spec

            if not torch.cuda.is_available():
                raise InvalidRequest(f"device cuda: no CUDA device here (torch {torch.__version__}, CUDA "
                                     f"{torch.version.cuda or 'not built in'})", param="device")

            index = device.index if device.index is not None else torch.cuda.current_device()
            spec = device_spec(torch.device("cuda", index))
            return cls("cuda", spec.name, index, spec.capability, spec.smem_per_block, spec.num_sms,
                       torch.cuda.get_device_properties(index).total_memory, **common)
        from mili.kernels import cpu

        asked = None if cpu_isa == "auto" else cpu_isa
        chosen = cpu.choose(asked) if cpu_kernels else cpu.Choice("none", None, "--no-cpu-kernels")
        lib, why = chosen.lib, chosen.why
        return cls("cpu", f"{cpu.arch()} CPU", cpu_kernels=chosen.isa if lib is not None else "",
                   cpu_kernels_why=why if lib is None else "",
                   int8_kernels_why=why if lib is None else lib.mili_int_check,
                   cpu_headline=cpu.headline(cpu_kernels, chosen), onednn_bf16=cpu.onednn_bf16(asked), **common)

    def kernels(self):
        """The library of MILI's CPU kernels this device runs (its ``cpu_kernels`` ISA's), or None where none loads:
        what an engine's steps run on (``kernels.cpu.ops.library``)."""
        if not self.cpu_kernels:
            return None
        from mili.kernels import cpu

        return cpu.load(self.cpu_kernels)[0]

    @property
    def int8_kernels(self) -> bool:
        """MILI's int8 / int4 kernels run (VNNI, AVX2's byte trick, NEON's sdot; not AVX-512 without VNNI)."""
        return bool(self.cpu_kernels) and not self.int8_kernels_why


@dataclass(frozen=True)
class MemoryPlan:
    """How the memory is split. ``budget``: bytes for the KV pages and the recurrent states (None on CUDA without
    kv_cache_memory: ``gpu_memory_utilization`` of the card less the weights and the profiled activation peak,
    measured once the weights are in). ``num_kv_pages``: exact, as asked (else as many as the budget holds, at
    most what max_num_seqs full sequences use). Hybrids: recurrent-state slots and the prefix cache's snapshots
    (``states``), a spare row per drafting sequence (its state before the drafts), a scratch row for CUDA graphs'
    padding rows (the Triton back-end)."""

    budget: int | None
    num_kv_pages: int | None
    hybrid: bool = False
    state_slots: int | None = None  # as asked (None: from the budget)
    state_snapshots: int | None = None  # as asked (None: from the budget with prefix caching, else 0)
    max_num_seqs: int = 256
    prefix_caching: bool = True
    max_spare_rows: int = 0  # speculative decoding's disable_by_batch_size (0: no drafts)
    scratch_state_row: bool = False
    host_memory: bool = False  # the pools are in the host's memory (the CPU): checked against MemAvailable

    def states(self, budget: int, per_slot: int) -> tuple[int, int, int]:
        """(slots, snapshots, spare rows) from ``budget``: max_num_seqs slots within a quarter of it (at least
        one); with prefix caching, as many snapshots as another quarter holds, 2 to 4 per slot."""
        slots = self.state_slots
        if slots is None:
            slots = max(1, min(self.max_num_seqs, budget // 4 // per_slot))
        snapshots = self.state_snapshots
        if snapshots is None:
            snapshots = max(2, min(4 * slots, budget // 4 // per_slot)) if self.prefix_caching else 0
        return slots, snapshots, min(slots, self.max_spare_rows)


@dataclass(frozen=True)
class BatchPlan:
    """How much one step takes: at most ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens (decodes
    and prefill chunks), each as asked or, where auto, by the device (``batch_limits``); ``sized_by`` says which.
    ``graph_sizes``: the decode batch sizes CUDA graphs capture (where the step runs them)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    seqs_by: str  # "user" (asked) | "device" (auto)
    tokens_by: str
    graph_sizes: tuple[int, ...]

    @property
    def sized_by(self) -> dict[str, str]:
        return {"max_num_seqs": self.seqs_by, "max_num_batched_tokens": self.tokens_by}

    def describe(self) -> str:
        by = {"user": "as asked", "device": "by the device"}
        return (f"{self.max_num_seqs} sequences ({by[self.seqs_by]}), {self.max_num_batched_tokens} tokens a step "
                f"({by[self.tokens_by]})")


@dataclass(frozen=True)
class ExecutionPlan:
    """Every choice of how the model runs (see the module's doc); ``describe()`` is what the start-up log,
    ``/health`` and ``mili selftest`` show."""

    device: DeviceInfo
    dtype: torch.dtype
    max_model_len: int  # the asked or the checkpoint's (the KV pool may lower it)
    attention: AttentionBackend  # the back-end, and the ops table of that name
    kv_dtype: torch.dtype
    # the body's layers' format (mili/model/formats): plain | packed (oneDNN) | kernel (MILI's C) | int8 (the CPU's
    # kernel, or aten's weight-only int8) | triton-int8 (--quantization int8 on the Triton int8 GEMM) | fp8 | triton
    # (a quantized checkpoint's)
    linears: LinearFormat
    int8_kernels: bool  # int8 layers on MILI's W8A8 kernel (else aten's weight-only int8)
    fp8_activations: bool  # the Triton FP8 GEMMs take FP8 activations (W8A8: SM 89+ in a 16-bit model)
    keep_quantized: bool  # the loader keeps a quantized checkpoint's layers as stored (Triton GEMMs, CPU int4)
    fp8_round_trip: bool  # --quantization fp8 off the FP8 GEMMs: weights through FP8 and back, then as linears
    lm_head: LinearFormat | None  # int8 | bf16 (kernel or packed: the model's dtype) | None (as the body's leaves it)
    weight_format: str  # what the weights compute as, in words
    gated_delta: GatedDeltaImpl | None  # hybrids only
    step: StepKind
    step_why: str  # why not a faster step, where not
    speculative: SpeculativeMethod | None
    memory: MemoryPlan
    batch: BatchPlan
    cpu_paths: dict[str, str] = field(default_factory=dict)  # each layer family's CPU path, and why
    gemm_tiles: dict[str, GemmConfig] = field(default_factory=dict)  # the Triton GEMMs' tiles, by kind and phase
    tensor_parallel_size: int = 1
    vision: bool = False  # the vision tower is loaded
    num_threads: int | None = None  # the CPU: torch's threads (None: torch's default)
    # how a sampled row draws its token: inverse-cdf (the CPU: one cumulative sum, a uniform per row) or
    # exponential-race (argmax of p / Exp(1): no host sync, for GPUs)
    draw: DrawKind = DrawKind.INVERSE_CDF
    # the engine core schedules step N + 1 while the device runs step N (engine/core.py), or not, and why not
    overlap: bool = False
    overlap_why: str = ""
    # the token counts CUDA graphs of mixed steps (prefill chunks, with or without decodes) capture (``MIXED_LADDER``)
    mixed_graph_sizes: tuple[int, ...] = ()
    # the prefix cache the engine core keeps, and why none where none but asked
    prefix_cache: PrefixCacheKind = PrefixCacheKind.NONE
    prefix_cache_why: str = ""
    lora: LoRAKernel | None = None  # where the LoRA adapters' products run (None: no --enable-lora)

    @property
    def cpu_kernels(self) -> bool:
        """MILI's C kernels run the model's layers (bf16, torch attention, one rank)."""
        return self.attention is AttentionBackend.CPU

    @property
    def small_batch_gemv(self) -> bool:
        """The plain bf16 / fp16 linear layers (and a tied lm_head) run decode batches of up to 8 rows on the
        split-K Triton GEMV, larger ones on cuBLAS (model/gpu_linear.py ``SmallBatchLinear``): CUDA, Triton back-end."""
        return (self.attention is AttentionBackend.TRITON and self.device.type == "cuda"
                and self.dtype in (torch.bfloat16, torch.float16))

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_dtype_name(self) -> str:
        return "fp8_e4m3" if self.kv_dtype == torch.float8_e4m3fn else str(self.kv_dtype).removeprefix("torch.")

    def resolve(self, config: EngineConfig) -> EngineConfig:
        """``config`` with this plan's batch limits in place of auto (what the engine builds from)."""
        return config.with_batch_limits(self.batch.max_num_seqs, self.batch.max_num_batched_tokens)

    def describe(self) -> dict[str, str]:
        """The plan in words, a line each (the start-up log, /health, mili selftest)."""
        about = [self.device.name] if self.device.name else []
        if self.device.memory:
            about.append(f"{self.device.memory / GIB:.1f} GiB")
        sizes = self.batch.graph_sizes
        graphs = ""
        if self.step is StepKind.CUDA_GRAPHS:
            eager = "; larger ones eagerly" if self.batch.max_num_seqs > sizes[-1] else ""
            graphs = f" (decode batches of {sizes[0]} to {sizes[-1]} sequences{eager}"
            mixed = self.mixed_graph_sizes
            graphs += f"; mixed steps of up to {mixed[-1]} tokens, {len(mixed)} sizes)" if mixed else \
                "; mixed steps eagerly)"
        rows = {"device": f"{self.device.type} ({', '.join(about)})" if about else self.device.type,
                "dtype": self.dtype_name, "attention": self.attention.value, "weights": self.weight_format,
                "kv cache": self.kv_dtype_name,
                "step": self.step.value + (f" ({self.step_why})" if self.step_why else graphs),
                "batch": self.batch.describe(), "speculative": self.speculative.value if self.speculative else "off",
                "scheduling": "ahead of the device" if self.overlap else f"in turn ({self.overlap_why})",
                "prefix cache": self.prefix_cache.value + (f" ({self.prefix_cache_why})" if self.prefix_cache_why
                                                           else "")}
        if self.lora is not None:
            rows["lora"] = self.lora.value
        if self.device.type == "cpu":
            rows["cpu kernels"] = self.device.cpu_kernels or f"off ({self.device.cpu_kernels_why})"
        if self.small_batch_gemv:
            rows["small batches"] = "linears of up to 8 rows on the split-K Triton GEMV"
        if self.gated_delta:
            rows["gated delta rule"] = self.gated_delta.value
        if self.tensor_parallel_size > 1:
            rows["tensor parallel"] = str(self.tensor_parallel_size)
        if self.gemm_tiles:
            rows["gemm tiles"] = ", ".join(f"{k} {c.block_m}x{c.block_n}/{c.num_stages}"
                                           for k, c in self.gemm_tiles.items())
        return rows


def plan(config: EngineConfig, model_config: ModelConfig, device: DeviceInfo) -> ExecutionPlan:
    """Decide how the model runs (see the module's doc); raises ``InvalidRequest`` for what cannot."""
    tp = config.tensor_parallel_size
    hybrid, on_cuda, on_cpu = model_config.is_hybrid, device.type == "cuda", device.type == "cpu"
    dtype = _dtype(config, model_config, device)
    max_model_len = config.resolve_max_model_len(model_config)
    attention = _attention_backend(config, device)

    # MILI's C kernels: on the CPU, in bf16, with the torch attention path, where they load (one rank)
    off = (f"the model runs {str(dtype).removeprefix('torch.')}; the kernels are bf16's" if dtype != torch.bfloat16
           else "the Triton attention back-end" if attention is not AttentionBackend.TORCH
           else "tensor parallelism" if tp > 1 else "")
    cpu_kernels = on_cpu and config.cpu_kernels and not off and bool(device.cpu_kernels)
    if cpu_kernels:
        attention = AttentionBackend.CPU
    kernels_off = ("not on the CPU" if not on_cpu else off or ("cpu_kernels is off" if not config.cpu_kernels else
                                                                f"no CPU kernels: {device.cpu_kernels_why}"))
    kv_dtype = _kv_dtype(config, attention, dtype, device, kernels_off)
    if kv_dtype == torch.int8 and model_config.head_dim % 2:  # (the int8 pages keep a row's values in pairs)
        raise InvalidRequest(f"--kv-cache-dtype int8 needs an even head_dim, not {model_config.head_dim}",
                             param="kv_cache_dtype")
    if attention is AttentionBackend.TRITON and on_cuda:
        check_device(device.spec, dtype, kv_dtype == torch.float8_e4m3fn)

    if config.enable_lora and model_config.num_labels:
        raise InvalidRequest("LoRA adapters run on the generative models (not on a classification head)",
                             param="enable_lora")
    speculative = SpeculativeMethod(config.speculative_config.method) if config.speculative_config is not None \
        else None
    if speculative is SpeculativeMethod.MTP and (not hybrid or tp > 1):
        raise InvalidRequest("speculative_config: method mtp runs the hybrid models' MTP head (Qwen3.5 / 3.6, "
                             "Qwen3-Next) without tensor parallelism", param="speculative_config")

    gated_delta = None
    if hybrid:
        if on_cuda and not device.fla:
            from mili.kernels.gated_delta_fla import INSTALL_HINT

            raise InvalidRequest(f"hybrid models (Qwen3-Next, Qwen3.5) on CUDA need flash-linear-attention's "
                                 f"kernels: {INSTALL_HINT} (or pip install 'mili[cuda]')", param="device")
        kernel_step = on_cpu and config.cpu_kernels and bool(device.cpu_kernels)  # (any dtype)
        gated_delta = GatedDeltaImpl.FLA if on_cuda else GatedDeltaImpl.TORCH_CPU if kernel_step else \
            GatedDeltaImpl.TORCH

    quant = weight_quant({"quantization_config": getattr(model_config.hf_config, "quantization_config", None)})
    method = getattr(quant, "method", None)
    if method == "gguf" and tp > 1:
        raise InvalidRequest("GGUF models do not run with tensor parallelism yet (their blocks are not split over "
                             "ranks): run it on one device", param="tensor_parallel_size")
    triton_linears = (quant is not None and method != "gguf" and not config.quantization and tp == 1 and not hybrid
                      and (on_cuda or attention is AttentionBackend.TRITON))
    if config.lm_head_dtype == "int8" and (not on_cpu or triton_linears):
        raise InvalidRequest("--lm-head-dtype int8 runs on the CPU's linear layers (not on CUDA or the Triton "
                             "layers)", param="lm_head_dtype")
    int8_kernels = cpu_kernels and device.int8_kernels
    # where --quantization int8 runs on the Triton int8 GEMM: CUDA (SM 8.0+, triton installed), and the Triton
    # backend under TRITON_INTERPRET (tests); elsewhere the CPU's int8 paths (MILI's kernel, aten's weight-only)
    int8_gemm = device.triton and (attention is AttentionBackend.TRITON
                                   or (on_cuda and device.capability >= MIN_CAPABILITY))
    keep_quantized = triton_linears or (int8_kernels and method in ("awq", "gguf"))
    fp8_act = triton_linears and _fp8_activations(device, dtype)
    linears, weight_format, fp8_round_trip = _linears(config, quant, dtype, device, hybrid, tp, triton_linears,
                                                      fp8_act, cpu_kernels, int8_kernels, int8_gemm, keep_quantized,
                                                      model_config.is_moe)
    lm_head = _lm_head(config, on_cpu and tp == 1 and not triton_linears, keep_quantized and cpu_kernels and
                       not hybrid and config.quantization is None and method == "awq", int8_kernels, cpu_kernels,
                       _prepack(config, device))
    if lm_head is not None:
        weight_format += f", lm_head {lm_head.describe_head(dtype)}"

    step, step_why = _step(config, model_config, device, attention, cpu_kernels, speculative, tp,
                           linears.fused_decode)
    batch = _batch(config, device)
    memory = _memory(config, device, attention, hybrid, batch.max_num_seqs)
    paths = family_paths(device.cpu_kernels, device.cpu_kernels_why, device.int8_kernels_why, device.onednn_bf16,
                         off) if on_cpu else {}
    threads = config.num_threads or (max(1, device.cpu_count // tp) if tp > 1 else None) if on_cpu else None
    return ExecutionPlan(device, dtype, max_model_len, attention, kv_dtype, linears, int8_kernels, fp8_act,
                         keep_quantized, fp8_round_trip, lm_head, weight_format, gated_delta, step, step_why,
                         speculative, memory, batch, paths, _gemm_tiles(device, dtype, linears), tp,
                         config.takes_images(model_config), threads,
                         DrawKind.INVERSE_CDF if on_cpu else DrawKind.EXPONENTIAL_RACE,
                         *_overlap(config, device, speculative, tp),
                         _mixed_graph_sizes(step, model_config, config.takes_images(model_config), batch),
                         *_prefix_cache(config, hybrid), lora=_lora_kernel(config, attention))


def _dtype(config: EngineConfig, model_config: ModelConfig, device: DeviceInfo) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    dtype = model_config.checkpoint_dtype
    # CPUs without fast half support still run bf16 well through oneDNN; float16 does not
    return torch.bfloat16 if device.type == "cpu" and dtype == torch.float16 else dtype


def _attention_backend(config: EngineConfig, device: DeviceInfo) -> AttentionBackend:
    """torch | triton: auto picks Triton on CUDA. Triton elsewhere needs TRITON_INTERPRET=1."""
    on_cuda = device.type == "cuda"
    name = config.attention_backend
    if name == "auto":
        name = "triton" if on_cuda and device.triton else "torch"
    if name == "triton":
        if not device.triton:
            raise InvalidRequest("attention_backend triton needs the triton package (pip install triton)",
                                 param="attention_backend")
        if not on_cuda and not device.triton_interpret:
            raise InvalidRequest("the Triton backend runs on CUDA, or on the CPU under TRITON_INTERPRET=1",
                                 param="attention_backend")
        page = config.page_size
        if page < 16 or page > 64 or page & (page - 1):
            # a key block is one page; above 64 the attention tiles outgrow sm_89's shared memory (float32)
            # and spill (bf16): the compile check's finding (mili/tools/triton_checks/compile_check.py)
            raise InvalidRequest(f"the Triton backend needs page_size a power of two >= 16 and <= 64 (a key "
                                 f"block is one page), got {page}", param="page_size")
    return AttentionBackend(name)


def _kv_dtype(config: EngineConfig, attention: AttentionBackend, dtype: torch.dtype, device: DeviceInfo,
              kernels_off: str) -> torch.dtype:
    """The KV pages' dtype: the model's (auto); float8_e4m3fn (fp8: half the bytes a token, twice the pages in
    the same memory), which the Triton kernels read and write on GPUs with FP8; or int8 (int8: a token's kv head is
    D bytes and a float32 scale, ~1.9x the pages), which MILI's CPU kernels read and write (``attention`` CPU;
    ``kernels_off``: why they don't run, where not)."""
    if config.kv_cache_dtype == "auto":
        return dtype
    if config.kv_cache_dtype == "int8":
        if attention is not AttentionBackend.CPU:
            cuda = " (on CUDA, --kv-cache-dtype fp8)" if device.type == "cuda" else ""
            raise InvalidRequest(f"--kv-cache-dtype int8 runs on MILI's CPU kernels (the CPU, bf16, one rank), which "
                                 f"don't run here: {kernels_off}{cuda}", param="kv_cache_dtype")
        return torch.int8
    if attention is not AttentionBackend.TRITON:
        raise InvalidRequest("--kv-cache-dtype fp8 needs the Triton attention backend (CUDA); on the CPU, "
                             "--kv-cache-dtype int8 halves the pages' bytes (MILI's kernels)", param="kv_cache_dtype")
    if device.type == "cuda" and device.capability < (8, 9):
        raise InvalidRequest("--kv-cache-dtype fp8 needs a GPU with FP8 (compute capability 8.9 or later)",
                             param="kv_cache_dtype")
    return torch.float8_e4m3fn


def _linears(config, quant, dtype, device, hybrid, tp, triton_linears, fp8_act, cpu_kernels, int8_kernels,
             int8_gemm, keep_quantized, moe) -> tuple[LinearFormat, str, bool]:
    """(the body's linear format, what the weights compute as, whether fp8 weights round-trip first)."""
    name = str(dtype).removeprefix("torch.")
    dequantized = f"{quant.describe()}, dequantized to {name}" if quant else "unquantized"
    if hybrid:
        if config.quantization:
            raise InvalidRequest(f"--quantization {config.quantization} is not supported for hybrid models yet",
                                 param="quantization")
        if quant and not (quant.method == "gguf" and cpu_kernels):  # (GGUF's blocks run on the CPU's kernels)
            return Plain(), f"{quant.describe()}, dequantized", False
    if config.quantization and quant is not None:
        raise InvalidRequest(f"--quantization {config.quantization}: the checkpoint is already quantized "
                             f"({quant.describe()})", param="quantization")
    if tp > 1:
        if config.quantization:
            raise InvalidRequest("quantization with tensor parallelism is not supported yet", param="quantization")
        return Plain(), f"{quant.describe()}, dequantized" if quant else "unquantized", False
    if triton_linears:
        from mili.model.gpu_linear import describe

        return Triton(fp8_act, quant.group_size), describe(quant, fp8_act, moe, dtype), False
    fp8 = config.quantization == "fp8"
    if fp8 and device.type == "cuda" and device.capability >= (8, 9):
        return Fp8(), "fp8 e4m3 per channel (torch._scaled_mm, per-token activations)", True
    cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
    method = getattr(quant, "method", None)
    if config.quantization in ("int8", "fp8") or (quant is not None and quant.method not in ("awq", "gguf")
                                                  and cpu_bf16):
        origin = quant.describe() if quant else ("fp8 values" if fp8 else "")
        triton = int8_gemm and config.quantization is not None  # (not a checkpoint's: those took the Triton GEMMs)
        how = "Triton, weight-only" if triton else "W8A8 kernel" if int8_kernels else "weight-only"
        return TritonInt8() if triton else Int8(int8_kernels), (f"int8 per channel ({how})"
                                                     + (f", requantized from {origin}" if origin else "")), fp8
    if cpu_kernels:
        kernels = "the int4 and int8 kernels (W4A8, W8A8)" if method == "gguf" else "the int4 kernel (W4A8)"
        described = f"{quant.describe()} on {kernels}" if keep_quantized else dequantized
        return Kernel(_prepack(config, device)), described, False  # (layers it can't take: oneDNN's, where it runs)
    if _prepack(config, device) and dtype == torch.bfloat16:
        return Packed(), dequantized, False
    return Plain(), dequantized, False


def _prepack(config: EngineConfig, device: DeviceInfo) -> bool:
    """bf16 layers that MILI's kernels don't take may go to oneDNN's packed layout: on the CPU, where its bf16 runs
    (``DeviceInfo.onednn_bf16``) and --no-cpu-weight-prepack does not say otherwise."""
    return device.type == "cpu" and config.cpu_weight_prepack and not device.onednn_bf16


def _fp8_activations(device: DeviceInfo, dtype: torch.dtype) -> bool:
    from mili.kernels.triton.quant_gemm import fp8_activations  # (triton's import: only where its GEMMs run)

    return fp8_activations(device.type, device.capability, dtype)


def _lm_head(config: EngineConfig, on_cpu_layers: bool, int4_body: bool, int8_kernels: bool,
             cpu_kernels: bool, prepack: bool) -> LinearFormat | None:
    """The head's format as ``lm_head_dtype`` makes it: int8 (``Int8``, on MILI's W8A8 kernel where it runs), bf16
    (the model's dtype: ``Kernel`` on MILI's CPU kernels, else ``Packed`` where oneDNN's packing runs (``prepack``),
    else ``Plain``), or None (as the body's format leaves it:
    int8 with an int8 body, else the model's dtype). auto quantizes it where the body is an int4 checkpoint on the
    int4 kernel (int8 bodies already quantize their head); bf16 means unquantized (a float32 model's head stays
    float32)."""
    asked = config.lm_head_dtype
    if asked == "auto":
        asked = "int8" if int4_body else None
    elif not on_cpu_layers:  # (int8 elsewhere: refused above)
        asked = None
    if asked == "int8":
        return Int8(int8_kernels)
    if asked != "bf16":
        return None
    return Kernel(prepack) if cpu_kernels else Packed() if prepack else Plain()


def _step(config, model_config, device, attention, cpu_kernels, speculative, tp,
          kernel_linears) -> tuple[StepKind, str]:
    """How a decode step runs: CUDA graphs (the Triton back-end on CUDA), the C decode layer (MILI's CPU kernels,
    dense models whose layers it takes whole), or eagerly; and why not faster where not."""
    if config.enforce_eager:
        return StepKind.EAGER, "--enforce-eager" if device.type == "cuda" or cpu_kernels else ""
    if device.type == "cuda":
        if config.enable_lora:
            return StepKind.EAGER, "LoRA adapters (their products run beside each layer's) until verified under capture"
        if model_config.is_moe or tp > 1:
            return StepKind.EAGER, "MoE and tensor-parallel models run eagerly until verified under capture"
        if speculative is SpeculativeMethod.MTP:
            return StepKind.EAGER, "MTP drafts read every row's hidden state"
        if attention is AttentionBackend.TRITON:
            return StepKind.CUDA_GRAPHS, ""
        return StepKind.EAGER, "the torch attention back-end"
    if cpu_kernels and not model_config.is_hybrid:
        cfg = model_config
        if cfg.is_moe:
            return StepKind.EAGER, "a mixture-of-experts model (its layers run as modules, experts on the kernels)"
        if cfg.head_dim % 32 or cfg.head_dim > 1024:  # (the fused q/k-norm kernel's bounds)
            return StepKind.EAGER, f"head_dim {cfg.head_dim}: the fused decode layer takes multiples of 32"
        outputs = ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.hidden_size,
                   2 * cfg.intermediate_size)  # (the fused layer's products: qkv, o / down, gate_up)
        if not kernel_linears or getattr(cfg.hf_config, "attention_bias", False) or any(n % 16 for n in outputs):
            return StepKind.EAGER, "a layer the fused decode layer can't take (bias, sizes not a multiple of 16, or " \
                            "another linear kind)"
        return StepKind.CPU_DECODE, ""
    return StepKind.EAGER, ""


def _mixed_graph_sizes(step: StepKind, model_config: ModelConfig, vision: bool, batch: BatchPlan) -> tuple[int, ...]:
    """The token counts of the mixed steps' CUDA graphs: ``MIXED_LADDER`` below max_num_batched_tokens, and that;
    none where decode steps run eagerly, for the hybrids (the Gated DeltaNet chunks' kernels take their lengths on
    the host) and for image models (M-RoPE positions)."""
    if step is not StepKind.CUDA_GRAPHS or model_config.is_hybrid or vision:
        return ()
    top = batch.max_num_batched_tokens
    return (*(t for t in MIXED_LADDER if t < top), top)


def _overlap(config: EngineConfig, device: DeviceInfo, speculative: SpeculativeMethod | None,
             tp: int) -> tuple[bool, str]:
    """Whether the engine core schedules ahead of the device (--async-scheduling), and why not where not: auto on
    CUDA only (a CPU step has run when it returns, so nothing would overlap; "on" runs the same loop there, for
    tests). Speculative steps verify drafts on the host, and the other tensor-parallel ranks take each step's input
    ids from rank 0's broadcast, which has no tokens still on the device."""
    asked = config.async_scheduling
    if asked == "off":
        return False, "--async-scheduling off"
    if speculative is not None:
        return False, "speculative decoding verifies its drafts on the host"
    if tp > 1:
        return False, "tensor parallelism: the other ranks take each step's inputs from rank 0's host"
    if asked == "auto" and device.type != "cuda":
        return False, "a CPU step has run when it returns: nothing to overlap"
    return True, ""


def _prefix_cache(config: EngineConfig, hybrid: bool) -> tuple[PrefixCacheKind, str]:
    """The prefix cache (--enable-prefix-caching): a radix tree of KV pages; a hybrid's also keeps snapshots of the
    recurrent state (``MemoryPlan.states``: as many as asked, else from the budget), none when asked for none."""
    if not config.enable_prefix_caching:
        return PrefixCacheKind.NONE, ""
    if not hybrid:
        return PrefixCacheKind.RADIX, ""
    if config.num_state_snapshots == 0:
        return PrefixCacheKind.NONE, "num_state_snapshots is 0 (a hybrid model resumes only from a snapshot)"
    return PrefixCacheKind.HYBRID_RADIX, ""


def _lora_kernel(config: EngineConfig, attention: AttentionBackend) -> LoRAKernel | None:
    """Where the LoRA adapters' products run: beside the layers' own kernels (Triton's, MILI's CPU ones), else torch."""
    if not config.enable_lora:
        return None
    return {AttentionBackend.TRITON: LoRAKernel.TRITON, AttentionBackend.CPU: LoRAKernel.CPU}.get(attention,
                                                                                              LoRAKernel.TORCH)


def _batch(config: EngineConfig, device: DeviceInfo) -> BatchPlan:
    """The batch limits: as asked, or where auto (None) by the device; the CUDA graphs' sizes from them."""
    seqs, tokens = batch_limits(device)
    asked_seqs, asked_tokens = config.max_num_seqs, config.max_num_batched_tokens
    max_num_seqs = asked_seqs if asked_seqs is not None else seqs
    return BatchPlan(max_num_seqs, asked_tokens if asked_tokens is not None else tokens,
                     "device" if asked_seqs is None else "user", "device" if asked_tokens is None else "user",
                     graph_batch_sizes(max_num_seqs))


def _memory(config: EngineConfig, device: DeviceInfo, attention: AttentionBackend, hybrid: bool,
            max_num_seqs: int) -> MemoryPlan:
    budget = config.kv_cache_memory
    if budget is None and device.type != "cuda":
        from mili.config import default_kv_cache_bytes

        budget = default_kv_cache_bytes()
    spec = config.speculative_config
    return MemoryPlan(budget, config.num_kv_pages, hybrid, config.num_state_slots, config.num_state_snapshots,
                      max_num_seqs, config.enable_prefix_caching,
                      spec.disable_by_batch_size if spec is not None else 0,
                      hybrid and attention is AttentionBackend.TRITON,
                      device.type == "cpu")


def _gemm_tiles(device: DeviceInfo, dtype: torch.dtype, linears: LinearFormat) -> dict[str, GemmConfig]:
    """The Triton GEMMs' tiles on this device for a decode row and a full prefill chunk (what the wrappers pick
    at launch from the same function; ``check_device`` has made sure each kind has one): a quantized
    checkpoint's FP8 and int4 GEMMs, or the int8 GEMM; none for other linears."""
    a_bytes, exact = dtype.itemsize, dtype == torch.float32
    return {f"{kind} {phase}": gemm_config(m, 128, a_bytes, w, exact, device.spec)
            for kind, w in linears.gemm_kinds for phase, m in (("decode", 1), ("prefill", 2048))}
