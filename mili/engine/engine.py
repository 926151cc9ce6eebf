"""LLMEngine: requests in, one scheduled model step at a time, RequestOutputs out.

The offline ``LLM`` and the server's async engine both drive this class; it knows nothing of HTTP.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from mili.cache.radix_cache import NoPrefixCache, RadixCache
from mili.config import EngineConfig, ModelConfig
from mili.engine.request import Request, Sequence, SeqStatus
from mili.engine.scheduler import Scheduler
from mili.errors import ContextLengthExceeded, InvalidRequest
from mili.model.loader import load_generation_defaults, load_hf_config, resolve_model_path
from mili.outputs import CompletionOutput, Logprob, RequestOutput
from mili.runtime.model_runner import ModelRunner
from mili.runtime.sampler import TokenLogprobs
from mili.sampling_params import SamplingParams
from mili.tokenizer.detokenizer import TextStream
from mili.tokenizer.tokenizer import encode_prompt, load_eos_token_ids, load_tokenizer

log = logging.getLogger("mili")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(config.seed)
        self.model_path = resolve_model_path(config.model)
        hf_config = load_hf_config(self.model_path)
        self.model_config = ModelConfig.from_hf(hf_config)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.eos_token_ids = load_eos_token_ids(self.model_path, self.tokenizer, hf_config)
        self.generation_defaults = load_generation_defaults(self.model_path)  # used by the server
        self.runner = ModelRunner(config, self.model_config, self.model_path)
        self.max_model_len = self.runner.max_model_len
        pool = self.runner.pool
        self.prefix_cache = RadixCache(pool) if config.enable_prefix_caching else NoPrefixCache()
        self.scheduler = Scheduler(pool, self.prefix_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.schedule_policy)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Validate and queue one request; raises InvalidRequest / ContextLengthExceeded."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if isinstance(prompt, str):
            text, token_ids = prompt, encode_prompt(self.tokenizer, prompt)
        else:
            text, token_ids = None, list(prompt)
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if not token_ids:
            raise InvalidRequest("the prompt must not be empty", param="prompt")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequest(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})", param="n")
        max_total = self._check_length(len(token_ids), params.max_tokens)
        params = dataclasses.replace(params, eos_token_ids=list(self.eos_token_ids))
        request = Request(request_id, text, token_ids, params, max_total)
        for i in range(params.n):
            generator = None
            if params.seed is not None:  # sequence i of a seeded request draws from its own stream
                generator = torch.Generator(self.runner.device).manual_seed(params.seed + 7919 * i)
            request.seqs.append(Sequence(
                request, i, list(token_ids), len(token_ids), generator,
                TextStream(self.tokenizer, token_ids, params.stop, params.skip_special_tokens),
                status=SeqStatus.WAITING if i == 0 else SeqStatus.UNBORN,
                logprobs=[] if params.logprobs is not None else None))
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.max_model_len
        asked = max_tokens if max_tokens is not None else max(limit - prompt_len, 1)
        if prompt_len + asked > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens, the request has {prompt_len} "
                f"prompt tokens and asks for {asked} completion tokens ({prompt_len + asked} in all).",
                param="prompt" if prompt_len >= limit else "max_tokens")
        return prompt_len + asked

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                seq.stream.finish()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the outputs of every request that moved."""
        if not self.scheduler.has_work():
            return []
        sched = self.scheduler.schedule()
        now = time.monotonic()
        for s in sched.scheduled:
            if s.seq.request.first_scheduled_time is None:
                s.seq.request.first_scheduled_time = now
        sampled = self.runner.execute(sched)
        self.scheduler.after_step(sched.scheduled)
        touched: dict[str, Request] = {}
        if sampled is not None:
            for (seq, _), token, lp in zip(sched.sample_rows, sampled.token_ids, sampled.logprobs):
                self._append_token(seq, token, lp)
                touched[seq.request.request_id] = seq.request
        now = time.monotonic()
        outputs = []
        for request in touched.values():
            request.first_token_time = request.first_token_time or now
            if request.is_finished:
                request.finished_time = now
                self.requests.pop(request.request_id, None)
            outputs.append(self._make_output(request))
        return outputs

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> None:
        params = seq.params
        seq.token_ids.append(token)
        if lp is not None:
            self._record_logprobs(seq, token, lp)
        if token in params.stop_ids():
            seq.stop_reason = None if token in params.eos_token_ids else token
            seq.stream.finish()
            self.scheduler.finish(seq, "stop")
            return
        if seq.stream.append(token):
            seq.stop_reason = seq.stream.stop_string
            self.scheduler.finish(seq, "stop")
        elif seq.num_tokens >= seq.request.max_total_tokens:
            seq.stream.finish()
            self.scheduler.finish(seq, "length")

    def _record_logprobs(self, seq: Sequence, token: int, lp: TokenLogprobs) -> None:
        decode = self.tokenizer.decode
        entry = {tid: Logprob(val, rank, decode([tid])) for rank, (tid, val) in enumerate(lp.top, 1)}
        entry[token] = Logprob(lp.sampled_logprob, lp.sampled_rank, decode([token]))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp.sampled_logprob

    def _make_output(self, request: Request) -> RequestOutput:
        outputs = [CompletionOutput(
            index=s.index, text=s.stream.text, token_ids=list(s.output_token_ids),
            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            delta=s.stream.take_delta()) for s in request.seqs if s.status != SeqStatus.UNBORN]
        times = {"arrival_time": request.arrival_time, "first_scheduled_time": request.first_scheduled_time,
                 "first_token_time": request.first_token_time, "finished_time": request.finished_time}
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.is_finished, request.num_cached_tokens or 0, times)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
