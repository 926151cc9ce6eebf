"""EngineCore: the scheduler, the model runner and the KV cache, stepping (its process: ``core_process``).

The core knows token ids only: no tokenizer, no text, no HTTP. Each ``step()`` returns what every moved
sequence did (``SeqDelta``: its new tokens, their logprobs, why it ended). Stop *strings* are found by
the API side's output processor, which then ends the sequence here (``finish_seqs``).
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from concurrent.futures import Future

import torch

from mili.cache.hybrid_radix_cache import HybridRadixCache
from mili.cache.page_pool import PagePool
from mili.cache.radix_cache import NoPrefixCache, RadixCache
from mili.cache.snapshot_pool import SnapshotPool
from mili.cache.state_pool import StatePool
from mili.config import EngineConfig, ModelConfig
from mili.engine.messages import AddRequest, Ready, SeqDelta, SpecDecodeCounts, Stats
from mili.engine.request import PENDING_TOKEN, Request, Sequence, SeqStatus
from mili.engine.scheduler import Scheduler
from mili.engine.thinking import ThinkingBudget
from mili.errors import InvalidRequest
from mili.runtime.images import request_images
from mili.runtime.model_runner import ModelRunner
from mili.runtime.plan import DeviceInfo, PrefixCacheKind, plan
from mili.runtime.sampler import NO_TOKEN
from mili.speculative.drafter import Drafter
from mili.speculative.stats import SpecDecodeStats
from mili.structured import GrammarManager, SeqGrammar

log = logging.getLogger("mili")


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: str):
        self.config = config
        torch.manual_seed(config.seed)
        self.model_path = model_path
        if config.speculative_config is not None:  # (refused before the weights load)
            Drafter.check(config.speculative_config, model_path)
        # every choice of how the model runs, made once (refusing what cannot run before a weight loads)
        self.plan = plan(config, model_config,
                         DeviceInfo.probe(config.torch_device, config.cpu_kernels, config.cpu_isa))
        self.config = config = self.plan.resolve(config)  # max_num_seqs, max_num_batched_tokens: auto sized
        log.info("execution plan: %s", "; ".join(f"{k}: {v}" for k, v in self.plan.describe().items()))
        if self.plan.cpu_paths:
            log.info("CPU paths: %s", "; ".join([self.plan.device.cpu_headline]
                                                + [f"{k}: {v}" for k, v in self.plan.cpu_paths.items()]))
        self.runner = ModelRunner(config, model_config, model_path, execution_plan=self.plan)
        # the pools that hand out the runner's KV pages and recurrent-state rows: the core's, as the scheduler and
        # the prefix cache that use them
        layout = self.runner.parts.layout
        self.max_model_len = layout.max_model_len
        self.pages = PagePool(layout.num_pages, layout.page_size)
        self.state_slots = StatePool(layout.num_state_slots) if layout.num_state_slots else None
        self.snapshots = SnapshotPool(layout.num_snapshots, first_row=layout.num_state_slots)
        kind = self.plan.prefix_cache  # (the plan's choice)
        if kind is PrefixCacheKind.RADIX:
            self.prefix_cache = RadixCache(self.pages)
        elif kind is PrefixCacheKind.HYBRID_RADIX:  # hybrids: KV pages and snapshots of the recurrent state
            self.prefix_cache = HybridRadixCache(self.pages, self.snapshots, self.runner.copy_states)
        else:
            if self.plan.prefix_cache_why:
                log.info("prefix caching off: %s", self.plan.prefix_cache_why)
            self.prefix_cache = NoPrefixCache()
        self.drafter = None  # speculative decoding (mili/speculative): the plan's method, with the options' counts
        if self.plan.speculative is not None:
            self.drafter = Drafter(config.speculative_config, max_seqs=layout.num_spare_rows
                                   if self.state_slots is not None else config.max_num_seqs)
        self.scheduler = Scheduler(self.pages, self.prefix_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.schedule_policy, states=self.state_slots, drafter=self.drafter,
                                   max_loras=config.max_loras if config.enable_lora else 0)
        self.spec_stats = SpecDecodeStats(self.drafter.config.num_speculative_tokens if self.drafter else 0)
        self.requests: dict[str, Request] = {}
        # structured outputs: requests whose grammar is compiling (not yet scheduled), and the failed ones
        self.grammars: GrammarManager | None = None
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self.failed: list[tuple[str, str]] = []  # (request_id, message), for the caller to report
        # (request_id, message): requests that failed while running, ended here, for the caller to report
        self.failures: list[tuple[str, str]] = []
        self.vocab_size = model_config.vocab_size
        self.stats_due = False  # a request ended or left since the gauges were last read
        self.num_generated_tokens = 0
        # scheduling ahead of the device (``step``): the step in flight, (its SchedulerOutput, StepResult, prompt
        # logprobs), whose tokens are read once the next step is launched; and how many requests need each step's
        # tokens on the host before the next is scheduled (grammars, penalties), which holds the overlap off
        self.in_flight: tuple | None = None
        self.num_sync_requests = 0

    def ready(self) -> Ready:
        parts = self.runner.parts
        dtype = str(parts.dtype).removeprefix("torch.")
        layout = parts.layout
        return Ready(self.max_model_len, str(parts.device), dtype, self.stats(), parts.plan.weight_format,
                     parts.plan.kv_dtype_name, isinstance(self.prefix_cache, RadixCache), layout.num_state_slots,
                     layout.state_bytes, layout.num_snapshots, self.plan.describe(), self.config.max_num_seqs,
                     self.config.max_num_batched_tokens, self.plan.batch.sized_by)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, add: AddRequest) -> Request:
        """Queue a request the API side validated (ids in range, fits the context)."""
        params = add.params
        states = self.state_slots
        if states is not None and params.n > states.num_slots:  # (the API side refuses it first: make_request)
            raise InvalidRequest(f"n {params.n} exceeds the {states.num_slots} recurrent-state slots of this hybrid "
                                 f"model (raise num_state_slots)", param="n")
        request = Request(add.request_id, None, list(add.prompt_token_ids), params, add.max_total_tokens,
                          arrival_time=add.arrival_time, turn_ends=list(add.turn_ends))
        if add.images is not None:
            request.images = request_images(self.runner.parts.model, self.config, self.runner.parts.model_config,
                                            add.prompt_token_ids, add.images)
        if add.lora is not None:  # (loaded and checked against the base on first use; refused by name)
            if self.runner.parts.loras is None:
                raise InvalidRequest("this engine was started without --enable-lora: it serves no LoRA adapters",
                                     param="lora_request")
            from mili.lora import LoRARequest

            request.lora = LoRARequest(*add.lora)
            self.runner.parts.loras.acquire(request.lora)
        for i in range(params.n):
            generator = None
            if params.seed is not None:  # sequence i of a seeded request draws from its own stream
                generator = torch.Generator(self.runner.parts.device).manual_seed(params.seed + 7919 * i)
            request.seqs.append(Sequence(request, i, list(add.prompt_token_ids), len(add.prompt_token_ids),
                                         generator, status=SeqStatus.WAITING if i == 0 else SeqStatus.UNBORN))
            if params.thinking_token_budget is not None and params.thinking_tokens is not None:
                request.seqs[-1].thinking = ThinkingBudget(params.thinking_token_budget, params.thinking_tokens,
                                                           add.prompt_token_ids)
        self.requests[add.request_id] = request
        self.num_sync_requests += needs_host_tokens(params)
        if params.structured_outputs is None:
            self.scheduler.add(request)
        else:  # scheduled once its grammar is compiled, which happens off the step
            self.compiling[add.request_id] = (request, self.grammar_manager().compile(params.structured_outputs))
        return request

    def grammar_manager(self) -> GrammarManager:
        if self.grammars is None:  # made on the first constrained request: no cost to a server without any
            self.grammars = GrammarManager(self.config.tokenizer or self.model_path,
                                           self.runner.parts.model_config.vocab_size)
        return self.grammars

    def admit_compiled(self, wait: float = 0.0) -> None:
        """Schedule the requests whose grammar is ready (waiting up to ``wait`` seconds for one when
        nothing else can run); a failed compile ends its request (reported through ``failed``)."""
        if not self.compiling:
            return
        if wait:
            futures.wait([f for _, f in self.compiling.values()], timeout=wait, return_when=futures.FIRST_COMPLETED)
        for request_id, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                compiled = future.result()
            except Exception as e:
                log.warning("request %s: its grammar failed to compile: %s", request_id, e)
                self.failed.append((request_id, f"the structured output constraint failed to compile: {e}"))
                self.abort_requests([request_id])
                continue
            params = request.params
            # (ids past the model's vocabulary, such as a tokenizer's EOS on a cut vocabulary, are never sampled)
            stop_ids = sorted(t for t in params.stop_ids() | set(params.eos_token_ids) if t < self.vocab_size)
            try:
                for seq in request.seqs:
                    seq.grammar = SeqGrammar(compiled, stop_ids, params.structured_outputs.start_after_token_id)
            except Exception as e:
                self.fail_request(request, f"its grammar matcher could not start: {type(e).__name__}: {e}")
                continue
            self.scheduler.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.compiling.pop(request_id, None)  # its compile goes on: the grammar is cached for others
            request = self.requests.pop(request_id, None)
            if request is not None:
                for seq in request.seqs:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, "abort")
                self._left(request)

    def finish_seqs(self, seqs: list[tuple[str, int]]) -> None:
        """End sequences the output processor finished (a stop string): their pages go back."""
        for request_id, index in seqs:
            request = self.requests.get(request_id)
            if request is None or request.seqs[index].is_finished:
                continue
            self.scheduler.finish(request.seqs[index], "stop")
            self._retire_if_finished(request)

    def take_failed(self) -> list[tuple[str, str]]:
        failed, self.failed = self.failed, []
        return failed

    def fail_request(self, request: Request, message: str) -> None:
        """End a request whose own part of a step failed (its pages go back); the core goes on."""
        log.error("request %s failed and ends: %s", request.request_id, message)
        self.failures.append((request.request_id, message))
        self.abort_requests([request.request_id])

    def take_failures(self) -> list[tuple[str, str]]:
        failures, self.failures = self.failures, []
        return failures

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Something to schedule, a grammar compiling, or a step in flight whose tokens are still to be read."""
        return self.scheduler.has_work() or bool(self.compiling) or self.in_flight is not None

    def step(self) -> list[SeqDelta]:
        """Schedule, run the model once, sample; the new tokens (and prompt logprobs) of every sequence that moved.

        Ahead of the device (``plan.overlap``): the step is launched, then the previous one's tokens are read (they
        were on their way to the host meanwhile) and returned, so the host prepares step N + 1 while the device
        runs step N. Step N + 1's sequences that drew in step N take that token on the device (``pending_at``);
        the stop checks apply when it is read, one step late, and what a finished sequence computed meanwhile is
        dropped, never emitted. A step that needs its tokens on the host first (grammars, penalties) waits for
        the step in flight, then runs on its own."""
        self.admit_compiled(wait=0.0 if self.has_work() else 0.005)
        overlap = self.plan.overlap and not self.num_sync_requests
        deltas: list[SeqDelta] = []
        if self.in_flight is not None and not overlap:
            deltas += self._read(*self._take_in_flight())
        if not self.scheduler.has_work():
            if self.in_flight is not None:
                deltas += self._read(*self._take_in_flight())
            return deltas
        sched = self.scheduler.schedule()
        now = time.monotonic()
        for s in sched.scheduled:
            if s.seq.request.first_scheduled_time is None:
                s.seq.request.first_scheduled_time = now
        prev = self.in_flight
        feed = None  # the previous step's draws, on the device, as its sequences' next inputs (a bad id made valid:
        if prev is not None and prev[1].pending is not None:  # its sequence fails when read, and never feeds it again)
            feed = (prev[1].pending.ids.clamp(0, self.vocab_size - 1),
                    {seq: row for row, (seq, _) in enumerate(prev[0].sample_rows)})
        result = self.runner.execute(sched, self._grammar_bitmask(sched.sample_rows, sched.scheduled), feed,
                                     defer=overlap)
        ats = None  # where its draws stand in the sequences' tokens until read (the next step takes them on the device)
        if overlap:
            ats = []
            for seq, _ in sched.sample_rows:
                seq.pending_at = len(seq.token_ids)
                ats.append(seq.pending_at)
                seq.token_ids.append(PENDING_TOKEN)
        self.scheduler.after_step(sched.scheduled, result.num_rejected)
        prompt_logprobs = {}  # sequence -> the prompt logprobs it scored this step (sent with its delta)
        for seq, entries in result.scored:
            seq.request.num_scored += len(entries)
            prompt_logprobs[seq] = entries
        deltas += self._unsampled(sched, result, prompt_logprobs)
        if prev is not None:
            self.in_flight = None
            deltas += self._read(*prev)
        if overlap:
            self.in_flight = (sched, result, prompt_logprobs, ats)
        else:
            deltas += self._read(sched, result, prompt_logprobs)
        return deltas

    def _take_in_flight(self) -> tuple:
        in_flight, self.in_flight = self.in_flight, None
        return in_flight

    def _unsampled(self, sched, result, prompt_logprobs: dict) -> list[SeqDelta]:
        """The deltas of a step's sequences that draw nothing: requests with max_tokens 0 whose prompt is now scored
        (or pooled) end; sequences that scored prompt positions only send those (taken from ``prompt_logprobs``)."""
        deltas = []
        for s in sched.scheduled:  # max_tokens 0: the prompt is scored (or pooled), nothing is generated
            seq = s.seq
            if seq.params.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens and not seq.is_finished:
                for each in seq.request.seqs:
                    self.scheduler.finish(each, "length" if each.params.pooling is None else "stop")
                    delta = self._delta(each, [], None, prompt_logprobs.pop(each, None), each.finish_reason)
                    delta.pooled = result.pooled.get(each)
                    deltas.append(delta)
                self._retire_if_finished(seq.request)
        sampling = {seq for seq, _ in sched.sample_rows}
        for seq in [seq for seq in prompt_logprobs if seq not in sampling]:
            deltas.append(self._delta(seq, [], None, prompt_logprobs.pop(seq)))
        return deltas

    def _read(self, sched, result, prompt_logprobs: dict, ats: list[int] | None = None) -> list[SeqDelta]:
        """A step's drawn tokens taken in (read from the device if it was deferred; ``ats``: where each sampling row's
        token stands in its sequence's tokens): each sequence's stop checks, and its delta. A sequence that ended
        before (one step late: its last token was read after this step had started; an abort) drops its token."""
        sampled = result.resolve(sched.sample_rows)
        deltas, failed = [], set()  # (the requests that failed this step)
        if sampled is None:
            return deltas
        self.spec_stats.add(sampled.num_drafted, sampled.num_accepted)
        if ats is not None:
            # every stand-in first takes the id the next step read on the device (clamped into the vocabulary), so a
            # sequence that ends below (a failing sibling ends it too) gives the prefix cache keys its KV was made from
            for (seq, _), at, tokens in zip(sched.sample_rows, ats, sampled.token_ids):
                if not seq.is_finished:  # (a failed row drew NO_TOKEN: fed as 0)
                    seq.token_ids[at] = min(max(tokens[0], 0), self.vocab_size - 1) if tokens else 0
        for row, ((seq, _), tokens, lps) in enumerate(zip(sched.sample_rows, sampled.token_ids, sampled.logprobs)):
            at = ats[row] if ats is not None else None
            if seq.pending_at == at:
                seq.pending_at = None  # (else it stands in a later step's token too)
            if seq.is_finished or seq.request.request_id in failed:  # (it ended; or a sibling sequence failed)
                if at is not None:
                    del seq.token_ids[at:]
                continue
            error = sampled.errors.get(row)
            delta = self._delta(seq, [], None if lps and lps[0] is None else [], prompt_logprobs.pop(seq, None))
            for token, lp in zip(tokens, lps):  # (more than one: accepted drafts)
                error = error or self._bad_token(token)
                if error is not None or seq.is_finished:
                    break
                delta.token_ids.append(token)
                if lp is not None:
                    delta.logprobs.append((lp.sampled_logprob, lp.sampled_rank, lp.top))
                try:  # (its grammar matcher is the request's own)
                    self._append_token(seq, token, delta, at)
                except Exception as e:
                    error = f"accepting token {token} failed: {type(e).__name__}: {e}"
            self.num_generated_tokens += len(delta.token_ids)
            if error is not None:
                failed.add(seq.request.request_id)
                self.fail_request(seq.request, error)
                continue
            deltas.append(delta)
            self._retire_if_finished(seq.request)
        return [d for d in deltas if d.request_id not in failed] if failed else deltas

    def _bad_token(self, token: int) -> str | None:
        """Why a sampled token cannot be fed back (None when it can)."""
        if token == NO_TOKEN:
            return ("no token could be sampled: every token of the vocabulary was masked for this sequence (by its "
                    "grammar, min_tokens, stop tokens, penalties, or logits that are not numbers)")
        if not 0 <= token < self.vocab_size:
            return f"the sampled token id {token} is outside the vocabulary [0, {self.vocab_size})"
        return None

    @staticmethod
    def _delta(seq: Sequence, token_ids: list[int], logprobs, prompt_logprobs, finish_reason=None) -> SeqDelta:
        request = seq.request
        return SeqDelta(request.request_id, seq.index, token_ids, logprobs, finish_reason,
                        prompt_logprobs=prompt_logprobs,
                        num_cached_tokens=request.num_cached_tokens or 0,
                        first_scheduled_time=request.first_scheduled_time)

    def _grammar_bitmask(self, sample_rows, scheduled) -> Future | None:
        """A future of (token bitmask [rows, vocab / 32], the constrained rows) for this step's sampling
        rows (1 + len(draft) each), filled while the model runs; None if no row is constrained."""
        if self.grammars is None:
            return None
        return self.grammars.bitmask([seq.grammar for seq, _ in sample_rows],
                                     [scheduled[i].draft for _, i in sample_rows])

    def _retire_if_finished(self, request: Request) -> None:
        """A request whose sequences have all ended leaves the core (its pages are back already)."""
        if request.is_finished and self.requests.pop(request.request_id, None) is not None:
            self._left(request)

    def _left(self, request: Request) -> None:
        """A request left the core: the gauges change, its images' claims on the encoder cache go, and its LoRA
        adapter may be dropped."""
        self.stats_due = True
        self.num_sync_requests -= needs_host_tokens(request.params)
        if request.lora is not None:
            self.runner.parts.loras.release(request.lora)
        if request.images is not None:
            self.runner.parts.encoder_cache.release_all(request.images)  # (its claims go; the outputs may stay)

    def _append_token(self, seq: Sequence, token: int, delta: SeqDelta, at: int | None = None) -> None:
        """``token`` taken into ``seq`` (at index ``at`` where it stood in as ``PENDING_TOKEN``), and its stop checks."""
        params = seq.params
        if at is None:
            seq.token_ids.append(token)
            length = seq.num_tokens
        else:
            seq.token_ids[at] = token
            length = at + 1
        if seq.thinking is not None:
            seq.thinking.accept(token)
        if seq.grammar is not None and seq.grammar.accept(token):  # the constrained output is complete
            seq.stop_reason = None if token in params.eos_token_ids or token not in params.stop_ids() else token
            self.scheduler.finish(seq, "stop")
        elif token in params.stop_ids():
            seq.stop_reason = None if token in params.eos_token_ids else token
            self.scheduler.finish(seq, "stop")
        elif length >= seq.request.max_total_tokens:
            self.scheduler.finish(seq, "length")
        delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason

    def stats(self) -> Stats:
        self.stats_due = False
        sched, pages, slots, cache = self.scheduler, self.pages, self.state_slots, self.prefix_cache
        totals = self.spec_stats.totals()
        spec = SpecDecodeCounts(*totals) if totals is not None else None
        return Stats(len(sched.running), len(sched.waiting), pages.num_pages, pages.num_free,
                     cache.num_evictable(), self.num_generated_tokens, spec, sched.num_preemptions,
                     slots.num_slots if slots else 0, slots.num_free if slots else 0, self.snapshots.num_snapshots,
                     self.snapshots.num_used, *cache.counts() if isinstance(cache, HybridRadixCache) else ())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.runner.parts.encoder_cache is not None:
            live = {id(r.images) for r in self.requests.values()}
            self.runner.parts.encoder_cache.check_integrity(alive=lambda images: id(images) in live)


def needs_host_tokens(params) -> bool:
    """Whether a request's next step needs its last tokens on the host (its grammar's matcher, penalties counting
    them, a thinking budget forcing its end): while one runs, steps are not scheduled ahead of the device."""
    return params.structured_outputs is not None or params.uses_penalties or params.thinking_token_budget is not None
