"""OutputProcessor: the engine core's per-step deltas in, RequestOutputs out (on the API side).

Per request it keeps what the client sees: each sequence's token ids, its incremental text
(``TextStream``: detokenization, stop strings held back while streaming), its logprobs with decoded
tokens, and the prompt's logprobs (they come chunk by chunk during the prefill and are complete by the
request's first output: a delta that only scores prompt tokens makes no output). A stop string found
here ends the sequence; ``process`` returns those sequences so the caller tells the core to stop
computing them. The offline ``LLMEngine`` and the server's ``AsyncLLM`` both use this one class.
"""

from __future__ import annotations

import logging
import time

from mili.engine.messages import AddRequest, SeqDelta
from mili.outputs import CompletionOutput, Logprob, RequestOutput
from mili.tokenizer.detokenizer import TextStream

log = logging.getLogger("mili")


class _SeqState:
    __slots__ = ("index", "token_ids", "stream", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason")

    def __init__(self, index: int, stream: TextStream, logprobs: bool):
        self.index = index
        self.token_ids: list[int] = []
        self.stream = stream
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        """What the client sees of this sequence now (taking the text that became final since the last)."""
        return CompletionOutput(self.index, None, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs,
                                self.cumulative_logprob if self.logprobs is not None else None,
                                self.stream.take_delta(), self.stream)


class RequestState:
    def __init__(self, add: AddRequest, prompt: str | None, tokenizer):
        self.request_id = add.request_id
        self.prompt = prompt
        self.prompt_token_ids = add.prompt_token_ids
        self.params = add.params
        self.tokenizer = tokenizer
        self.seqs: dict[int, _SeqState] = {}
        # prompt logprobs: None for the first token (nothing before it), then one entry per scored token
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if add.params.prompt_logprobs is not None else None)
        self.num_cached_tokens = 0
        self.pooled: list[float] | None = None  # a pooling request's answer, once it came
        self.times = {"arrival_time": add.arrival_time, "first_scheduled_time": None, "first_token_time": None,
                      "finished_time": None}

    def seq(self, index: int) -> _SeqState:
        state = self.seqs.get(index)
        if state is None:
            p = self.params
            stream = TextStream(self.tokenizer, self.prompt_token_ids, p.stop, p.skip_special_tokens)
            state = self.seqs[index] = _SeqState(index, stream, p.logprobs is not None)
        return state

    @property
    def finished(self) -> bool:
        if len(self.seqs) != self.params.n:
            return False
        for s in self.seqs.values():  # (a loop, not all(genexpr): this runs per request per step)
            if s.finish_reason is None:
                return False
        return True

    def output(self, finished: bool) -> RequestOutput:
        if len(self.seqs) == 1:  # (n = 1: no sorting, no comprehension; this runs per request per step)
            outputs = [next(iter(self.seqs.values())).output()]
        else:
            outputs = [s.output() for s in sorted(self.seqs.values(), key=lambda s: s.index)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             self.num_cached_tokens, self.times, self.prompt_logprobs, pooled=self.pooled)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add(self, add: AddRequest, prompt: str | None) -> None:
        self.requests[add.request_id] = RequestState(add, prompt, self.tokenizer)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, deltas: list[SeqDelta]) -> tuple[list[RequestOutput], list[tuple[str, int]], list[tuple[str, str]]]:
        """(the outputs of every request that moved, the sequences a stop string ended, the requests whose
        output failed to process here: (request_id, message); the caller ends them: ``fail`` or ``remove``)."""
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, int]] = []
        failed: list[tuple[str, str]] = []
        now = time.monotonic()
        for d in deltas:
            req = self.requests.get(d.request_id)
            if req is None or failed and any(d.request_id == f for f, _ in failed):  # aborted, or finished here
                continue                                  # while the core was a step behind; or failed
            try:
                self._apply(req, d, stopped, touched)
            except Exception as e:  # (its detokenization, its logprobs): that request alone ends
                log.exception("request %s: processing its output failed", d.request_id)
                failed.append((d.request_id, f"processing its output failed: {type(e).__name__}: {e}"))
                touched.pop(d.request_id, None)
        outputs = []
        for req in touched.values():
            if req.times["first_token_time"] is None:
                req.times["first_token_time"] = now
            finished = req.finished
            if finished:
                req.times["finished_time"] = now
                del self.requests[req.request_id]
            outputs.append(req.output(finished))
        return outputs, stopped, failed

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """The final output of a request that failed (offline: every sequence ends with ``"error"`` and
        the output carries ``error``); None if it is not known here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for index in range(req.params.n):
            seq = req.seq(index)
            if seq.finish_reason is None:
                seq.finish_reason = "error"
        out = req.output(req.finished)
        out.error = message
        return out

    def _apply(self, req: RequestState, d: SeqDelta, stopped: list, touched: dict) -> None:
        """One delta into its request's state."""
        if d.prompt_logprobs and req.prompt_logprobs is not None:
            prompt = req.prompt_token_ids
            for lp in d.prompt_logprobs:
                req.prompt_logprobs.append(self._entry(prompt[len(req.prompt_logprobs)], lp))
        seq = req.seqs.get(d.index) or req.seq(d.index)
        if seq.finish_reason is not None or not (d.token_ids or d.finish_reason):
            return
        touched[d.request_id] = req
        req.num_cached_tokens = d.num_cached_tokens
        if d.pooled is not None:
            req.pooled = d.pooled
        req.times["first_scheduled_time"] = d.first_scheduled_time
        for k, token in enumerate(d.token_ids):
            seq.token_ids.append(token)
            if d.logprobs is not None and seq.logprobs is not None:
                self._record_logprobs(seq, token, d.logprobs[k])
            if seq.stream.append(token):  # a stop string: the text ends before it
                seq.finish_reason, seq.stop_reason = "stop", seq.stream.stop_string
                if d.finish_reason is None:
                    stopped.append((d.request_id, d.index))
                break
        else:
            if d.finish_reason is not None:
                seq.stream.finish()
                seq.finish_reason, seq.stop_reason = d.finish_reason, d.stop_reason

    def _record_logprobs(self, seq: _SeqState, token: int, lp: tuple) -> None:
        seq.logprobs.append(self._entry(token, lp))
        seq.cumulative_logprob += lp[0]

    def _entry(self, token: int, lp: tuple) -> dict[int, Logprob]:
        """{token id: Logprob} of one position: the top N, and ``token`` (sampled or from the prompt)."""
        logprob, rank, top = lp
        decode = self.tokenizer.decode
        entry = {tid: Logprob(val, r, decode([tid])) for r, (tid, val) in enumerate(top, 1)}
        entry[token] = Logprob(logprob, rank, decode([token]))
        return entry
