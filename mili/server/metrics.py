"""Prometheus metrics named like vLLM's (``mili:`` prefix), fed from the engine thread after each step.

With several API processes (``mili serve --api-server-count``, PROMETHEUS_MULTIPROC_DIR set) each writes its
series to files there and ``render`` sums every process's: requests are counted by the process that served
them, the engine's gauges (the same in every process) are reported once (``mostrecent``), and its running
totals (preemptions, speculative decoding, hybrid snapshot hits) are counted by one process
(``count_engine_totals``)."""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series, as vLLM

log = logging.getLogger("mili.requests")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, model_name: str, count_engine_totals: bool = True, task: str = "generate"):
        self.registry = r = CollectorRegistry()
        self.count_engine_totals = count_engine_totals
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        labels = {"model_name": model_name, "task": task}
        once = "mostrecent"  # (several API processes: the engine's gauges, reported once, not summed)
        self.running = Gauge("mili:num_requests_running", "Requests in the running batch", registry=r,
                             multiprocess_mode=once)
        self.waiting = Gauge("mili:num_requests_waiting", "Requests waiting to be scheduled", registry=r,
                             multiprocess_mode=once)
        self.kv_usage = Gauge("mili:kv_cache_usage_perc", "Fraction of KV pages in use (0-1)", registry=r,
                              multiprocess_mode=once)
        self.prefix_queries = Counter("mili:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("mili:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        # hybrid models: requests that resumed from a recurrent-state snapshot, and those from a chat turn end's
        self.snapshot_hits = Counter("mili:prefix_cache_snapshot_hits",
                                     "Hybrids: requests that resumed from a recurrent-state snapshot", registry=r)
        self.turn_end_hits = Counter("mili:prefix_cache_turn_end_hits",
                                     "Hybrids: requests that resumed from a snapshot taken at a chat turn's end",
                                     registry=r)
        self._snapshot_hits_seen = (0, 0)
        self.preemptions = Counter("mili:num_preemptions", "Sequences preempted", registry=r)
        self.prompt_tokens = Counter("mili:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("mili:generation_tokens", "Tokens generated", registry=r)
        self.success = Counter("mili:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.failures = Counter("mili:request_failures", "Requests that failed while running (the engine went on)",
                                registry=r)
        self.ttft = Histogram("mili:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mili:inter_token_latency_seconds", "Time between tokens", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("mili:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("mili:request_queue_time_seconds", "Time waiting before first scheduled",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        # speculative decoding (vLLM's names): drafts verified, draft tokens, accepted ones (and by position)
        self.spec_drafts = Counter("mili:spec_decode_num_drafts", "Drafts verified (a sequence's draft in a step)",
                                   registry=r)
        self.spec_draft_tokens = Counter("mili:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted = Counter("mili:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter("mili:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft", ["position"],
                                             registry=r)
        self._spec_seen = None
        # pooling (embed, rerank): API requests, the inputs (texts, pairs) they carried, and their prompt tokens
        self.pooling_requests = Counter("mili:pooling_requests", "Pooling API requests (embeddings, rerank, score)",
                                        ["task"], registry=r)
        self.pooling_inputs = Counter("mili:pooling_inputs", "Inputs pooled (texts embedded, pairs scored)", ["task"],
                                      registry=r)
        self.pooling_tokens = Counter("mili:pooling_prompt_tokens", "Prompt tokens of pooled inputs", ["task"],
                                      registry=r)
        self.info = Gauge("mili:model_info", "The model served", list(labels), registry=r, multiprocess_mode=once)
        self.info.labels(**labels).set(1)
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens counted, last token time)
        self.snapshot: dict = {}
        self._preemptions_seen = 0

    def on_step(self, msg, outputs, live_request_ids) -> None:
        """Called on the event loop for every step message of the engine core (mili.engine.messages)."""
        if self.count_engine_totals:
            self.preemptions.inc(msg.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = msg.num_preemptions
        self.failures.inc(len(msg.failures))
        self._count(outputs, time.monotonic())
        if msg.stats is not None:
            self.update_gauges(msg.stats)
            for rid in [r for r in self._seen if r not in live_request_ids]:  # aborted since
                del self._seen[rid]

    def _count_spec(self, spec) -> None:
        """The speculative-decoding counters, from the core's totals (sent with the gauges)."""
        seen = self._spec_seen
        self.spec_drafts.inc(spec.num_drafts - (seen.num_drafts if seen else 0))
        self.spec_draft_tokens.inc(spec.num_draft_tokens - (seen.num_draft_tokens if seen else 0))
        self.spec_accepted.inc(spec.num_accepted_tokens - (seen.num_accepted_tokens if seen else 0))
        for pos, count in enumerate(spec.accepted_per_pos):
            counted = seen.accepted_per_pos[pos] if seen else 0
            self.spec_accepted_per_pos.labels(position=str(pos)).inc(count - counted)
        self._spec_seen = spec

    def update_gauges(self, stats) -> None:
        """Gauges and the /health snapshot, from the core's counters."""
        if stats.spec is not None and self.count_engine_totals:
            self._count_spec(stats.spec)
        if self.count_engine_totals:
            hits, turn_end = stats.num_snapshot_hits, stats.num_turn_end_hits
            self.snapshot_hits.inc(max(0, hits - self._snapshot_hits_seen[0]))
            self.turn_end_hits.inc(max(0, turn_end - self._snapshot_hits_seen[1]))
            self._snapshot_hits_seen = hits, turn_end
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        used = stats.num_pages - stats.num_pages_free
        self.kv_usage.set((used - stats.num_pages_cached) / stats.num_pages)  # idle cached pages count as free
        self.snapshot = {"kv_cache_pages": stats.num_pages, "kv_cache_pages_free": stats.num_pages_free,
                         "kv_cache_pages_cached": stats.num_pages_cached, "num_requests_running": stats.num_running,
                         "num_requests_waiting": stats.num_waiting,
                         "engine_tokens_generated": stats.num_generated_tokens}

    def _count(self, outputs, now: float) -> None:  # (per request per step)
        generated = 0
        itls: list[float] = []  # one a request a step: observed together
        seen = self._seen
        for out in outputs:
            times = out.metrics
            seqs = out.outputs
            n_tokens = len(seqs[0].token_ids) if len(seqs) == 1 else sum(len(o.token_ids) for o in seqs)
            counted, last = seen.get(out.request_id, _FIRST)
            if last is None:  # first output: the prompt was processed and the first token came
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.prefix_queries.inc(len(out.prompt_token_ids))
                self.prefix_hits.inc(out.num_cached_tokens)
                self.ttft.observe(now - times['arrival_time'])
                self.queue_time.observe((times["first_scheduled_time"] or now) - times["arrival_time"])
            elif n_tokens > counted:
                itls.append((now - last) / (n_tokens - counted))
            generated += n_tokens - counted
            seen[out.request_id] = (n_tokens, now)
            if out.finished:
                del seen[out.request_id]
                reason = out.outputs[0].finish_reason or "abort"
                self.success.labels(finished_reason=reason).inc()
                self.e2e.observe(now - times['arrival_time'])
                log.info("request %s: %d prompt + %d completion tokens, ttft %.3fs, total %.3fs, %s",
                         out.request_id, len(out.prompt_token_ids), n_tokens,
                         (times['first_token_time'] or now) - times['arrival_time'], now - times['arrival_time'],
                         reason)
        self.generation_tokens.inc(generated)  # once a step, not once a request
        observe_each(self.itl, itls)

    def count_pooling(self, task: str, finals) -> None:
        """One pooling API request that answered, with its inputs' final outputs."""
        self.pooling_requests.labels(task=task).inc()
        self.pooling_inputs.labels(task=task).inc(len(finals))
        self.pooling_tokens.labels(task=task).inc(sum(len(f.prompt_token_ids) for f in finals))

    def render(self) -> bytes:
        if self.multiprocess:  # every API process's series
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


_FIRST = (0, None)  # (tokens counted, last token time) of a request not seen yet


def observe_each(histogram: Histogram, values: list[float]) -> None:
    """``histogram.observe(v)`` for every v, as one update per bucket touched rather than a lock round and a bucket
    scan per value (the inter-token latency has a value per streaming request per step). Relies on
    prometheus_client's Histogram layout (``_upper_bounds``, ``_buckets``, ``_sum``), which
    tests/unit/test_server_parts.py checks against ``observe``."""
    if not values:
        return
    bounds, buckets = histogram._upper_bounds, histogram._buckets
    counts: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)  # the first bound >= v, as observe's scan finds it
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        buckets[i].inc(n)
    histogram._sum.inc(sum(values))
