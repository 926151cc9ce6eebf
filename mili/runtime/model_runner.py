"""ModelRunner: owns everything on the device (weights, the KV pool) and runs one step of the model."""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import signal
import os
from concurrent.futures import Future

import torch
import torch.distributed as dist

from mili.cache.page_pool import PagePool
from mili.cache.state_pool import StatePool
from mili.config import EngineConfig, ModelConfig, default_kv_cache_bytes
from mili.errors import InvalidRequest
from mili.kernels import cpu, gated_delta_fla
from mili.kernels.cpu import ops as cpu_ops
from mili.kernels.reference import TorchOps
from mili.model.checks import weight_quant
from mili.model.cpu_linear import (fp8_gemm_available, fp8_round_trip_linears, int4_layer, prepack_available,
                                   swap_linears, swap_lm_head)
from mili.model.loader import load_weights
from mili.model.qwen3 import Qwen3ForCausalLM
from mili.model.qwen3_5 import Qwen3_5ForCausalLM
from mili.model.qwen3_vl import Qwen3VLForConditionalGeneration
from mili.process import die_with_parent
from mili.runtime import parallel
from mili.model.batch import ForwardBatch
from mili.runtime.attention.torch_backend import TorchAttentionBackend
from mili.runtime.encoder_cache import EncoderCache, VisionBudget
from mili.runtime.images import RequestImages, StepImages
from mili.runtime.recurrent_state import RecurrentStateCache
from mili.runtime.prompt_logprobs import PromptScorer, rows_per_slice
from mili.runtime.sampler import NO_TOKEN, Sampler, SamplerOutput, SamplingMetadata
from mili.speculative.mtp import MtpDrafter
from mili.speculative.verify import SampleRow, accept_drafts

log = logging.getLogger("mili")


def release_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse; give it back (a no-op where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: str, rank: int = 0,
                 address: str | None = None):
        """``rank``/``address``: tensor parallelism (``config.tensor_parallel_size`` > 1): rank 0 starts the
        other ranks' processes on this node; each runner then holds its rank's shard of the weights and KV."""
        self.tp_size, self.rank, self.workers = config.tensor_parallel_size, rank, []
        self.device = config.torch_device
        self.hybrid = model_config.is_hybrid
        self.states: RecurrentStateCache | None = None  # hybrids: the recurrent-state slots and tensors
        # hybrids: the conv + gated delta rule's kernels (fla's on CUDA, refused by name without fla-core)
        self.gated_delta = gated_delta_fla.select(self.device) if self.hybrid else None
        if self.tp_size > 1:
            shard = model_config.shard(rank, self.tp_size)  # one that cannot be split fails before anything starts
            if rank == 0 and parallel.torchrun_rank() is not None:
                address = "env://"  # the other ranks are torchrun's processes
            elif rank == 0:
                self.workers, address = parallel.start_workers(worker_main, config, model_config, path)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", parallel.local_rank(rank))
            parallel.init_group(rank, self.tp_size, address, self.device)
            model_config = shard
        self.config, self.model_config = config, model_config
        self.dtype = config.torch_dtype(model_config)
        if self.device.type == "cpu" and (config.num_threads or self.tp_size > 1):
            torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // self.tp_size))
        self.max_model_len = config.resolve_max_model_len(model_config)
        self.attention_backend = config.resolve_attention_backend()
        self.kv_dtype = self._kv_cache_dtype()
        if self.device.type == "cuda" and self.attention_backend == "triton":
            self._check_triton_device()
        self.cpu_kernels = self._use_cpu_kernels()
        backend, ops = self._backend_and_ops()
        self.attention = backend
        spec = config.speculative_config
        self.mtp: MtpDrafter | None = None  # speculative decoding's MTP head (mili/speculative/mtp.py)
        use_mtp = spec is not None and spec.method == "mtp"
        if use_mtp and (not self.hybrid or self.tp_size > 1):
            raise InvalidRequest("speculative_config: method mtp runs the hybrid models' MTP head (Qwen3.5 / 3.6, "
                                 "Qwen3-Next) without tensor parallelism", param="speculative_config")
        vision = config.takes_images(model_config)  # (where not, the loader says it skips the tower's tensors)
        with torch.device("meta"):
            if self.hybrid:
                model = Qwen3_5ForCausalLM(model_config, backend, self.dtype, ops, mtp=use_mtp, vision=vision)
            elif model_config.vision_config is not None:  # Qwen3-VL
                model = Qwen3VLForConditionalGeneration(model_config, backend, self.dtype, ops, vision)
            else:
                model = Qwen3ForCausalLM(model_config, backend, self.dtype, ops)
        self.model = model.to_empty(device=self.device)
        if self.hybrid:
            gated_delta_fla.use(self.model, self.gated_delta)
            log.info("gated delta rule: %s", "flash-linear-attention's Triton kernels" if self.gated_delta
                     else "torch" + (" (decode steps: MILI's CPU kernel)" if self.device.type == "cpu"
                                     and config.cpu_kernels and cpu.available() else ""))
        self.weight_quant = weight_quant(
            {"quantization_config": getattr(model_config.hf_config, "quantization_config", None)})
        # a quantized checkpoint's layers kept as stored: on the Triton GEMMs, or AWQ's on the CPU's int4 kernel
        self.triton_linears = (self.weight_quant is not None and not config.quantization and self.tp_size == 1
                               and not self.hybrid  # (the hybrids' linears are torch's, dequantized)
                               and (self.device.type == "cuda" or self.attention_backend == "triton"))
        if config.lm_head_dtype == "int8" and (self.device.type != "cpu" or self.triton_linears):
            raise InvalidRequest("--lm-head-dtype int8 runs on the CPU's linear layers (not on CUDA or the Triton "
                                 "layers)", param="lm_head_dtype")
        keep = self.triton_linears or (self.cpu_kernels and cpu.int8_available()  # (the int4 kernel: a byte dot product)
                                       and getattr(self.weight_quant, "method", None) == "awq")
        quantized = load_weights(self.model, path, keep_quantized=keep)
        self.model.eval()
        self.weight_format = self._swap_linears(quantized)
        log.info("weights: %s", self.weight_format)
        if self.device.type == "cpu":
            release_freed_memory()  # the plain weights a swap replaced go back to the OS
        self.vision_budget = self.encoder_cache = None  # the tower's memory plan and its outputs by image
        if vision:
            self.vision_budget = VisionBudget.plan(config, model_config, path, self.dtype, self.max_model_len)
            self.encoder_cache = EncoderCache(self.vision_budget.cache_tokens)
            log.info("vision tower: %s", self.vision_budget.describe())
        self._allocate_kv_cache()  # may lower max_model_len to what the pool holds
        if use_mtp:  # its KV: the pool's last layer
            self.mtp = MtpDrafter(self.model, self.kv_caches[-1], self._one_token_batch)
        self.model.init_rotary(self.max_model_len, self.device)
        if hasattr(backend, "max_pages_per_seq"):
            backend.max_pages_per_seq = self.max_pages_per_seq
        self.sampler = Sampler(cpu_ops.argmax) if self.cpu_kernels else Sampler()
        if self.device.type == "cpu" and config.cpu_kernels and cpu.available():  # (float32 logits: any model dtype)
            self.sampler.apply_bitmask = cpu_ops.apply_bitmask
        self.graphs = None
        if self.device.type == "cuda" and (model_config.is_moe or self.tp_size > 1) and not config.enforce_eager:
            log.info("CUDA graphs off: MoE and tensor-parallel models run eagerly until verified under capture")
        elif self.device.type == "cuda" and use_mtp and not config.enforce_eager:
            log.info("CUDA graphs off: MTP drafts read every row's hidden state (eager steps)")
        elif self.device.type == "cuda" and self.attention_backend == "triton" and not config.enforce_eager:
            from mili.runtime.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self)
        self.cpu_decode = None  # decode steps as one C call per layer (the CPU's counterpart of the graphs)
        if self.hybrid and self.device.type == "cpu" and config.cpu_kernels and cpu.available():
            for module in self.model.modules():  # the Gated DeltaNet decode step in one C call (any dtype)
                if hasattr(module, "use_cpu_kernel"):
                    module.use_cpu_kernel()
        if self.cpu_kernels and not config.enforce_eager and not self.hybrid:
            from mili.runtime.cpu_decode import CpuDecodeRunner

            self.cpu_decode = CpuDecodeRunner(self.model)
            if not self.cpu_decode.available:
                log.info("fused CPU decode off (%s)", self.cpu_decode.why_not)
                self.cpu_decode = None

    def _swap_linears(self, quantized: dict) -> str:
        """Put the linear layers on the kernels for this device, dtype and weight format (the lm_head as
        ``lm_head_dtype`` asks); returns what the weights compute as (for /health and the start-up log).
        ``quantized``: the loader's kept layers."""
        head = self._lm_head_dtype(quantized)
        weight_format = self._swap_body(quantized, skip_head=head is not None)
        if head is None:
            return weight_format
        int8_kernels = self.cpu_kernels and cpu.int8_available()
        swap_lm_head(self.model, head, kernels=int8_kernels if head == "int8" else self.cpu_kernels)
        name = head if head == "int8" else str(self.dtype).removeprefix("torch.")
        return weight_format + f", lm_head {name}" + (" (W8A8 kernel)" if head == "int8" and int8_kernels else "")

    def _lm_head_dtype(self, quantized: dict) -> str | None:
        """What ``lm_head_dtype`` makes of the head here: int8, bf16, or None (as the body's swap leaves it: int8
        with an int8 body, else the model's dtype). auto quantizes it where the body is quantized: an int4
        checkpoint on the int4 kernel (int8 bodies already quantize their head)."""
        config = self.config
        choice = config.lm_head_dtype
        on_cpu_layers = self.device.type == "cpu" and self.tp_size == 1 and not self.triton_linears
        if choice == "auto":
            int4_body = bool(quantized) and self.cpu_kernels and not self.hybrid and config.quantization is None
            return "int8" if int4_body else None
        if not on_cpu_layers:
            return None  # bf16: the head is already in the model's dtype there (int8: refused in __init__)
        return choice  # (bf16 means unquantized: a float32 model's head stays float32)

    def _swap_body(self, quantized: dict, skip_head: bool) -> str:
        config, quant = self.config, self.weight_quant
        cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        if self.hybrid:
            if config.quantization:
                raise InvalidRequest(f"--quantization {config.quantization} is not supported for hybrid models yet",
                                     param="quantization")
            if quant:
                return f"{quant.describe()}, dequantized"
        if config.quantization and quant is not None:
            raise InvalidRequest(f"--quantization {config.quantization}: the checkpoint is already quantized "
                                 f"({quant.describe()})", param="quantization")
        if self.tp_size > 1:
            if config.quantization:
                raise InvalidRequest("quantization with tensor parallelism is not supported yet",
                                     param="quantization")
            return f"{quant.describe()}, dequantized" if quant else "unquantized"
        if self.triton_linears:
            from mili.model import gpu_linear

            if self.device.type == "cuda":
                self._check_triton_device()
            fp8_act = gpu_linear.device_fp8_activations(self.device, self.dtype)
            swap_linears(self.model, "plain", quantized=quantized,
                         make_quantized=functools.partial(gpu_linear.quantized_layer, fp8_activations=fp8_act))
            return gpu_linear.describe(quant, fp8_act, self.model_config.is_moe, self.dtype)
        if config.quantization == "fp8":
            fp8_round_trip_linears(self.model)
            if self.device.type == "cuda" and fp8_gemm_available(self.device):
                swap_linears(self.model, "fp8")
                return "fp8 e4m3 per channel (torch._scaled_mm, per-token activations)"
        if config.quantization in ("int8", "fp8") or (quant is not None and quant.method != "awq" and cpu_bf16):
            kernels = self.cpu_kernels and cpu.int8_available()
            swap_linears(self.model, "int8", kernels=kernels, skip_head=skip_head)
            origin = quant.describe() if quant else ("fp8 values" if config.quantization == "fp8" else "")
            return f"int8 per channel ({'W8A8 kernel' if kernels else 'weight-only'})" + \
                (f", requantized from {origin}" if origin else "")
        if self.cpu_kernels:
            swap_linears(self.model, "kernel", quantized=quantized, make_quantized=int4_layer, skip_head=skip_head)
            if quantized:
                return f"{quant.describe()} on the int4 kernel (W4A8)"
        elif self.device.type == "cpu" and config.cpu_weight_prepack and prepack_available(self.dtype):
            swap_linears(self.model, "packed", skip_head=skip_head)
        return f"{quant.describe()}, dequantized to {str(self.dtype).removeprefix('torch.')}" if quant \
            else "unquantized"

    def _kv_cache_dtype(self) -> torch.dtype:
        """The KV pages' dtype: the model's (auto), or float8_e4m3fn (fp8: half the bytes a token, twice the
        pages in the same memory), which the Triton kernels read and write on GPUs with FP8."""
        if self.config.kv_cache_dtype == "auto":
            return self.dtype
        if self.attention_backend != "triton":
            raise InvalidRequest("--kv-cache-dtype fp8 needs the Triton attention backend (CUDA); the CPU's "
                                 "torch and C-kernel attention read pages in the model's dtype", param="kv_cache_dtype")
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise InvalidRequest("--kv-cache-dtype fp8 needs a GPU with FP8 (compute capability 8.9 or later)",
                                 param="kv_cache_dtype")
        return torch.float8_e4m3fn

    def _check_triton_device(self) -> None:
        """Refuse a GPU the Triton kernels cannot run on (before anything is launched); every tile they pick
        for it fits its shared memory (mili/kernels/triton/launch.py, checked by the compile check)."""
        from mili.kernels.triton.launch import check_device, device_spec

        check_device(device_spec(self.device), self.dtype, self.kv_dtype == torch.float8_e4m3fn)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV pages' dtype by name (/health): the model's dtype, or fp8_e4m3."""
        return "fp8_e4m3" if self.kv_dtype == torch.float8_e4m3fn else str(self.kv_dtype).removeprefix("torch.")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.config.page_size)

    def _use_cpu_kernels(self) -> bool:
        """MILI's C kernels: on the CPU, in bf16, with the torch attention path, where they build and pass their
        check at load (not yet with tensor parallelism: its ranks run torch ops). The start-up log says which
        path each layer family takes, and why."""
        if self.device.type != "cpu":
            return False
        asked = self.config.cpu_kernels  # (--no-cpu-kernels: nothing is built or loaded)
        off = (f"the model runs {str(self.dtype).removeprefix('torch.')}; the kernels are bf16's"
               if self.dtype != torch.bfloat16
               else "the Triton attention back-end" if self.attention_backend != "torch"
               else "tensor parallelism" if self.tp_size > 1 else "")
        log.info("CPU paths: %s", cpu.describe(off, asked))
        return asked and not off and cpu.available()

    def _backend_and_ops(self):
        if self.attention_backend == "triton":
            from mili.kernels.triton.ops import TritonOps
            from mili.runtime.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(self.max_pages_per_seq), TritonOps
        if self.cpu_kernels:
            from mili.kernels.cpu.ops import CpuOps
            from mili.runtime.attention.cpu_backend import CpuAttentionBackend

            return CpuAttentionBackend(), CpuOps
        return TorchAttentionBackend(), TorchOps

    def _kv_budget(self, bytes_per_page: int) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type != "cuda":
            return default_kv_cache_bytes()
        # CUDA: gpu_memory_utilization of the card, less the weights and a profiled activation peak
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self._profile_activation_peak(bytes_per_page)
        peak += self.vision_budget.reserve_bytes if self.vision_budget is not None else 0  # the tower and its cache
        budget = int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device) - peak
        log.info("GPU memory: %.1f GiB total, %.1f GiB free after weights, activation peak %.2f GiB, KV budget "
                 "%.1f GiB", total / 2**30, free / 2**30, peak / 2**30, budget / 2**30)
        return max(budget, 0)

    @torch.inference_mode()
    def _profile_activation_peak(self, bytes_per_page: int) -> int:
        """Peak memory of a full-budget prefill (max_num_batched_tokens) above the weights."""
        self.model.init_rotary(self.max_model_len, self.device)  # rebuilt once the pool fixes the length
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        pages = -(-tokens // self.config.page_size)
        cfg = self.model_config
        shape = (pages, self.config.page_size, cfg.num_key_value_heads, cfg.head_dim)
        kv = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
               torch.zeros(shape, dtype=self.kv_dtype, device=self.device)) for _ in range(cfg.num_hidden_layers)]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        batch = ForwardBatch(
            input_ids=torch.zeros(tokens, dtype=torch.long, device=dev),
            positions=torch.arange(tokens, device=dev), slot_mapping=torch.arange(tokens, device=dev),
            page_table=torch.arange(pages, device=dev)[None], query_lens=[tokens], context_lens=[tokens],
            num_decodes=int(tokens == 1), logits_indices=torch.tensor([tokens - 1], device=dev),
            context_lens_t=torch.tensor([tokens], **i32), query_lens_t=torch.tensor([tokens], **i32),
            query_start_t=torch.tensor([0], **i32), state_slots=[0] if self.hybrid else None)
        states = (self.states.caches,) if self.hybrid else ()  # (a hybrid's states are allocated by now)
        self.model.compute_logits(self.model(batch, kv, *states))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del kv
        torch.cuda.empty_cache()
        # the sampler at a full batch: float32 logits, a sorted copy with int64 indices, probabilities
        sampler = self.config.max_num_seqs * cfg.vocab_size * 4 * 5
        # a slice of prompt logprobs: its logits, a float32 copy, their log-softmax, a comparison mask
        prompt_slice = rows_per_slice(cfg.vocab_size) * cfg.vocab_size * 11
        return peak + sampler + prompt_slice

    def _allocate_kv_cache(self) -> None:
        cfg, page_size = self.model_config, self.config.page_size
        num_layers = cfg.num_attention_layers + (getattr(self.model, "mtp", None) is not None)  # (MTP: one more)
        bytes_per_page = 2 * num_layers * page_size * cfg.num_key_value_heads * cfg.head_dim * self.kv_dtype.itemsize
        state_bytes = self._allocate_states() if self.hybrid else 0
        if self.config.num_kv_pages is not None:  # sized exactly, as asked
            num_pages = self.config.num_kv_pages
            budget = num_pages * bytes_per_page
        else:
            budget = self._kv_budget(bytes_per_page) - state_bytes
            num_pages = min(budget // bytes_per_page, self.max_pages_per_seq * self.config.max_num_seqs)
        if self.tp_size > 1:  # every rank holds the same pages (its own KV heads of them)
            agreed = torch.tensor([num_pages], dtype=torch.long)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            num_pages = int(agreed)
        if num_pages < 1:
            raise InvalidRequest(f"the KV cache budget ({budget} bytes) is less than one page "
                                 f"({bytes_per_page} bytes)", param="kv_cache_memory")
        capacity = num_pages * page_size
        if capacity < self.max_model_len:
            if self.config.max_model_len is not None:
                raise InvalidRequest(
                    f"the KV cache ({budget} bytes) holds {capacity} tokens, fewer than max_model_len "
                    f"{self.max_model_len}: raise kv_cache_memory or lower max_model_len", param="max_model_len")
            log.warning("max_model_len lowered from %d to %d, what the KV cache holds", self.max_model_len, capacity)
            self.max_model_len = capacity
        if self.vision_budget is not None and self.device.type == "cpu":  # (before the pool takes its memory)
            self.vision_budget.check_host_memory(num_pages * bytes_per_page)
        shape_of = getattr(self.attention, "kv_cache_shape", TorchAttentionBackend.kv_cache_shape)
        shape = shape_of(num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                          for _ in range(num_layers)]
        self.pool = PagePool(num_pages, page_size)
        log.info("KV cache: %d pages of %d tokens (%.1f MiB, %s)", num_pages, page_size,
                 num_pages * bytes_per_page / 2**20, self.kv_cache_dtype)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        if self.tp_size > 1 and self.rank == 0:
            parallel.broadcast(("copy", copies))
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache.view(torch.uint8), v_cache.view(torch.uint8)):  # (any dtype, FP8 too)
                cache[dst] = cache[src]

    # -- hybrid models' recurrent states ----------------------------------------------------------------------
    def _allocate_states(self) -> int:
        """The recurrent-state slots: ``num_state_slots``, or max_num_seqs within a quarter of the KV budget (at
        least one); and the prefix cache's snapshots: ``num_state_snapshots``, or (prefix caching on) as many as
        another quarter of the budget holds, 2 to 4 per slot; returns their bytes (taken from the KV budget)."""
        per_slot = RecurrentStateCache.slot_bytes(self.model_config, self.dtype)
        budget = self.config.kv_cache_memory or self._state_sizing_budget()
        num_slots = self.config.num_state_slots
        if num_slots is None:
            num_slots = max(1, min(self.config.max_num_seqs, budget // 4 // per_slot))
        num_snapshots = self.config.num_state_snapshots
        if num_snapshots is None:
            num_snapshots = max(2, min(4 * num_slots, budget // 4 // per_slot)) \
                if self.config.enable_prefix_caching else 0
        spec = self.config.speculative_config  # a spare row for each sequence verifying drafts in a step
        num_spare = min(num_slots, spec.disable_by_batch_size) if spec is not None else 0
        # a scratch row for CUDA graphs' padding rows (the Triton backend: where graphs may be captured)
        self.states = RecurrentStateCache(self.model_config, self.dtype, self.device, num_slots, num_snapshots,
                                          scratch=self.attention_backend == "triton", num_spare=num_spare)
        return self.states.num_bytes

    def _state_sizing_budget(self) -> int:
        """The budget the slots and snapshots are sized from when no kv_cache_memory is given: the CPU's default,
        or on CUDA gpu_memory_utilization of the card less what is allocated (the weights); the KV pages get
        what is left after the profiled activation peak."""
        if self.device.type != "cuda":
            return default_kv_cache_bytes()
        _, total = torch.cuda.mem_get_info(self.device)
        return max(int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device), 0)

    @property
    def state_pool(self) -> StatePool | None:
        return self.states.pool if self.states is not None else None

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy recurrent states row to row: forks (slot to slot), prefix-cache snapshots (slot to snapshot and back);
        rank 0 sends them to the other tensor-parallel ranks (each copies its heads' states)."""
        if self.states is not None:
            if copies and self.tp_size > 1 and self.rank == 0:
                parallel.broadcast(("states", copies))
            self.states.copy(copies)

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """The model over one batch, with its caches: KV pages (and, for a hybrid, the recurrent states)."""
        if self.hybrid:
            return self.model(batch, self.kv_caches, self.states.caches)
        return self.model(batch, self.kv_caches)

    def request_images(self, prompt: list[int], images) -> RequestImages:
        """A request's images (an engine ``ImageInput``) as its steps take them; refused without a vision tower."""
        if getattr(self.model, "visual", None) is None:
            raise InvalidRequest("this model takes no images (a text-only checkpoint, language_model_only, or "
                                 "tensor parallelism)", param="multi_modal_data")
        limit = self.config.limit_mm_per_prompt["image"]
        if len(images.grid_thw) > limit:
            raise InvalidRequest(f"the prompt has {len(images.grid_thw)} images; at most {limit} are allowed "
                                 f"(limit_mm_per_prompt)", param="multi_modal_data")
        merge = self.model_config.vision_config.spatial_merge_size
        return RequestImages.build(prompt, images.pixel_values, images.patch_dim, images.grid_thw, images.hashes,
                                   self.model_config.image_token_id, merge)

    def release_images(self, images: RequestImages) -> None:
        """A request with images ended: the encoder cache's claims for its images go (the outputs may stay)."""
        self.encoder_cache.release_all(images)

    def prepare(self, scheduled) -> tuple[ForwardBatch, list[tuple]]:
        """Batch tensors for a list of ``ScheduledSeq`` (decodes first), built once per step; and the
        prompt positions each sequence scores in it (prompt logprobs): [(sequence, positions)]."""
        input_ids, positions, query_lens, context_lens, logits_indices = [], [], [], [], []
        prompt_rows, scoring = [], []
        num_decodes = 0
        # M-RoPE positions and image rows, only when a request with images is in the step
        images = StepImages(self.model, self.encoder_cache, self.vision_budget.tokens_per_call) \
            if any(s.seq.request.images is not None for s in scheduled) else None
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start, first_row = seq.num_computed_tokens, len(input_ids)
            if images is not None:
                images.add(seq.request.images, start, n, first_row)
            input_ids += seq.token_ids[start:start + n - len(s.draft)] + s.draft
            positions += range(start, start + n)
            query_lens.append(n)
            context_lens.append(start + n)
            num_decodes += n == 1
            if s.samples:  # logits only where a token is sampled (and each draft verified), and where a
                logits_indices += range(len(input_ids) - len(s.draft) - 1, len(input_ids))  # prompt token is scored
            unscored = seq.request.unscored(start, start + n)
            if unscored:
                prompt_rows += range(first_row + unscored.start - start, first_row + unscored.stop - start)
                scoring.append((seq, unscored))
        dev = self.device
        batch = self._forward_batch(
            [s.seq.page_table for s in scheduled], positions, query_lens, context_lens,
            torch.tensor(input_ids, dtype=torch.long, device=dev), num_decodes=num_decodes,
            logits_indices=torch.tensor(logits_indices + prompt_rows, dtype=torch.long, device=dev),
            num_prompt_rows=len(prompt_rows),
            state_slots=[s.seq.state_slot for s in scheduled] if self.hybrid else None)
        if images is not None:  # (the slots stay the tokens' indices; the rotary takes M-RoPE's positions)
            batch.positions, batch.images = images.batch_fields(dev)
        return batch, scoring

    def _forward_batch(self, page_tables: list[list[int]], positions: list[int], query_lens: list[int],
                       context_lens: list[int], input_ids: torch.Tensor, **fields) -> ForwardBatch:
        """A ForwardBatch over sequences' ``page_tables`` (padded to one width), each token's KV slot from its
        position, and the lengths the Triton kernels read from device tensors; ``fields``: the rest."""
        page_size, dev = self.config.page_size, self.device
        max_pages = max(len(t) for t in page_tables)
        page_table = torch.tensor([t + [0] * (max_pages - len(t)) for t in page_tables], dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(len(page_tables)), torch.tensor(query_lens))
        slots = page_table[seq_of_token, pos // page_size] * page_size + pos % page_size
        kernel_lens = {}
        if self.attention_backend == "triton":
            starts = [0, *itertools.accumulate(query_lens[:-1])]
            kernel_lens = {name: torch.tensor(values, dtype=torch.int32, device=dev) for name, values in
                           (("context_lens_t", context_lens), ("query_lens_t", query_lens), ("query_start_t", starts))}
        return ForwardBatch(input_ids=input_ids, positions=pos.to(dev), slot_mapping=slots.to(dev),
                            page_table=page_table.to(dev), query_lens=query_lens, context_lens=context_lens,
                            **kernel_lens, **fields)

    def _one_token_batch(self, page_tables: list[list[int]], positions: list[int],
                         input_ids: torch.Tensor) -> ForwardBatch:
        """A batch of one new token per sequence, at ``positions`` over ``page_tables`` (the MTP drafts')."""
        n = len(positions)
        return self._forward_batch(page_tables, positions, [1] * n, [p + 1 for p in positions], input_ids,
                                   num_decodes=n, logits_indices=torch.arange(n, device=self.device))

    @torch.inference_mode()
    def forward_logits(self, scheduled) -> tuple[torch.Tensor, list[tuple]]:
        """Run the model over a step: the last-token logits of each sequence that samples ([S, V], in the
        model's dtype; the sampler takes a float32 copy where it needs one; with CUDA graphs it may be a
        view of the graph's output buffer, valid until the next step), and the prompt logprobs the step
        scored: [(sequence, its ``Scored`` entries in position order)]."""
        batch, scoring = self.prepare(scheduled)
        if self.tp_size > 1:  # every rank runs the same batch
            parallel.broadcast(("step", batch))
        if self.graphs is not None and not batch.num_prompt_rows and self.mtp is None:
            logits = self.graphs.run(batch)  # all rows of a decode batch; None when no graph fits
            if logits is not None:
                sampling = [i for i, s in enumerate(scheduled) if s.samples]
                if len(sampling) != len(scheduled):
                    logits = logits[torch.tensor(sampling, device=self.device)]
                return logits, []
        verifying = all(s.num_new_tokens == 1 or s.draft for s in scheduled)  # (decodes and verifications)
        hidden = self.cpu_decode.run(batch, self.kv_caches, verifying) if self.cpu_decode is not None else None
        if hidden is None:
            hidden = self.run_model(batch)
        if self.mtp is not None:  # the MTP head's pairs of every position computed
            self.mtp.write(batch, scheduled)
        if not scoring:
            return self._logits(hidden, 0), []
        scorer = PromptScorer([seq.token_ids[p + 1] for seq, rows in scoring for p in rows],
                              [seq.params.prompt_logprobs for seq, rows in scoring for _ in rows],
                              self.model_config.vocab_size, self.device)
        logits = self._logits(hidden, batch.num_prompt_rows, scorer)
        return logits, list(zip([seq for seq, _ in scoring], scorer.split([len(rows) for _, rows in scoring])))

    def _logits(self, hidden: torch.Tensor, num_prompt_rows: int, scorer: PromptScorer | None = None) -> torch.Tensor:
        """The logits of the sampling rows of ``hidden``; its last ``num_prompt_rows`` rows (prompt
        positions) have theirs made a slice at a time and handed to ``scorer``. Every tensor-parallel
        rank makes the same calls (each gathers the vocabulary shards)."""
        num_sampling = hidden.shape[0] - num_prompt_rows
        logits = self.model.compute_logits(hidden[:num_sampling])
        step = rows_per_slice(self.model_config.vocab_size)
        for start in range(0, num_prompt_rows, step):
            part = self.model.compute_logits(hidden[num_sampling + start:num_sampling + start + step])
            if scorer is not None:
                scorer(start, part)
        return logits

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """A rank > 0: run what rank 0 broadcasts (page and state copies, model steps) until it sends None."""
        while True:
            msg = parallel.broadcast(None)
            if msg is None:
                return
            if msg[0] == "copy":
                self.copy_pages(msg[1])
            elif msg[0] == "states":
                self.copy_states(msg[1])
            else:
                self._logits(self.run_model(msg[1]), msg[1].num_prompt_rows)

    def check_workers(self) -> None:
        """Raise if another rank's process has exited (the model cannot run without it)."""
        for rank, proc in enumerate(self.workers, 1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode})")

    def close(self) -> None:
        """Stop the other ranks (rank 0, tensor parallelism); nothing to do otherwise."""
        if self.workers:
            try:
                parallel.broadcast(None)
            except Exception:
                pass
            for proc in self.workers:
                proc.join(timeout=10)
            self.workers = []

    @torch.inference_mode()
    def execute(self, sched_out, grammar: Future | None = None) -> tuple[SamplerOutput | None, list[tuple]]:
        """Run one scheduled step: (the sampled tokens, or None if no sequence samples; the prompt logprobs
        it scored, as ``forward_logits`` gives them). ``grammar``: a future of (token bitmask [sample rows,
        vocab / 32] int32, the constrained rows), awaited once the logits are computed (it is filled
        meanwhile), or None."""
        self.copy_pages(sched_out.page_copies)
        scheduled = sched_out.scheduled
        if not scheduled:
            return None, []
        if self.mtp is not None:  # the drafts the scheduler left to the MTP head
            self.mtp.draft(scheduled)
        drafting = [s for s in scheduled if s.draft]
        if self.hybrid:  # a hybrid's state before its drafts, kept in a spare row (as many as drafting)
            self.copy_states([(s.seq.state_slot, row) for s, row in zip(drafting, self.states.spare_rows)])
        logits, scored = self.forward_logits(scheduled)
        self.copy_states(sched_out.state_copies)  # forked sequences take their parent's state as it now is
        if not sched_out.sample_rows:
            if self.mtp is not None:
                self.mtp.keep(scheduled, [], {})
            return None, scored
        # each sampling sequence has 1 + len(draft) rows of ``logits``, in scheduled order
        first_row = dict(zip((i for i, s in enumerate(scheduled) if s.samples),
                             itertools.accumulate((1 + len(s.draft) for s in scheduled if s.samples), initial=0)))
        rows, logits_rows = [], []
        for seq, i in sched_out.sample_rows:  # (forked children repeat their parent's row; none drafts then)
            draft = scheduled[i].draft
            rows += [SampleRow(seq, draft[:j], draft[j] if j < len(draft) else -1) for j in range(len(draft) + 1)]
            logits_rows += range(first_row[i], first_row[i] + len(draft) + 1)
        if logits_rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(logits_rows, device=self.device))
        out = accept_drafts(self._sample(logits, rows, grammar), [(seq, scheduled[i].draft)
                                                                   for seq, i in sched_out.sample_rows])
        by_seq = {seq: n for (seq, _), n in zip(sched_out.sample_rows, out.num_accepted)}
        restore = []
        for j, s in enumerate(drafting):
            rejected = len(s.draft) - by_seq[s.seq]
            if rejected and self.hybrid:  # its state goes back to before the chunk, which is computed again
                restore.append((self.states.spare_rows[j], s.seq.state_slot))
                s.num_rejected = s.num_new_tokens
            else:
                s.num_rejected = rejected
        self.copy_states(restore)
        if self.mtp is not None:
            self.mtp.keep(scheduled, sched_out.sample_rows, by_seq)
        return out, scored

    def _sampling_metadata(self, rows: list[SampleRow]) -> SamplingMetadata:
        # the token lists only where a row needs them (penalties; min_tokens counts outputs): copying
        # every prompt each step would cost O(context) per token
        penalties = any(r.seq.params.uses_penalties for r in rows)
        counts = penalties or any(r.seq.params.min_tokens for r in rows)
        drafts = [r.draft for r in rows]
        return SamplingMetadata.build(
            [r.seq.params for r in rows], [r.seq.generator for r in rows],
            [r.seq.token_ids[:r.seq.prompt_len] if penalties else [] for r in rows],
            [r.seq.output_token_ids + r.ahead if counts else [] for r in rows], self.model_config.vocab_size,
            self.device, drafts=drafts if any(d >= 0 for d in drafts) else None)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow], grammar: Future | None) -> SamplerOutput:
        """The step's tokens, one per row of ``logits``. A failure that belongs to rows rather than to the
        step (their parameters, a grammar's bitmask, the draw) does not end the step: the rows are sampled
        again one by one, and those that fail alone come back in ``errors`` (their requests end with that
        error, the core goes on); the other rows' tokens stand."""
        try:
            meta = self._sampling_metadata(rows)
            if grammar is not None:
                bitmask, meta.grammar_rows = grammar.result()
                meta.grammar_bitmask = bitmask.to(self.device, non_blocking=True)
            return self.sampler(logits, meta)
        except Exception:
            log.exception("sampling a step of %d rows failed: sampling them one by one", len(rows))
        out = SamplerOutput([], [])
        for row, each in enumerate(rows):
            try:
                meta = self._sampling_metadata([each])
                bitmask = each.seq.grammar.next_token_bitmask(self.model_config.vocab_size, each.ahead) \
                    if each.seq.grammar is not None else None
                if bitmask is not None:
                    meta.grammar_bitmask, meta.grammar_rows = bitmask.to(self.device), [0]
                one = self.sampler(logits[row:row + 1], meta)
                out.token_ids += one.token_ids
                out.logprobs += one.logprobs
            except Exception as e:
                out.token_ids.append(NO_TOKEN)
                out.logprobs.append(None)
                out.errors[row] = f"sampling its token failed: {type(e).__name__}: {e}"
        return out


def worker_main(config, model_config, path: str, rank: int, address: str, parent_pid: int) -> None:
    """A tensor-parallel rank > 0: build its runner (joining the group, loading its shard), then run the steps
    rank 0 broadcasts until it says stop or goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config.torch_device.type == "cuda":
        torch.cuda.set_device(parallel.local_rank(rank))
    runner = ModelRunner(config, model_config, path, rank=rank, address=address)
    try:
        runner.serve_steps()
    except Exception as e:  # rank 0 went away (its socket closed): nothing left to serve
        log.info("tensor-parallel rank %d stops: %s", rank, e)
    raise SystemExit(0)
