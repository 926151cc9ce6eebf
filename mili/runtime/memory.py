"""The memory planner: sizes and makes the KV pages and (hybrids) the recurrent-state rows by the plan's
``MemoryPlan``, once the weights are in, and says what it made in a ``CacheLayout``: the engine core makes the
pools that hand them out from it (``PagePool``, ``StatePool``, ``SnapshotPool``), and its scheduler and prefix cache
own them.

The budget: ``kv_cache_memory``, or the CPU's default, or on CUDA ``gpu_memory_utilization`` of the card less the
weights and a profiled activation peak (a full-budget prefill, the sampler at a full batch, a slice of prompt
logprobs, the vision tower's reserve). A hybrid's states come out of it first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mili import host_memory
from mili.config import EngineConfig, ModelConfig
from mili.errors import InvalidRequest
from mili.host_copy import tensor_on
from mili.kernels.cpu.ops import Int8Pages
from mili.model.batch import ForwardBatch
from mili.runtime.attention.torch_backend import TorchAttentionBackend
from mili.runtime.plan import ExecutionPlan
from mili.runtime.prompt_logprobs import rows_per_slice
from mili.runtime.recurrent_state import RecurrentStateCache

log = logging.getLogger("mili")


@dataclass(frozen=True)
class CacheLayout:
    """What the memory planner made, for the engine core's pools: KV pages ids 0 .. num_pages - 1, and (hybrids)
    recurrent-state rows: slots 0 .. num_state_slots - 1, then the prefix cache's snapshots."""

    num_pages: int
    page_size: int
    max_model_len: int
    num_state_slots: int = 0
    num_snapshots: int = 0
    num_spare_rows: int = 0  # speculative decoding's (the runner's own: a drafting sequence's state before a step)
    state_bytes: int = 0
    bytes_per_state_slot: int = 0


class CacheMemory:
    """The KV pages ``kv_caches`` (a (K, V) pair a layer, MTP's last), the recurrent states (``states``: their
    tensors) and ``max_model_len`` (lowered to what the pages hold where none was asked); ``layout`` says how many
    of each there are."""

    def __init__(self, plan: ExecutionPlan, config: EngineConfig, model_config: ModelConfig, model,
                 attention, device: torch.device, vision_budget=None, tp_size: int = 1):
        self.plan, self.config, self.model_config, self.model = plan, config, model_config, model
        self.device, self.kv_dtype, self.vision_budget = device, plan.kv_dtype, vision_budget
        self.max_model_len = plan.max_model_len
        self.states: RecurrentStateCache | None = None
        cfg, page_size = model_config, config.page_size
        num_layers = cfg.num_attention_layers + (getattr(model, "mtp", None) is not None)  # (MTP: one more)
        # a token's one kv head: D values (int8 pages: D bytes and a float32 scale)
        row_bytes = Int8Pages.row_bytes(cfg.head_dim) if self.int8_pages else cfg.head_dim * self.kv_dtype.itemsize
        bytes_per_page = 2 * num_layers * page_size * cfg.num_key_value_heads * row_bytes
        state_bytes = self._allocate_states() if model_config.is_hybrid else 0
        if plan.memory.num_kv_pages is not None:  # sized exactly, as asked
            num_pages = plan.memory.num_kv_pages
            budget = num_pages * bytes_per_page
        else:
            budget = self._kv_budget(bytes_per_page) - state_bytes
            num_pages = min(budget // bytes_per_page, self.max_pages_per_seq * plan.batch.max_num_seqs)
        if tp_size > 1:  # every rank holds the same pages (its own KV heads of them)
            agreed = torch.tensor([num_pages], dtype=torch.long)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            num_pages = int(agreed)
        if num_pages < 1:
            raise InvalidRequest(f"the KV cache budget ({budget} bytes) is less than one page "
                                 f"({bytes_per_page} bytes)", param="kv_cache_memory")
        capacity = num_pages * page_size
        if capacity < self.max_model_len:
            if config.max_model_len is not None:
                raise InvalidRequest(
                    f"the KV cache ({budget} bytes) holds {capacity} tokens, fewer than max_model_len "
                    f"{self.max_model_len}: raise kv_cache_memory or lower max_model_len", param="max_model_len")
            log.warning("max_model_len lowered from %d to %d, what the KV cache holds", self.max_model_len, capacity)
            self.max_model_len = capacity
        if vision_budget is not None and plan.memory.host_memory:  # (before the pool takes its memory)
            vision_budget.check_host_memory(num_pages * bytes_per_page)
        shape_of = getattr(attention, "kv_cache_shape", TorchAttentionBackend.kv_cache_shape)
        shape = shape_of(num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(self._pages(shape), self._pages(shape, v=True)) for _ in range(num_layers)]
        states = self.states
        self.layout = CacheLayout(num_pages, page_size, self.max_model_len,
                                  states.num_slots if states else 0, states.num_snapshots if states else 0,
                                  len(states.spare_rows) if states else 0, states.num_bytes if states else 0,
                                  states.bytes_per_slot if states else 0)
        log.info("KV cache: %d pages of %d tokens (%.1f MiB, %s)", num_pages, page_size,
                 num_pages * bytes_per_page / 2**20, plan.kv_dtype_name)

    @property
    def int8_pages(self) -> bool:
        """--kv-cache-dtype int8 (MILI's CPU kernels): each layer's K and V are ``Int8Pages``."""
        return self.kv_dtype == torch.int8

    def _pages(self, shape: tuple[int, ...], v: bool = False) -> torch.Tensor | Int8Pages:
        if self.int8_pages:  # (K's and V's layouts differ: v says which)
            return Int8Pages.zeros(shape, self.device, v)
        return host_memory.zeros(shape, self.kv_dtype, self.device)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.config.page_size)

    def _allocate_states(self) -> int:
        """The recurrent-state slots, the prefix cache's snapshots and the spare rows (``MemoryPlan.states``);
        returns their bytes (taken from the KV budget)."""
        per_slot = RecurrentStateCache.slot_bytes(self.model_config, self.plan.dtype)
        memory = self.plan.memory
        slots, snapshots, spare = memory.states(memory.budget or self._state_sizing_budget(), per_slot)
        self.states = RecurrentStateCache(self.model_config, self.plan.dtype, self.device, slots, snapshots,
                                          scratch=memory.scratch_state_row, num_spare=spare)
        return self.states.num_bytes

    def _state_sizing_budget(self) -> int:
        """CUDA without kv_cache_memory: the states are sized from gpu_memory_utilization of the card less what
        is allocated (the weights); the KV pages get what is left after the profiled activation peak."""
        _, total = torch.cuda.mem_get_info(self.device)
        return max(int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device), 0)

    def _kv_budget(self, bytes_per_page: int) -> int:
        if self.plan.memory.budget is not None:
            return self.plan.memory.budget
        # CUDA: gpu_memory_utilization of the card, less the weights and a profiled activation peak
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self._profile_activation_peak()
        peak += self.vision_budget.reserve_bytes if self.vision_budget is not None else 0  # the tower and its cache
        budget = int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device) - peak
        log.info("GPU memory: %.1f GiB total, %.1f GiB free after weights, activation peak %.2f GiB, KV budget "
                 "%.1f GiB", total / 2**30, free / 2**30, peak / 2**30, budget / 2**30)
        return max(budget, 0)

    @torch.inference_mode()
    def _profile_activation_peak(self) -> int:
        """Peak memory of a full-budget prefill (max_num_batched_tokens) above the weights."""
        self.model.init_rotary(self.max_model_len, self.device)  # rebuilt once the pool fixes the length
        tokens = min(self.plan.batch.max_num_batched_tokens, self.max_model_len)
        pages = -(-tokens // self.config.page_size)
        cfg, dev = self.model_config, self.device
        shape = (pages, self.config.page_size, cfg.num_key_value_heads, cfg.head_dim)
        kv = [(torch.zeros(shape, dtype=self.kv_dtype, device=dev), torch.zeros(shape, dtype=self.kv_dtype, device=dev))
              for _ in range(cfg.num_hidden_layers)]
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        i32 = dict(dtype=torch.int32, device=dev)
        batch = ForwardBatch(
            input_ids=torch.zeros(tokens, dtype=torch.long, device=dev),
            positions=torch.arange(tokens, device=dev), slot_mapping=torch.arange(tokens, device=dev),
            page_table=torch.arange(pages, device=dev)[None], query_lens=[tokens], context_lens=[tokens],
            num_decodes=int(tokens == 1), logits_indices=torch.tensor([tokens - 1], device=dev),
            context_lens_t=torch.tensor([tokens], **i32), query_lens_t=torch.tensor([tokens], **i32),
            query_start_t=torch.tensor([0], **i32), state_slots=[0] if self.states is not None else None)
        states = (self.states.caches,) if self.states is not None else ()  # (a hybrid's are allocated by now)
        self.model.compute_logits(self.model(batch, kv, *states))
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        del kv
        torch.cuda.empty_cache()
        # the sampler at a full batch: float32 logits, a sorted copy with int64 indices, probabilities
        sampler = self.plan.batch.max_num_seqs * cfg.vocab_size * 4 * 5
        # a slice of prompt logprobs: its logits, a float32 copy, their log-softmax, a comparison mask
        prompt_slice = rows_per_slice(cfg.vocab_size) * cfg.vocab_size * 11
        return peak + sampler + prompt_slice

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV pages (copy-on-write of a shared partial page), byte for byte (FP8 pages too; int8 pages with
        their scales)."""
        src = tensor_on([s for s, _ in copies], self.device)
        dst = tensor_on([d for _, d in copies], self.device)
        for k_cache, v_cache in self.kv_caches:
            for pages in (k_cache, v_cache):
                for tensor in pages.tensors if isinstance(pages, Int8Pages) else (pages,):
                    cache = tensor.view(torch.uint8)
                    cache[dst] = cache[src]
