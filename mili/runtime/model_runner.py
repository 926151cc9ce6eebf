"""ModelRunner: runs one step of the model on the device, as the execution plan says (``plan.py``). What it runs on
is built by the model builder (``build_runner_parts``: the model, its caches, the batch builder, the sampler, the
drafter, the step's CUDA graphs or C decode layer) and read through ``parts``; the runner turns the scheduler's step
into a batch (``input_batch.py``), runs it (CUDA graphs, the C decode layer, or eagerly), scores prompt logprobs
(``prompt_logprobs.py``), samples and verifies drafts (``mili/speculative/verify.py``). With tensor parallelism it
is one rank of a group (``parallel.TensorParallelGroup``): rank 0's starts the other ranks and sends them its steps."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from mili.config import EngineConfig, ModelConfig
from mili.host_copy import tensor_on
from mili.runtime.model_builder import RunnerParts, build_runner_parts, on_kernels
from mili.runtime.parallel import TensorParallelGroup
from mili.runtime.plan import DeviceInfo, ExecutionPlan, plan
from mili.runtime.prompt_logprobs import prompt_scorer, scored_by_sequence, step_logits
from mili.speculative.verify import DraftedStep, StepResult


class ModelRunner:
    """Runs steps (``execute``); ``parts`` (read-only) describes what it runs on, and ``tp`` its tensor-parallel
    group."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: str, rank: int = 0,
                 address: str | None = None, execution_plan: ExecutionPlan | None = None):
        """``execution_plan``: rank 0's (the engine core's); made here where not given (the other ranks, each for
        its own device). ``rank``/``address``: tensor parallelism: rank 0 starts the other ranks' processes on
        this node; each runner then holds its rank's shard of the weights and KV."""
        self.tp, model_config, device = TensorParallelGroup.join(ModelRunner, config, model_config, path, rank,
                                                                 address)
        execution_plan = execution_plan or plan(config, model_config,
                                                DeviceInfo.probe(device, config.cpu_kernels, config.cpu_isa))
        # (a torchrun rank > 0 comes with auto batch limits: its plan sizes them)
        self.parts: RunnerParts = build_runner_parts(execution_plan, execution_plan.resolve(config), model_config,
                                                     path, device, self.tp.size)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV pages (copy-on-write forks); rank 0 sends them to the other tensor-parallel ranks."""
        if copies:
            self.tp.send(("copy", copies))
            self.parts.memory.copy_pages(copies)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy recurrent states row to row: forks (slot to slot), prefix-cache snapshots (slot to snapshot and back);
        rank 0 sends them to the other tensor-parallel ranks (each copies its heads' states)."""
        if self.parts.states is not None:
            if copies:
                self.tp.send(("states", copies))
            self.parts.states.copy(copies)

    @torch.inference_mode()
    def forward_logits(self, scheduled, feed=None) -> tuple[torch.Tensor, list[tuple], dict]:
        """Run the model over a step: the last-token logits of each sequence that samples ([S, V], in the
        model's dtype; the sampler takes a float32 copy where it needs one; with CUDA graphs it may be a
        view of the graph's output buffer, valid until the next step), the prompt logprobs the step
        scored: [(sequence, its ``Scored`` entries in position order)], and the pooling requests' answers
        {sequence: [floats]}. ``feed``: the input ids still on the device (``InputBatchBuilder.prepare``)."""
        p = self.parts
        batch, scoring = p.batches.prepare(scheduled, feed)
        if p.loras is not None:  # each token row's adapter, in the model's slots
            p.loras.prepare([s.seq.request.lora_id for s in scheduled for _ in range(s.num_new_tokens)], p.device)
        self.tp.send(("step", batch))  # every rank runs the same batch
        if p.graphs is not None and not batch.num_prompt_rows and not batch.num_pool_rows and p.mtp is None:
            logits = p.graphs.run(batch)  # all rows of a decode batch; None when no graph fits
            if logits is not None:
                sampling = [i for i, s in enumerate(scheduled) if s.samples]
                if len(sampling) != len(scheduled):
                    logits = logits[tensor_on(sampling, p.device)]
                return logits, [], {}
            hidden = p.graphs.mixed.run(batch)  # a mixed step: its logits rows' hidden states, or None
            if hidden is not None:
                return p.model.compute_logits(hidden), [], {}
        verifying = all(s.num_new_tokens == 1 or s.draft for s in scheduled)  # (decodes and verifications)
        hidden = p.cpu_decode.run(batch, p.kv_caches, verifying) if p.cpu_decode is not None else None
        if hidden is None:
            hidden = p.run_model(batch)
        if p.mtp is not None:  # the MTP head's pairs of every position computed
            p.mtp.write(batch, scheduled)
        scorer = prompt_scorer(scoring, p.model_config.vocab_size, p.device)
        logits, pooled = step_logits(p.model, hidden, batch, p.model_config.vocab_size, scorer)
        return logits, scored_by_sequence(scoring, scorer), dict(zip([s.seq for s in scheduled if s.pools], pooled))

    @torch.inference_mode()
    def execute(self, sched_out, grammar: Future | None = None, feed=None, defer: bool = False) -> StepResult:
        """Run one scheduled step. ``grammar``: a future of (token bitmask [sample rows, vocab / 32] int32, the
        constrained rows), awaited once the logits are computed (it is filled meanwhile), or None.

        Scheduling ahead of the device (the engine core's overlap): ``feed`` is the previous step's draw still on
        the device, (ids [rows], {sequence: its row}), giving those sequences' last input token, and ``defer``
        leaves this step's draw there (``StepResult.pending``; ``resolve`` reads it). A deferred step has no
        drafts (the core overlaps only steps that need no token on the host)."""
        self.copy_pages(sched_out.page_copies)
        scheduled, p = sched_out.scheduled, self.parts
        if not scheduled:
            return StepResult()
        with on_kernels(p.plan):  # (the plan's CPU kernels, whatever another engine in this process runs)
            drafts = DraftedStep(scheduled, p.mtp, p.hybrid, p.states, self.copy_states)
            logits, scored, pooled = self.forward_logits(scheduled, feed)
            self.copy_states(sched_out.state_copies)  # forked sequences take their parent's state as it now is
            return drafts.finish(sched_out.sample_rows, logits, scored, pooled, p.sampler, grammar,
                                 p.model_config.vocab_size, p.device, defer)

    def check_workers(self) -> None:
        """Raise if another tensor-parallel rank's process has exited (the model cannot run without it)."""
        self.tp.check_workers()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0); nothing to do otherwise."""
        self.tp.close()
