"""ModelRunner: owns everything on the device (weights, the KV pool) and runs one step of the model."""

from __future__ import annotations

import ctypes
import logging

import torch

from mili.cache.page_pool import PagePool
from mili.config import EngineConfig, ModelConfig, default_kv_cache_bytes
from mili.errors import InvalidRequest
from mili.model.cpu_linear import prepack_available, swap_linears
from mili.model.loader import load_weights
from mili.model.qwen3 import Qwen3ForCausalLM
from mili.runtime.attention.base import ForwardBatch
from mili.runtime.attention.torch_backend import TorchAttentionBackend
from mili.runtime.sampler import Sampler, SamplerOutput, SamplingMetadata

log = logging.getLogger("mili")


def release_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse; give it back (a no-op where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: str):
        self.config, self.model_config = config, model_config
        self.device = config.torch_device
        self.dtype = config.torch_dtype(model_config)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(model_config, TorchAttentionBackend(), self.dtype)
        self.model = model.to_empty(device=self.device)
        load_weights(self.model, path)
        self.model.eval()
        if config.quantization == "int8":
            swap_linears(self.model, "int8")
        elif self.device.type == "cpu" and config.cpu_weight_prepack and prepack_available(self.dtype):
            swap_linears(self.model, "packed")
        if self.device.type == "cpu":
            release_freed_memory()  # the plain weights a swap replaced go back to the OS
        self.max_model_len = config.resolve_max_model_len(model_config)
        self._allocate_kv_cache()
        self.model.init_rotary(self.max_model_len, self.device)
        self.sampler = Sampler()

    def _allocate_kv_cache(self) -> None:
        cfg, page_size = self.model_config, self.config.page_size
        bytes_per_page = (2 * cfg.num_hidden_layers * page_size * cfg.num_key_value_heads * cfg.head_dim
                          * self.dtype.itemsize)
        budget = self.config.kv_cache_memory or default_kv_cache_bytes()
        pages_per_seq = -(-self.max_model_len // page_size)
        num_pages = min(budget // bytes_per_page, pages_per_seq * self.config.max_num_seqs)
        if num_pages < 1:
            raise InvalidRequest(f"kv_cache_memory {budget} bytes is less than one page "
                                 f"({bytes_per_page} bytes)", param="kv_cache_memory")
        capacity = num_pages * page_size
        if capacity < self.max_model_len:
            if self.config.max_model_len is not None:
                raise InvalidRequest(
                    f"the KV cache ({budget} bytes) holds {capacity} tokens, fewer than max_model_len "
                    f"{self.max_model_len}: raise kv_cache_memory or lower max_model_len", param="max_model_len")
            log.warning("max_model_len lowered from %d to %d, what the KV cache holds", self.max_model_len, capacity)
            self.max_model_len = capacity
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]
        self.pool = PagePool(num_pages, page_size)
        log.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, page_size,
                 num_pages * bytes_per_page / 2**20)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def prepare(self, scheduled) -> ForwardBatch:
        """Batch tensors for a list of ``ScheduledSeq`` (decodes first), built once per step."""
        page_size = self.config.page_size
        input_ids, positions, query_lens, context_lens, logits_indices = [], [], [], [], []
        num_decodes = 0
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            query_lens.append(n)
            context_lens.append(start + n)
            num_decodes += n == 1
            if s.samples:  # logits only where a token is sampled
                logits_indices.append(len(input_ids) - 1)
        max_pages = max(len(s.seq.page_table) for s in scheduled)
        table = [s.seq.page_table + [0] * (max_pages - len(s.seq.page_table)) for s in scheduled]
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long)
        page_table = torch.tensor(table, dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(query_lens))
        slots = page_table[seq_of_token, pos // page_size] * page_size + pos % page_size
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=pos.to(dev), slot_mapping=slots.to(dev), page_table=page_table.to(dev),
            query_lens=query_lens, context_lens=context_lens, num_decodes=num_decodes,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def forward_logits(self, scheduled) -> torch.Tensor:
        """Run the model over a step; the last-token logits of each sequence that samples: [S, V]."""
        batch = self.prepare(scheduled)
        hidden = self.model(batch, self.kv_caches)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def execute(self, sched_out) -> SamplerOutput | None:
        self.copy_pages(sched_out.page_copies)
        if not sched_out.scheduled:
            return None
        logits = self.forward_logits(sched_out.scheduled)
        if not sched_out.sample_rows:
            return None
        seqs = [seq for seq, _ in sched_out.sample_rows]
        # scheduled index -> row of ``logits`` (which holds only the sampling sequences)
        logits_row = {i: r for r, i in enumerate(i for i, s in enumerate(sched_out.scheduled) if s.samples)}
        rows = [logits_row[i] for _, i in sched_out.sample_rows]
        if rows != list(range(logits.shape[0])):  # forked children repeat their parent's row
            logits = logits.index_select(0, torch.tensor(rows, device=self.device))
        meta = SamplingMetadata.build(
            [s.params for s in seqs], [s.generator for s in seqs],
            [s.token_ids[:s.prompt_len] for s in seqs], [s.output_token_ids for s in seqs],
            self.model_config.vocab_size, self.device)
        return self.sampler(logits, meta)
