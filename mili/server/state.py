"""What the routes of every dialect share: the server's state (the engine, the model's name, the API key, the
queue bound, sampling defaults, the tool-call parser, the metrics), ``state_of`` a request, and the helpers to
run a request's streams (``merge``, ``until_disconnect``, ``final_output``) and name it (``new_id``). It imports
no router and not the app: every router imports it, and ``app.py`` assembles them."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from mili.engine.async_llm import AsyncLLM
from mili.engine.media import ImageRef, MediaPolicy, check_images
from mili.outputs import RequestOutput
from mili.sampling_params import SamplingParams
from mili.server.errors import APIError
from mili.server.metrics import Metrics
from mili.server.step_stream import Events, StepStream
from mili.server_options import EFFORT_BUDGETS, effort_budgets
from mili.tokenizer.tool_parsers import resolve_tool_call_parser

log = logging.getLogger("mili")
_RECENT = 1000  # requests remembered for /status


@dataclass(frozen=True)
class ReasoningBudgets:
    """The server's thinking budgets: ``default`` (--reasoning-budget; None: no limit), ``message``
    (--reasoning-budget-message) and ``efforts`` (--reasoning-effort-budgets, over every effort)."""

    default: int | None = None
    message: str | None = None
    efforts: dict[str, int | None] = field(default_factory=lambda: effort_budgets(EFFORT_BUDGETS))

    def budget(self, asked: int | None, effort: str | None) -> int | None:
        """A request's budget: its own (thinking_token_budget, budget_tokens), else its effort's, else the server's."""
        if asked is not None:
            return asked
        if effort is not None:
            return self.efforts[effort]
        return self.default


class ServerState:
    def __init__(self, engine: AsyncLLM, model_name: str, api_key: str | None, max_queued_requests: int,
                 sampling_defaults: dict | None = None, tool_call_parser: str = "auto", api_servers=None,
                 reasoning: ReasoningBudgets | None = None):
        self.engine = engine
        self.reasoning = reasoning or ReasoningBudgets()
        if not engine.inputs.thinks:  # (the server's budgets are for thinking models; a request's own is refused)
            self.reasoning = ReasoningBudgets(None, None, dict.fromkeys(self.reasoning.efforts))
        self.api_servers = api_servers  # one of several API processes (mili.server.api_servers): the others
        self.tokenizer = engine.tokenizer
        # the form the model writes tool calls in: hermes (Qwen3) or qwen3_xml (Qwen3.5/3.6), from its template
        self.tool_call_parser = resolve_tool_call_parser(tool_call_parser, self.tokenizer)
        self.model_name = model_name
        self.api_key = api_key
        self.max_queued_requests = max_queued_requests
        # for requests that leave temperature/top_p/top_k unset: the config file's sampling section
        # (mili serve --config), else the checkpoint's generation_config.json (OpenAI API only)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.openai_defaults = {**engine.generation_defaults, **self.sampling_defaults}
        # (several API processes: their series summed; the engine's running totals counted by the first only)
        self.metrics = Metrics(model_name, count_engine_totals=api_servers is None or api_servers.index == 0,
                               task=engine.inputs.task.name)
        self.metrics.update_gauges(engine.info.stats)  # the first snapshot for /health
        engine.on_step = lambda msg, outputs: self.metrics.on_step(msg, outputs, engine.live_request_ids())
        self.media = MediaPolicy.from_config(engine.config)  # where a chat's images may come from
        self.created = int(time.time())
        self.statuses: OrderedDict[str, _Status] = OrderedDict()
        self.loras: dict = {}  # LoRA adapters served by name (mili.lora.LoRARequest)
        self._lora_ids = 0
        self.runtime_lora_updating = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter on

    # -- requests ------------------------------------------------------------------------------
    def check_model(self, model: str | None):
        """The LoRA adapter a request's ``model`` names (a mili.lora.LoRARequest), None for the base model; 404 for
        a name the server does not serve."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model",
                           "model_not_found")
        return lora

    def add_lora(self, name: str, path: str):
        """Serve a LoRA adapter under ``name`` (--lora-modules, /v1/load_lora_adapter): checked against the base
        model here (the engine core checks it again when a request first uses it)."""
        from mili.errors import InvalidRequest
        from mili.lora import Adapter, LoRARequest, config_layers

        if not self.engine.config.enable_lora:
            raise InvalidRequest("this server was started without --enable-lora", param="lora_name")
        if not name or name == self.model_name or name in self.loras:
            raise InvalidRequest(f"the model name {name!r} is taken (the base model's, or an adapter's already "
                                 "loaded)", param="lora_name")
        self._lora_ids += 1
        lora = LoRARequest(name, self._lora_ids, path)
        Adapter.load(lora, config_layers(self.engine.model_config), self.engine.config.max_lora_rank)
        self.loras[name] = lora
        return lora

    def check_queue(self) -> None:
        waiting = self.engine.num_unscheduled  # sent to the core, no token back yet
        if waiting >= self.max_queued_requests:
            raise APIError(503, f"the server is busy: {waiting} requests are waiting", "server_error",
                           None, "queue_full", headers={"Retry-After": "1"})

    async def start(self, prompts: list[str | list[int]], params: list[SamplingParams], base_id: str,
                    images: list[list[ImageRef]] | None = None, lora=None) -> list[AsyncIterator[RequestOutput]]:
        """Add one engine request per prompt (all or none) and return their output streams. ``images``: each
        prompt's image parts (a rendered chat's, its prompt token ids), loaded here; ``lora``: the LoRA adapter
        they run with (``check_model``'s)."""
        ids = self._ids(base_id, len(prompts))
        await self._add(ids, prompts, params, images, lora=lora)
        streams = [self._tracked(rid, self.engine.stream(rid), sp) for rid, sp in zip(ids, params)]
        for rid, stream in zip(ids, streams):
            # a response whose body is never iterated (client gone before it started) still ends its
            # request: when the stream object goes, the request is aborted (a no-op once finished)
            weakref.finalize(stream, self.engine.abort, rid)
        return streams

    async def start_stream(self, prompts: list[str | list[int]], params: list[SamplingParams], base_id: str,
                           events: Events, images: list[list[ImageRef]] | None = None, first: bytes = b"",
                           lora=None) -> StepStream:
        """Add one engine request per prompt (all or none), streamed by the output loop as ``events`` makes
        them, after ``first`` (server/step_stream.py): the response to return."""
        ids = self._ids(base_id, len(prompts))
        response = StepStream(events, ids, self._abort, first)
        await self._add(ids, prompts, params, images, response.parts(), lora)
        response.track = [self._status(rid, sp) for rid, sp in zip(ids, params)]  # (before any output comes)
        return response

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        status = self.statuses.get(request_id)
        if status is not None and (status.out is None or not status.out.finished):
            status.aborted = True

    @staticmethod
    def _ids(base_id: str, count: int) -> list[str]:
        return [base_id] if count == 1 else [f"{base_id}-{i}" for i in range(count)]

    async def _add(self, ids: list[str], prompts: list, params: list[SamplingParams],
                   images: list[list[ImageRef]] | None = None, sinks: list | None = None, lora=None) -> None:
        self.check_queue()
        loaded = [await self.load_images(p, refs) for p, refs in zip(prompts, images)] if images else None
        added = []
        try:
            for i, (rid, prompt, sp) in enumerate(zip(ids, prompts, params)):
                sink = sinks[i] if sinks else None
                if loaded and loaded[i]:
                    await self.engine.add_request_with_images(rid, prompt, sp, loaded[i], sink)
                else:
                    self.engine.add_request(rid, prompt, sp, sink, lora)
                added.append(rid)
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            raise

    async def load_images(self, token_ids: list[int], refs: list[ImageRef]) -> list | None:
        """The PIL images a chat's image parts name, checked first (the model takes images, not too many, the
        template placed them) and each fetched and decoded in a worker thread, off the event loop."""
        if not refs:
            return None
        check_images(refs, token_ids, self.engine.inputs.images, self.engine.config.limit_mm_per_prompt["image"])
        return [await asyncio.to_thread(self.media.load, ref) for ref in refs]

    async def with_images(self, token_ids: list[int], refs: list[ImageRef]) -> list[int]:
        """The prompt as the engine will see it: each image's placeholder expanded to its tokens (for counts)."""
        images = await self.load_images(token_ids, refs)
        if not images:
            return token_ids
        return (await asyncio.to_thread(self.engine.inputs.images.prepare, token_ids, images))[0]

    def _status(self, rid: str, params: SamplingParams) -> _Status:
        """A new request's /status entry (the latest output is kept on it, read only when asked)."""
        status = self.statuses[rid] = _Status(params.max_tokens)
        while len(self.statuses) > _RECENT:
            self.statuses.popitem(last=False)
        return status

    async def _tracked(self, rid: str, stream: AsyncIterator[RequestOutput], params: SamplingParams,
                       ) -> AsyncIterator[RequestOutput]:
        """The request's stream, keeping its latest output for /status (read there, not built per step)."""
        status = self._status(rid, params)
        try:
            async for out in stream:
                status.out = out
                yield out
        finally:
            status.aborted = status.out is None or not status.out.finished


class _Status:
    """One request's progress, as /status reports it."""

    __slots__ = ("max_tokens", "out", "aborted")

    def __init__(self, max_tokens: int | None):
        self.max_tokens, self.out, self.aborted = max_tokens, None, False

    def as_dict(self) -> dict:
        out = self.out
        generated = max((len(o.token_ids) for o in out.outputs), default=0) if out is not None else 0
        finished = out is not None and out.finished
        remaining = 0 if finished else self.max_tokens - generated if self.max_tokens else None
        return {"status": "aborted" if self.aborted else "completed" if finished else "processing",
                "tokens_generated": generated, "tokens_remaining": remaining}


def state_of(http: Request) -> ServerState:
    """The server's state, from a route's request (``build_app`` keeps it on the app)."""
    return http.app.state.mili


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as their outputs come: (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await q.put((i, out))
        except BaseException as e:
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await q.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(http_request: Request, work):
    """Await ``work`` (a coroutine), cancelling it if the client goes away first."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            return task.result()
        if await http_request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "client disconnected", "invalid_request_error")


async def final_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last (finished) output of one request's stream."""
    out = None
    async for out in stream:
        pass
    return out


def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


