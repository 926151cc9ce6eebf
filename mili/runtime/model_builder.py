"""The model builder: a model as the execution plan says, and what the runner runs it on (``build_runner_parts``:
the caches, the batch builder, the sampler, the drafter, the step's CUDA graphs or C decode layer). It is the one
place that applies the plan's kernel choices to a model: the attention back-end and its ops table (given to the
model's constructors), the Gated DeltaNet implementation (set on each such layer), and the linear layers swapped for
their format's kernels once the weights are in."""

from __future__ import annotations

import contextlib
import ctypes
import logging
from dataclasses import dataclass

import torch

from mili.config import EngineConfig, ModelConfig
from mili.kernels import gated_delta_fla
from mili.kernels.reference import TorchOps
from mili.model.cpu_linear import fp8_round_trip_linears
from mili.model.loader import load_weights
from mili.model.qwen3 import Qwen3ForCausalLM
from mili.model.qwen3_5 import GatedDeltaNet, Qwen3_5ForCausalLM
from mili.model.qwen3_vl import Qwen3VLForConditionalGeneration
from mili.runtime.attention.torch_backend import TorchAttentionBackend
from mili.runtime.encoder_cache import EncoderCache, VisionBudget
from mili.runtime.input_batch import InputBatchBuilder
from mili.runtime.memory import CacheMemory
from mili.runtime.plan import (AttentionBackend, ExecutionPlan, GatedDeltaImpl, LoRAKernel, SpeculativeMethod,
                               StepKind)
from mili.runtime.sampler import DRAWS, Sampler
from mili.speculative.mtp import MtpDrafter

log = logging.getLogger("mili")


def attention_and_ops(plan: ExecutionPlan, max_pages_per_seq: int):
    """The plan's attention back-end (an instance) and ops table (a class of static kernels)."""
    if plan.attention is AttentionBackend.TRITON:
        from mili.kernels.triton.ops import TritonOps
        from mili.runtime.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(max_pages_per_seq), TritonOps
    if plan.attention is AttentionBackend.CPU:
        from mili.kernels.cpu.ops import CpuOps
        from mili.runtime.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(), CpuOps
    return TorchAttentionBackend(), TorchOps


def build_model(plan: ExecutionPlan, model_config: ModelConfig, path: str, device: torch.device, attention, ops):
    """The model on ``device`` with its weights from ``path``, its kernels as ``plan`` says."""
    mtp = plan.speculative is SpeculativeMethod.MTP
    with torch.device("meta"):
        if model_config.is_hybrid:
            model = Qwen3_5ForCausalLM(model_config, attention, plan.dtype, ops, mtp=mtp, vision=plan.vision)
        elif model_config.vision_config is not None:  # Qwen3-VL
            model = Qwen3VLForConditionalGeneration(model_config, attention, plan.dtype, ops, plan.vision)
        else:
            model = Qwen3ForCausalLM(model_config, attention, plan.dtype, ops)
    # (Module.to_empty's empty_like on meta tensors goes through torch._refs, whose first use imports sympy: ~1 s
    # of every engine's start-up; torch.empty makes the same uninitialised tensors)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    quantized = load_weights(model, path, keep_quantized=plan.keep_quantized)
    model.eval()
    apply_formats(model, plan, quantized)
    if plan.gated_delta is not None:  # (the C decode step takes the loaded weights)
        _use_gated_delta(model, plan.gated_delta)
    log.info("weights: %s", plan.weight_format)
    _release_freed_memory()  # the plain weights a swap replaced go back to the OS (host memory)
    return model


@dataclass(eq=False)
class RunnerParts:
    """What a runner runs on, built as the plan says (``build_runner_parts``): read by the engine core (the model,
    its config, the caches' layout, the LoRA slots, the encoder cache), the tools and the tests; run by the runner.
    ``model_config``: this rank's shard; ``config``: the plan's (``ExecutionPlan.resolve``)."""

    plan: ExecutionPlan
    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    attention: object  # the attention back-end (an instance)
    model: torch.nn.Module
    memory: CacheMemory  # the KV pages and recurrent states, and their layout
    batches: InputBatchBuilder
    sampler: Sampler
    loras: object = None  # the LoRA adapters' slots beside each projection (mili/lora.py ``LoRASlots``)
    vision_budget: VisionBudget | None = None  # the vision tower's memory plan
    encoder_cache: EncoderCache | None = None  # its outputs by image
    mtp: MtpDrafter | None = None
    graphs: object = None  # a decode step as CUDA graphs (``CudaGraphRunner``)
    cpu_decode: object = None  # or as one C call per layer (``CpuDecodeRunner``)

    hybrid = property(lambda self: self.model_config.is_hybrid)
    dtype = property(lambda self: self.plan.dtype)
    kv_caches = property(lambda self: self.memory.kv_caches)
    states = property(lambda self: self.memory.states)  # a hybrid's recurrent states (None otherwise)
    layout = property(lambda self: self.memory.layout)  # (the engine core makes its page, slot and snapshot pools)
    max_model_len = property(lambda self: self.memory.max_model_len)  # (the KV pool may lower the plan's)
    max_pages_per_seq = property(lambda self: self.memory.max_pages_per_seq)

    def run_model(self, batch) -> torch.Tensor:
        """The model over one batch, with its caches: KV pages (and, for a hybrid, the recurrent states)."""
        if self.hybrid:
            return self.model(batch, self.kv_caches, self.states.caches)
        return self.model(batch, self.kv_caches)


def build_runner_parts(plan: ExecutionPlan, config: EngineConfig, model_config: ModelConfig, path: str,
                       device: torch.device, tp_size: int = 1) -> RunnerParts:
    """The model and all a runner runs it on (``RunnerParts``), as ``plan`` says: torch's threads, the attention
    back-end and the model on its ops, the LoRA slots, the vision tower's budget and encoder cache, the caches (which
    may lower max_model_len to what they hold), the batch builder, the MTP drafter, the rotary tables, the sampler
    (on MILI's CPU kernels where they load), and the step's CUDA graphs or C decode layer. Built on the plan's CPU
    kernels (its ISA's library) where it has them."""
    if plan.num_threads:
        torch.set_num_threads(plan.num_threads)
    with on_kernels(plan):
        return _build_parts(plan, config, model_config, path, device, tp_size)


@contextlib.contextmanager
def on_kernels(plan: ExecutionPlan):
    """Within the block, MILI's CPU kernels run on the plan's library (its ISA's: ``DeviceInfo.kernels``), whatever
    MILI_CPU_ISA or another engine in this process chose; nothing where the plan has none."""
    from mili.kernels.cpu import ops as cpu_ops

    with cpu_ops.library(plan.device.kernels() if plan.device.type == "cpu" else None):
        yield


def _build_parts(plan, config, model_config, path, device, tp_size) -> RunnerParts:
    attention, ops = attention_and_ops(plan, -(-plan.max_model_len // config.page_size))
    model = build_model(plan, model_config, path, device, attention, ops)
    loras = None
    if plan.lora is not None:
        from mili.lora import LoRASlots, add_lora_layers

        step = add_lora_layers(model, config.max_loras, config.max_lora_rank, plan.dtype, device,
                               kernels=plan.lora is LoRAKernel.CPU, triton=plan.lora is LoRAKernel.TRITON)
        loras = LoRASlots(model, step, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras)
    vision_budget = encoder_cache = None
    if plan.vision:
        vision_budget = VisionBudget.plan(config, model_config, path, plan.dtype, plan.max_model_len)
        encoder_cache = EncoderCache(vision_budget.cache_tokens)
        log.info("vision tower: %s", vision_budget.describe())
    memory = CacheMemory(plan, config, model_config, model, attention, device, vision_budget, tp_size)
    batches = InputBatchBuilder(device, config.page_size, model_config.is_hybrid,
                                plan.attention is AttentionBackend.TRITON, model, encoder_cache,
                                vision_budget.tokens_per_call if vision_budget else 0, plan.batch.max_num_seqs,
                                memory.max_pages_per_seq)
    mtp = MtpDrafter(model, memory.kv_caches[-1], batches.one_token_batch) \
        if plan.speculative is SpeculativeMethod.MTP else None  # (its KV: the pool's last layer)
    model.init_rotary(memory.max_model_len, device)
    if hasattr(attention, "max_pages_per_seq"):
        attention.max_pages_per_seq = memory.max_pages_per_seq
        if plan.step is StepKind.CUDA_GRAPHS:
            attention.graph_sizes = plan.batch.graph_sizes
    parts = RunnerParts(plan, config, model_config, device, attention, model, memory, batches, _sampler(plan), loras,
                        vision_budget, encoder_cache, mtp)
    if plan.step is StepKind.CUDA_GRAPHS:
        from mili.runtime.cuda_graph import CudaGraphRunner

        parts.graphs = CudaGraphRunner(parts)
    elif plan.step is StepKind.CPU_DECODE:
        from mili.runtime.cpu_decode import CpuDecodeRunner

        parts.cpu_decode = CpuDecodeRunner(model, plan.device.kernels())
        if not parts.cpu_decode.available:  # (the plan's checks missed a case: run it eagerly, and say so)
            log.warning("fused CPU decode off, though planned (%s)", parts.cpu_decode.why_not)
            parts.cpu_decode = None
    elif plan.step_why:
        log.info("decode steps: eager (%s)", plan.step_why)
    return parts


def _sampler(plan: ExecutionPlan) -> Sampler:
    """The sampler on the plan's draw; where MILI's CPU kernels load, on their bitmask (float32 logits: any model
    dtype), and where they run the model, on their argmax too (reading bf16 logits in place)."""
    sampler = Sampler(draw=DRAWS[plan.draw])
    if plan.device.cpu_kernels:
        from mili.kernels.cpu import ops as cpu_ops

        sampler.apply_bitmask = cpu_ops.apply_bitmask
        if plan.cpu_kernels:
            sampler.argmax = cpu_ops.argmax
    return sampler


def _use_gated_delta(model: torch.nn.Module, how: GatedDeltaImpl) -> None:
    """Each Gated DeltaNet layer on the plan's implementation (``GatedDeltaImpl``)."""
    fla = gated_delta_fla.FlaGatedDelta() if how is GatedDeltaImpl.FLA else None
    for layer in model.modules():
        if isinstance(layer, GatedDeltaNet):
            layer.kernels = fla
            if how is GatedDeltaImpl.TORCH_CPU:
                layer.use_cpu_kernel()
    log.info("gated delta rule: %s", {GatedDeltaImpl.FLA: "flash-linear-attention's Triton kernels",
                                      GatedDeltaImpl.TORCH_CPU: "torch (decode steps: MILI's CPU kernel)",
                                      GatedDeltaImpl.TORCH: "torch"}[how])


def apply_formats(model, plan: ExecutionPlan, quantized: dict) -> None:
    """The linear layers on their format's kernels (``plan.linears``, a ``formats.LinearFormat``), then the lm_head
    on ``plan.lm_head``'s, then what stayed plain on the small-batch GEMV where the plan says. ``quantized``: the
    checkpoint's layers the loader kept as stored."""
    if plan.fp8_round_trip:
        fp8_round_trip_linears(model)
    plan.linears.apply(model, quantized, skip_head=plan.lm_head is not None)
    if plan.lm_head is not None:
        plan.lm_head.apply_head(model)
    if plan.small_batch_gemv:  # (what the format left plain: decode batches on the split-K GEMV)
        from mili.model.gpu_linear import use_small_batch_gemv

        use_small_batch_gemv(model)


def _release_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse; give it back (a no-op where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
