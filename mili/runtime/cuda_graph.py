"""CUDA graphs for decode steps: captured once per batch size of the plan's ladder (``BatchPlan.graph_sizes``: up to
min(max_num_seqs, 512)), replayed with the batch padded up to the nearest captured size; and for mixed steps
(prefill chunks, with or without decodes), one per token count of the plan's ladder (``MixedStepGraphs`` below).
A decode batch above the largest size, and a mixed step the mixed graphs do not take (more tokens, images, a
hybrid model, prompt logprobs), run eagerly.

Padding rows write nothing (slot -1, which the store kernel skips) and attend to one token of page 0,
so they never touch a real sequence's pages; their logits are dropped.

Hybrid models (Gated DeltaNet layers): each row's recurrent-state slot and whether it resumes its state (False
for a sequence's first token, which starts from zeros) are graph inputs too, static buffers the replay fills;
the state tensors are the runner's, static. Padding rows read and write the state pool's scratch row
(``RecurrentStateCache.scratch_row``), never a sequence's slot.
"""

from __future__ import annotations

import bisect
import logging

import torch

from mili.host_copy import tensor_on
from mili.model.batch import ForwardBatch
from mili.model.qwen3_5 import RecurrentBatch

log = logging.getLogger("mili")

def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``n`` sequences, or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class CudaGraphRunner:
    def __init__(self, runner):
        """``runner``: what the model runner runs on (``model_builder.RunnerParts``: the plan, the device, the model,
        its caches)."""
        self.runner = runner
        self.sizes = list(runner.plan.batch.graph_sizes)  # (the plan's ladder: up to min(max_num_seqs, 512))
        dev, top = runner.device, self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.page_table = torch.zeros(top, runner.max_pages_per_seq, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(top, **i32)
        self.query_lens = torch.ones(top, **i32)
        self.query_start = torch.arange(top, **i32)
        self.rows = torch.arange(top, device=dev)
        self.hybrid = getattr(runner, "hybrid", False)
        if self.hybrid:
            self.scratch_row = runner.states.scratch_row
            if self.scratch_row is None:
                raise ValueError("CUDA graphs for a hybrid model need the state pool's scratch row")
            self.state_slots = torch.full((top,), self.scratch_row, dtype=torch.long, device=dev)
            self.state_keep = torch.zeros(top, dtype=torch.bool, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.mixed = MixedStepGraphs(self, runner.plan.mixed_graph_sizes, runner.plan.batch.max_num_seqs)
        with torch.inference_mode():
            self.mixed.capture()  # (largest first: the smaller ones, and the decode graphs, reuse its memory)
            for bs in reversed(self.sizes):
                self.graphs[bs] = self._capture(self._batch(bs))
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def _capture(self, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(a graph of one forward over ``batch``, its logits buffer): the kernels compiled outside the
        capture, every graph in one memory pool. (The tests replace this with an eager stand-in.)"""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._forward(batch)
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(batch)
        return graph, logits

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], slot_mapping=self.slots[:bs],
            page_table=self.page_table[:bs], query_lens=[1] * bs, context_lens=[1] * bs, num_decodes=bs,
            logits_indices=self.rows[:bs], context_lens_t=self.context_lens[:bs],
            query_lens_t=self.query_lens[:bs], query_start_t=self.query_start[:bs])

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of a decode batch's rows; the final hidden states of a mixed step's logits rows."""
        model = self.runner.model
        if batch.varlen:
            return model(batch, self.runner.kv_caches)
        if self.hybrid:  # the states' slots from the static buffers, not from the batch's (capture-time) lists
            bs = batch.num_seqs
            rb = RecurrentBatch(self.state_slots[:bs], self.state_keep[:bs], [])
            return model.compute_logits(model(batch, self.runner.kv_caches, self.runner.states.caches, rb))
        return model.compute_logits(model(batch, self.runner.kv_caches))

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits of every row of an all-decode ``batch``, by replaying a graph; None if none fits."""
        n = batch.num_seqs
        bs = padded_batch_size(n, self.sizes)
        if batch.num_decodes != n or bs is None:
            return None
        width = batch.page_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.slots[n:bs].fill_(-1)
        self.page_table[:n, :width].copy_(batch.page_table)
        self.page_table[n:bs].zero_()
        self.context_lens[:n].copy_(batch.context_lens_t)
        self.context_lens[n:bs].fill_(1)
        self.positions[n:bs].zero_()
        if self.hybrid:
            fresh = [c == q for c, q in zip(batch.context_lens, batch.query_lens)]
            self.state_slots[:n].copy_(tensor_on(batch.state_slots, self.runner.device))
            self.state_slots[n:bs].fill_(self.scratch_row)
            self.state_keep[:n].copy_(tensor_on([not f for f in fresh], self.runner.device, torch.bool))
            self.state_keep[n:bs].fill_(False)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:n]


class MixedStepGraphs:
    """CUDA graphs of mixed steps (prefill chunks, with or without decodes): one per token count of the plan's
    ladder (``ExecutionPlan.mixed_graph_sizes``), over ``max_num_seqs`` sequence rows, replayed with the step padded
    up to the nearest count. Attention is the one kernel over decodes and chunks whose launch reads no length
    (``ForwardBatch.varlen``; eager steps with chunks run it too, so a replay computes what eager does). Padding
    tokens belong to no sequence and write nothing (slot -1); padding sequences have no token. The graph stops at
    the final hidden states of the logits rows; the logits are computed from them outside it (a buffer of
    ``max_num_seqs`` x vocabulary rows per graph would cost more than the one product saves).

    A capture that fails (an op the capture refuses on some device) turns mixed graphs off with a warning: mixed
    steps then run eagerly, as before."""

    def __init__(self, graphs: CudaGraphRunner, sizes: tuple[int, ...], max_num_seqs: int):
        self.owner, self.sizes, self.max_seqs = graphs, list(sizes), max_num_seqs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if not sizes:
            return
        runner = graphs.runner
        dev, top, seqs = runner.device, self.sizes[-1], max_num_seqs
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.page_table = torch.zeros(seqs, runner.max_pages_per_seq, dtype=torch.long, device=dev)
        self.context_lens = torch.zeros(seqs, **i32)
        self.query_lens = torch.zeros(seqs, **i32)
        self.query_start = torch.zeros(seqs, **i32)
        self.rows = torch.zeros(seqs, dtype=torch.long, device=dev)

    def capture(self) -> None:
        try:
            for tokens in reversed(self.sizes):
                self.graphs[tokens] = self.owner._capture(self._batch(tokens))
        except Exception as e:  # (mixed steps run eagerly; the decode graphs are captured as before)
            log.warning("CUDA graphs of mixed steps are off: capturing them failed (%s: %s)", type(e).__name__, e)
            self.graphs, self.sizes = {}, []
            return
        if self.sizes:
            log.info("captured CUDA graphs for mixed steps of %s tokens", self.sizes)

    def _batch(self, tokens: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens], slot_mapping=self.slots[:tokens],
            page_table=self.page_table, query_lens=[], context_lens=[], num_decodes=0, logits_indices=self.rows,
            context_lens_t=self.context_lens, query_lens_t=self.query_lens, query_start_t=self.query_start,
            varlen=True)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The final hidden states of ``batch``'s logits rows (what the model's eager forward gives), by replaying a
        graph; None where none fits (more tokens, sequences or logits rows than captured, images, a hybrid)."""
        t, n, rows = batch.input_ids.shape[0], batch.num_seqs, batch.logits_indices.shape[0]
        i = bisect.bisect_left(self.sizes, t)
        if (i == len(self.sizes) or n > self.max_seqs or rows > self.max_seqs or batch.images is not None
                or batch.positions.dim() != 1 or batch.state_slots is not None):
            return None
        tokens, width = self.sizes[i], batch.page_table.shape[1]
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slots[:t].copy_(batch.slot_mapping)
        self.slots[t:tokens].fill_(-1)
        self.page_table[:n, :width].copy_(batch.page_table)
        self.context_lens[:n].copy_(batch.context_lens_t)
        self.context_lens[n:].zero_()
        self.query_lens[:n].copy_(batch.query_lens_t)
        self.query_lens[n:].zero_()
        self.query_start[:n].copy_(batch.query_start_t)
        self.query_start[n:].fill_(t)  # (padding sequences start after the last token: the starts stay ascending)
        self.rows[:rows].copy_(batch.logits_indices)
        self.rows[rows:].zero_()
        graph, hidden = self.graphs[tokens]
        graph.replay()
        return hidden[:rows]
