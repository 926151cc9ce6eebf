"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (streamed or not)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from mili.outputs import CompletionOutput, RequestOutput
from mili.server.state import merge, new_id, state_of, until_disconnect
from mili.server.chat import ChatPrompt
from mili.server.errors import APIError, error_responses, streamed
from mili.server.sse import DONE, EventStream, json_bytes, sse, sse_error
from mili.server.protocol import ChatCompletionRequest, CompletionRequest
from mili.tokenizer.reasoning import THINK_START, ReasoningStream, split_reasoning, think_end_token_id
from mili.tokenizer.tool_calls import call_json, new_call_id

router = APIRouter()
GENERATION_ERRORS = error_responses(400, 404, 500, 503)


@router.get("/v1/models")
async def models(http: Request):
    st = state_of(http)
    adapters = [{"id": name, "object": "model", "created": st.created, "owned_by": "mili", "root": lora.lora_path,
                 "parent": st.model_name, "max_model_len": st.engine.max_model_len}
                for name, lora in st.loras.items()]  # LoRA adapters, each on the base model (vLLM's shape)
    return {"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": st.created, "owned_by": "mili",
        "root": st.engine.model_path, "parent": None, "max_model_len": st.engine.max_model_len,
        "quantization": st.engine.info.quantization, "kv_cache_dtype": st.engine.info.kv_cache_dtype,
        "task": st.engine.inputs.task.name}, *adapters]}


def _usage(finals: list[RequestOutput], think_end: int | None = None) -> dict:
    """``think_end``: a thinking chat reply's ``</think>`` id: its tokens through it (all, if it never came) are
    counted as ``completion_tokens_details.reasoning_tokens``."""
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)}}
    if think_end is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(
            o.token_ids.index(think_end) + 1 if think_end in o.token_ids else len(o.token_ids)
            for f in finals for o in f.outputs)}
    return usage


def _think_end(st, prompt: ChatPrompt) -> int | None:
    return think_end_token_id(st.tokenizer) if prompt.thinking else None


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        finals[i] = out
    return finals


def _top(entry: dict, n: int) -> list:
    return sorted(entry.values(), key=lambda lp: lp.rank)[:n]


class _Choice:
    """Per-choice streaming bookkeeping: what was sent (logprob entries, text), whether it finished."""

    def __init__(self, prompt: ChatPrompt | None = None):
        self.head: bytes | None = None  # a completion chunk's bytes up to its text, once made
        self.logprobs_sent = 0
        self.text_sent = 0
        self.done = False
        self.started = False
        self.reasoning = ReasoningStream(prompt is not None and prompt.thinking, prompt is not None and prompt.opened)
        self.tools = prompt.tool_stream() if prompt is not None else None

    def text_head(self, event: EventStream, index: int) -> bytes:
        if self.head is None:
            self.head = event.prefix + b'[{"index":%d,"text":' % index
        return self.head


# the end of a plain completion chunk, after its text (as msgspec writes the rest of the choice)
_NO_FINISH = b',"logprobs":null,"finish_reason":null}]}\n\n'


def _finish(reason: str) -> bytes:
    return b',"logprobs":null,"finish_reason":' + json_bytes(reason) + b"}]}\n\n"


def _finite(logprob: float) -> float:
    # -inf (and NaN) are not JSON: OpenAI's (and vLLM's) stand-in, -9999.0
    return logprob if logprob >= -9999.0 else -9999.0


# -- /v1/completions ---------------------------------------------------------------------------
def _completion_logprobs(token_ids: list[int], entries: list, n: int, offset: int, decode) -> dict:
    """The legacy ``logprobs`` object over ``token_ids`` (the prompt's, with echo, then the output's);
    ``entries[i]`` is {token id: Logprob}, or None for the prompt's first token (nothing predicts it)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            token, logprob, top = decode([tid]), None, None
        else:
            lp = entry[tid]
            token, logprob = lp.decoded_token, _finite(lp.logprob)
            # the top n, and the token itself whatever its rank: up to n + 1 entries, as OpenAI documents
            top = {t.decoded_token: _finite(t.logprob) for t in sorted(entry.values(), key=lambda t: t.rank)
                   if t.rank <= n or t is lp}
        tokens.append(token)
        token_lps.append(logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _prompt_logprobs(f: RequestOutput) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt token first, then the top N by rank."""
    out = []
    for tid, entry in zip(f.prompt_token_ids, f.prompt_logprobs):
        if entry is None:
            out.append(None)
            continue
        ids = [tid] + [t for t in sorted(entry, key=lambda t: entry[t].rank) if t != tid]
        out.append({str(t): {"logprob": _finite(entry[t].logprob), "rank": entry[t].rank,
                             "decoded_token": entry[t].decoded_token} for t in ids})
    return out


@router.post("/v1/completions", responses={**GENERATION_ERRORS, **streamed()})
async def completions(body: CompletionRequest, http: Request):
    st = state_of(http)
    lora = st.check_model(body.model)
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    prompts = body.prompts()
    params = body.sampling_params(body.max_tokens, body.logprobs, st.openai_defaults)
    rid, created, n = new_id("cmpl"), int(time.time()), params.n
    head = {"id": rid, "object": "text_completion", "created": created,
            "model": lora.lora_name if lora else st.model_name}
    nlp = body.logprobs or 0

    def echo_text(f: RequestOutput) -> str:
        if not body.echo:
            return ""
        return f.prompt if f.prompt is not None else st.tokenizer.decode(f.prompt_token_ids)

    def logprobs(f: RequestOutput, o: CompletionOutput, start: int, offset: int, echo: bool) -> dict | None:
        """The output's logprobs from token ``start``; with ``echo``, the prompt's first."""
        if o.logprobs is None:
            return None
        ids, entries = o.token_ids[start:], o.logprobs[start:]
        if echo:
            ids, entries = f.prompt_token_ids + ids, f.prompt_logprobs + entries
        return _completion_logprobs(ids, entries, nlp, offset, st.tokenizer.decode)

    if not body.stream:
        finals = await until_disconnect(http, _collect(await st.start(prompts, [params] * len(prompts), rid,
                                                                      lora=lora)))
        choices = []
        for i, f in enumerate(finals):
            for o in f.outputs:
                choices.append({"index": i * n + o.index, "text": echo_text(f) + o.text,
                                "logprobs": logprobs(f, o, 0, 0, body.echo), "finish_reason": o.finish_reason})
                if f.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = _prompt_logprobs(f)
        return {**head, "choices": choices, "usage": _usage(finals)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = _CompletionEvents(head, n, body.echo, echo_text, logprobs, include_usage)
    return await st.start_stream(prompts, [params] * len(prompts), rid, events, lora=lora)


class _CompletionEvents:
    """A streamed /v1/completions' chunks (server/step_stream.py's Events): one per choice that has news."""

    def __init__(self, head: dict, n: int, echo: bool, echo_text, logprobs, include_usage: bool):
        self.head, self.n, self.echo, self.echo_text, self.logprobs = head, n, echo, echo_text, logprobs
        self.include_usage = include_usage
        self.event = EventStream(head)
        self.choices: dict[int, _Choice] = {}
        self.finals: dict[int, RequestOutput] = {}

    def feed(self, i: int, out: RequestOutput) -> bytes:
        self.finals[i] = out
        data = b""
        for o in out.outputs:
            index = i * self.n + o.index
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = _Choice()
            if o.logprobs is None and not self.echo:  # (the usual chunk: its text, perhaps why it ended)
                finish = o.finish_reason if not c.done else None
                c.done |= o.finished
                if o.delta or finish:  # {"index": index, "text": o.delta, "logprobs": None, "finish_reason": finish}
                    data += b"".join((c.text_head(self.event, index), json_bytes(o.delta),
                                      _NO_FINISH if finish is None else _finish(finish)))
                continue
            echo = self.echo and not c.started  # the prompt (its logprobs are complete by now)
            text = (self.echo_text(out) if echo else "") + o.delta
            c.started = True
            lps = self.logprobs(out, o, c.logprobs_sent, c.text_sent, echo)
            c.logprobs_sent = len(o.token_ids)
            if lps and lps["tokens"]:  # offsets continue from the last token sent
                c.text_sent = lps["text_offset"][-1] + len(lps["tokens"][-1] or "")
            finish = o.finish_reason if not c.done else None
            c.done |= o.finished
            if text or finish or (lps and lps["tokens"]):
                data += self.event([{"index": index, "text": text, "logprobs": lps, "finish_reason": finish}])
        return data

    def end(self) -> bytes:
        if not self.include_usage:
            return DONE
        return sse({**self.head, "choices": [], "usage": _usage(list(self.finals.values()))}) + DONE

    def fail(self, error: BaseException) -> bytes:
        return sse_error(error) + DONE


# -- /v1/chat/completions ----------------------------------------------------------------------
def _chat_logprobs(o: CompletionOutput, start: int, n: int) -> dict | None:
    if o.logprobs is None:
        return None

    def item(lp):
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    return {"content": [{**item(entry[tid]), "top_logprobs": [item(t) for t in _top(entry, n)]}
                        for tid, entry in zip(o.token_ids[start:], o.logprobs[start:])]}


@router.post("/v1/chat/completions", responses={**GENERATION_ERRORS, **streamed()})
async def chat_completions(body: ChatCompletionRequest, http: Request):
    st = state_of(http)
    lora = st.check_model(body.model)
    prompt = ChatPrompt.render(st.tokenizer, body, st.tool_call_parser, st.reasoning)
    thinking, opened = prompt.thinking, prompt.opened
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.max_tokens is not None and body.max_tokens >= st.engine.max_model_len:  # (even when overridden)
        raise APIError(400, f"max_tokens must be below the context length ({st.engine.max_model_len})",
                       param="max_tokens")
    params = prompt.params(st.tokenizer, body, max_tokens, body.logprobs_n(), st.openai_defaults)
    rid, created = new_id("chatcmpl"), int(time.time())
    head = {"id": rid, "object": "chat.completion", "created": created,
            "model": lora.lora_name if lora else st.model_name}
    nlp = body.top_logprobs or 0

    if not body.stream:
        (final,) = await until_disconnect(http, _collect(await st.start([prompt.token_ids], [params], rid,
                                                                         [prompt.images], lora=lora)))
        choices = []
        for o in final.outputs:
            reasoning, content = split_reasoning(THINK_START * opened + o.text) if thinking else (None, o.text)
            content, calls = prompt.tool_calls(content)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call_json(None, new_call_id(), name, args) for name, args in calls]
            if reasoning is not None:
                message["reasoning_content"] = message["reasoning"] = reasoning
            finish = "tool_calls" if calls and o.finish_reason == "stop" else o.finish_reason
            choices.append({"index": o.index, "message": message, "logprobs": _chat_logprobs(o, 0, nlp),
                            "finish_reason": finish})
        extra = {"prompt_logprobs": _prompt_logprobs(final)} if final.prompt_logprobs is not None else {}
        return {**head, "choices": choices, "usage": _usage([final], _think_end(st, prompt)), **extra}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = _ChatEvents({**head, "object": "chat.completion.chunk"}, prompt, nlp, include_usage,
                         _think_end(st, prompt))
    return await st.start_stream([prompt.token_ids], [params], rid, events, [prompt.images], lora=lora)


class _ChatEvents:
    """A streamed chat completion's chunks (server/step_stream.py's Events): the role first, then reasoning,
    content and tool calls as the parsers release them."""

    def __init__(self, chunk_head: dict, prompt: ChatPrompt, nlp: int, include_usage: bool, think_end: int | None):
        self.chunk_head, self.prompt, self.nlp, self.include_usage = chunk_head, prompt, nlp, include_usage
        self.think_end = think_end
        self.event = EventStream(chunk_head)
        self.choices: dict[int, _Choice] = {}
        self.final: RequestOutput | None = None

    def feed(self, _: int, out: RequestOutput) -> bytes:
        self.final = out
        data = b""
        for o in out.outputs:
            c = self.choices.get(o.index)
            if c is None:
                c = self.choices[o.index] = _Choice(self.prompt)
            if not c.started:
                c.started = True
                data += self.event([{"index": o.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}])
            if c.done:
                continue
            reasoning, content = c.reasoning.feed(o.delta, final=o.finished)
            calls = []
            if c.tools is not None:
                content, calls = c.tools.feed(content, final=o.finished)
            lps = _chat_logprobs(o, c.logprobs_sent, self.nlp)
            c.logprobs_sent = len(o.token_ids)
            delta = {}
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            c.done = o.finished
            finish = o.finish_reason
            if finish == "stop" and c.tools is not None and c.tools.num_calls:
                finish = "tool_calls"
            if delta or o.finished or (lps and lps["content"]):
                data += self.event([{"index": o.index, "delta": delta, "logprobs": lps, "finish_reason": finish}])
        return data

    def end(self) -> bytes:
        if not self.include_usage or self.final is None:
            return DONE
        return sse({**self.chunk_head, "choices": [], "usage": _usage([self.final], self.think_end)}) + DONE

    def fail(self, error: BaseException) -> bytes:
        return sse_error(error) + DONE
