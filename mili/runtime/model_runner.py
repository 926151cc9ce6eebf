"""ModelRunner: runs one step of the model on the device, as the execution plan says (``plan.py``): it builds the
model (``model_builder.py``) and its caches (``memory.py``), turns the scheduler's step into a batch
(``input_batch.py``), runs it (CUDA graphs, the C decode layer, or eagerly), samples, and verifies drafts
(``mili/speculative/verify.py``). With tensor parallelism, rank 0's runner starts the other ranks and broadcasts
its steps to them."""

from __future__ import annotations

import logging
import signal
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mili.config import EngineConfig, ModelConfig
from mili.host_copy import tensor_on
from mili.process import die_with_parent
from mili.runtime import parallel
from mili.runtime.encoder_cache import EncoderCache, VisionBudget
from mili.runtime.input_batch import InputBatchBuilder
from mili.runtime.memory import CacheMemory
from mili.runtime.model_builder import attention_and_ops, build_model
from mili.runtime.plan import DeviceInfo, ExecutionPlan, LoRAKernel, plan
from mili.runtime.pooler import pool
from mili.runtime.prompt_logprobs import PromptScorer, rows_per_slice
from mili.runtime.sampler import DRAWS, PendingSample, Sampler
from mili.runtime.sampling import sample_step
from mili.speculative.mtp import MtpDrafter
from mili.speculative.verify import (
    StepTokens,
    accept_drafts,
    rejected_positions,
    verification_rows,
)

log = logging.getLogger("mili")


@dataclass
class StepResult:
    """What a step gives back to the engine core: the sampled tokens (None if no sequence samples), the prompt
    logprobs it scored (``forward_logits``), per sequence that verified drafts, the positions of the step that stay
    uncomputed (``rejected_positions``), which the scheduler accounts, and the answers of pooling requests
    (``pooler.py``)."""

    tokens: StepTokens | None = None
    scored: list[tuple] = field(default_factory=list)
    num_rejected: dict = field(default_factory=dict)
    pooled: dict = field(default_factory=dict)  # pooling requests whose prompt completed: sequence -> its answer
    # a deferred step (``execute(defer=True)``): the draw, still on the device; ``tokens`` once it is read
    pending: PendingSample | None = None

    def resolve(self, sample_rows: list) -> StepTokens | None:
        """The step's tokens on the host: waits for a deferred draw (a step without drafts)."""
        if self.tokens is None and self.pending is not None:
            self.tokens = accept_drafts(self.pending.result(), [(seq, []) for seq, _ in sample_rows])
        return self.tokens


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: str, rank: int = 0,
                 address: str | None = None, execution_plan: ExecutionPlan | None = None):
        """``execution_plan``: rank 0's (the engine core's); made here where not given (the other ranks, each for
        its own device). ``rank``/``address``: tensor parallelism: rank 0 starts the other ranks' processes on
        this node; each runner then holds its rank's shard of the weights and KV."""
        self.tp_size, self.rank, self.workers = config.tensor_parallel_size, rank, []
        device = config.torch_device
        if self.tp_size > 1:
            shard = model_config.shard(rank, self.tp_size)  # one that cannot be split fails before anything starts
            if rank == 0 and parallel.torchrun_rank() is not None:
                address = "env://"  # the other ranks are torchrun's processes
            elif rank == 0:
                self.workers, address = parallel.start_workers(worker_main, config, model_config, path)
            device = parallel.rank_device(device, rank)
            parallel.init_group(rank, self.tp_size, address, device)
            model_config = shard
        self.plan = execution_plan or plan(config, model_config, DeviceInfo.probe(device, config.cpu_kernels))
        config = self.plan.resolve(config)  # (a torchrun rank > 0 comes with auto batch limits: its plan sizes them)
        if self.plan.num_threads:
            torch.set_num_threads(self.plan.num_threads)
        self.config, self.model_config, self.device, self.dtype = config, model_config, device, self.plan.dtype
        self.hybrid = model_config.is_hybrid
        max_pages = -(-self.plan.max_model_len // config.page_size)
        self.attention, ops = attention_and_ops(self.plan, max_pages)
        self.model = build_model(self.plan, model_config, path, device, self.attention, ops)
        self.loras = None  # LoRA adapters (mili/lora.py): their slots beside each projection, on the plan's kernel
        if self.plan.lora is not None:
            from mili.lora import LoRASlots, add_lora_layers

            step = add_lora_layers(self.model, config.max_loras, config.max_lora_rank, self.plan.dtype, device,
                                   kernels=self.plan.lora is LoRAKernel.CPU, triton=self.plan.lora is LoRAKernel.TRITON)
            self.loras = LoRASlots(self.model, step, config.max_loras, config.max_lora_rank,
                                   config.max_cpu_loras or config.max_loras)
        self.vision_budget = self.encoder_cache = None  # the tower's memory plan and its outputs by image
        if self.plan.vision:
            self.vision_budget = VisionBudget.plan(config, model_config, path, self.dtype, self.plan.max_model_len)
            self.encoder_cache = EncoderCache(self.vision_budget.cache_tokens)
            log.info("vision tower: %s", self.vision_budget.describe())
        self.memory = CacheMemory(self.plan, config, model_config, self.model, self.attention, device,
                                  self.vision_budget, self.tp_size)  # (may lower max_model_len to what it holds)
        self.max_model_len, self.kv_caches, self.states = (self.memory.max_model_len, self.memory.kv_caches,
                                                           self.memory.states)
        self.layout = self.memory.layout  # (the engine core makes its page, slot and snapshot pools from it)
        self.batches = InputBatchBuilder(device, config.page_size, self.hybrid, self.plan.attention == "triton",
                                         self.model, self.encoder_cache,
                                         self.vision_budget.tokens_per_call if self.vision_budget else 0,
                                         self.plan.batch.max_num_seqs, self.memory.max_pages_per_seq)
        self.mtp = MtpDrafter(self.model, self.kv_caches[-1], self.batches.one_token_batch) \
            if self.plan.speculative == "mtp" else None  # (its KV: the pool's last layer)
        self.model.init_rotary(self.max_model_len, device)
        if hasattr(self.attention, "max_pages_per_seq"):
            self.attention.max_pages_per_seq = self.memory.max_pages_per_seq
            if self.plan.step == "cuda-graphs":
                self.attention.graph_sizes = self.plan.batch.graph_sizes
        self.sampler = Sampler(draw=DRAWS[self.plan.draw])
        if self.plan.device.cpu_kernels:  # MILI's CPU kernels: the bitmask (float32 logits: any model dtype)
            from mili.kernels.cpu import ops as cpu_ops

            self.sampler.apply_bitmask = cpu_ops.apply_bitmask
            if self.plan.cpu_kernels:  # and the argmax, reading bf16 logits in place
                self.sampler.argmax = cpu_ops.argmax
        self.graphs = self.cpu_decode = None  # a decode step as CUDA graphs, or as one C call per layer
        if self.plan.step == "cuda-graphs":
            from mili.runtime.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(self)
        elif self.plan.step == "cpu-decode":
            from mili.runtime.cpu_decode import CpuDecodeRunner

            self.cpu_decode = CpuDecodeRunner(self.model)
            if not self.cpu_decode.available:  # (the plan's checks missed a case: run it eagerly, and say so)
                log.warning("fused CPU decode off, though planned (%s)", self.cpu_decode.why_not)
                self.cpu_decode = None
        elif self.plan.step_why:
            log.info("decode steps: eager (%s)", self.plan.step_why)

    # what the engine core, /health and the tools read
    weight_format = property(lambda self: self.plan.weight_format)
    kv_cache_dtype = property(lambda self: self.plan.kv_dtype_name)
    kv_dtype = property(lambda self: self.plan.kv_dtype)
    cpu_kernels = property(lambda self: self.plan.cpu_kernels)
    max_pages_per_seq = property(lambda self: self.memory.max_pages_per_seq)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            if self.tp_size > 1 and self.rank == 0:
                parallel.broadcast(("copy", copies))
            self.memory.copy_pages(copies)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy recurrent states row to row: forks (slot to slot), prefix-cache snapshots (slot to snapshot and back);
        rank 0 sends them to the other tensor-parallel ranks (each copies its heads' states)."""
        if self.states is not None:
            if copies and self.tp_size > 1 and self.rank == 0:
                parallel.broadcast(("states", copies))
            self.states.copy(copies)

    def run_model(self, batch) -> torch.Tensor:
        """The model over one batch, with its caches: KV pages (and, for a hybrid, the recurrent states)."""
        if self.hybrid:
            return self.model(batch, self.kv_caches, self.states.caches)
        return self.model(batch, self.kv_caches)

    @torch.inference_mode()
    def forward_logits(self, scheduled, feed=None) -> tuple[torch.Tensor, list[tuple], dict]:
        """Run the model over a step: the last-token logits of each sequence that samples ([S, V], in the
        model's dtype; the sampler takes a float32 copy where it needs one; with CUDA graphs it may be a
        view of the graph's output buffer, valid until the next step), the prompt logprobs the step
        scored: [(sequence, its ``Scored`` entries in position order)], and the pooling requests' answers
        {sequence: [floats]}. ``feed``: the input ids still on the device (``InputBatchBuilder.prepare``)."""
        batch, scoring = self.batches.prepare(scheduled, feed)
        if self.loras is not None:  # each token row's adapter, in the model's slots
            self.loras.prepare([s.seq.request.lora_id for s in scheduled for _ in range(s.num_new_tokens)],
                               self.device)
        if self.tp_size > 1:  # every rank runs the same batch
            parallel.broadcast(("step", batch))
        if self.graphs is not None and not batch.num_prompt_rows and not batch.num_pool_rows and self.mtp is None:
            logits = self.graphs.run(batch)  # all rows of a decode batch; None when no graph fits
            if logits is not None:
                sampling = [i for i, s in enumerate(scheduled) if s.samples]
                if len(sampling) != len(scheduled):
                    logits = logits[tensor_on(sampling, self.device)]
                return logits, [], {}
            hidden = self.graphs.mixed.run(batch)  # a mixed step: its logits rows' hidden states, or None
            if hidden is not None:
                return self.model.compute_logits(hidden), [], {}
        verifying = all(s.num_new_tokens == 1 or s.draft for s in scheduled)  # (decodes and verifications)
        hidden = self.cpu_decode.run(batch, self.kv_caches, verifying) if self.cpu_decode is not None else None
        if hidden is None:
            hidden = self.run_model(batch)
        if self.mtp is not None:  # the MTP head's pairs of every position computed
            self.mtp.write(batch, scheduled)
        scorer = None
        if scoring:
            scorer = PromptScorer([seq.token_ids[p + 1] for seq, rows in scoring for p in rows],
                                  [seq.params.prompt_logprobs for seq, rows in scoring for _ in rows],
                                  self.model_config.vocab_size, self.device)
        logits, pooled = self._logits(hidden, batch, scorer)
        pooled = dict(zip([s.seq for s in scheduled if s.pools], pooled))
        if not scoring:
            return logits, [], pooled
        return logits, list(zip([seq for seq, _ in scoring], scorer.split([len(rows) for _, rows in scoring]))), pooled

    def _logits(self, hidden: torch.Tensor, batch, scorer: PromptScorer | None = None) -> tuple[torch.Tensor, list]:
        """The logits of the sampling rows of ``hidden``, and the answers of its pooling rows (``pooler.py``); its
        last ``num_prompt_rows`` rows (prompt positions) have theirs made a slice at a time and handed to
        ``scorer``. Every tensor-parallel rank makes the same calls (each gathers the vocabulary shards)."""
        num_prompt_rows, num_pool_rows = batch.num_prompt_rows, batch.num_pool_rows
        num_sampling = hidden.shape[0] - num_prompt_rows - num_pool_rows
        logits = self.model.compute_logits(hidden[:num_sampling])
        pooled = pool(self.model, hidden[num_sampling:num_sampling + num_pool_rows], batch.pooling) \
            if num_pool_rows else []
        first = num_sampling + num_pool_rows
        step = rows_per_slice(self.model_config.vocab_size)
        for start in range(0, num_prompt_rows, step):
            part = self.model.compute_logits(hidden[first + start:first + start + step])
            if scorer is not None:
                scorer(start, part)
        return logits, pooled

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
                self._logits(self.run_model(msg[1]), msg[1])

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
    def execute(self, sched_out, grammar: Future | None = None, feed=None, defer: bool = False) -> StepResult:
        """Run one scheduled step. ``grammar``: a future of (token bitmask [sample rows, vocab / 32] int32, the
        constrained rows), awaited once the logits are computed (it is filled meanwhile), or None.

        Scheduling ahead of the device (the engine core's overlap): ``feed`` is the previous step's draw still on
        the device, (ids [rows], {sequence: its row}), giving those sequences' last input token, and ``defer``
        leaves this step's draw there (``StepResult.pending``; ``resolve`` reads it). A deferred step has no
        drafts (the core overlaps only steps that need no token on the host)."""
        self.copy_pages(sched_out.page_copies)
        scheduled = sched_out.scheduled
        if not scheduled:
            return StepResult()
        if self.mtp is not None:  # the drafts the scheduler left to the MTP head
            self.mtp.draft(scheduled)
        drafting = [s for s in scheduled if s.draft]
        if self.hybrid:  # a hybrid's state before its drafts, kept in a spare row (as many as drafting)
            self.copy_states([(s.seq.state_slot, row) for s, row in zip(drafting, self.states.spare_rows)])
        logits, scored, pooled = self.forward_logits(scheduled, feed)
        self.copy_states(sched_out.state_copies)  # forked sequences take their parent's state as it now is
        if not sched_out.sample_rows:
            if self.mtp is not None:
                self.mtp.keep(scheduled, [], {}, {})
            return StepResult(None, scored, pooled=pooled)
        rows, logits_rows = verification_rows(scheduled, sched_out.sample_rows)
        if logits_rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, tensor_on(logits_rows, self.device))
        sampled = sample_step(self.sampler, logits, rows, grammar, self.model_config.vocab_size, self.device, defer)
        if defer:
            return StepResult(None, scored, pooled=pooled, pending=sampled)
        tokens = accept_drafts(sampled, [(seq, scheduled[i].draft) for seq, i in sched_out.sample_rows])
        by_seq = {seq: n for (seq, _), n in zip(sched_out.sample_rows, tokens.num_accepted)}
        rejected = rejected_positions(drafting, by_seq, self.hybrid)
        if self.hybrid:  # a state that took rejected drafts goes back to before the chunk, computed again
            self.copy_states([(row, s.seq.state_slot) for s, row in zip(drafting, self.states.spare_rows)
                              if rejected.get(s.seq)])
        if self.mtp is not None:
            self.mtp.keep(scheduled, sched_out.sample_rows, by_seq, rejected)
        return StepResult(tokens, scored, rejected, pooled)


def worker_main(config, model_config, path: str, rank: int, address: str, parent_pid: int) -> None:
    """A tensor-parallel rank > 0: build its runner (joining the group, loading its shard), then run the steps
    rank 0 broadcasts until it says stop or goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parallel.use_rank_device(config.torch_device, rank)
    runner = ModelRunner(config, model_config, path, rank=rank, address=address)
    try:
        runner.serve_steps()
    except Exception as e:  # rank 0 went away (its socket closed): nothing left to serve
        log.info("tensor-parallel rank %d stops: %s", rank, e)
    raise SystemExit(0)
