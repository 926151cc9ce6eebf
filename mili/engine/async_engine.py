"""AsyncEngine: the engine loop on a background thread, each request an async stream of outputs.

The model runs on its own thread so the event loop never waits on it. Requests are added under a lock
(from a worker thread, so the loop does not block either); aborts are queued and applied at the start of
the next step, so a client that leaves frees its KV pages within one engine step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from mili.engine.engine import LLMEngine
from mili.errors import EngineDeadError
from mili.outputs import RequestOutput
from mili.sampling_params import SamplingParams

log = logging.getLogger("mili")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after every step (metrics)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="mili-engine", daemon=True)
        self._thread.start()

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._wake.wait(timeout=0.5)
                with self._lock:
                    while not self._aborts.empty():
                        self.engine.abort_request(self._aborts.get())
                    if not self.engine.has_unfinished_requests():
                        self._wake.clear()
                        outputs = []
                    else:
                        outputs = self.engine.step()
                    if self.on_step is not None:
                        self.on_step(self.engine, outputs)
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as e:  # a bug or an OOM: fail every stream rather than hang them
            log.exception("the engine loop died")
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"the engine stopped: {e}"))

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    # -- the async side ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          on_added: Callable[[], None] | None = None):
        """Validate and queue a request (raises InvalidRequest etc.); returns the engine's Request.
        ``on_added`` runs on the worker thread, under the engine lock, once the request is queued."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        loop = asyncio.get_running_loop()
        self._streams[request_id] = (loop, asyncio.Queue())

        def add():
            with self._lock:
                request = self.engine.add_request(prompt, params, request_id)
                if on_added is not None:
                    on_added()
                return request

        try:
            request = await loop.run_in_executor(None, add)
        except BaseException:  # invalid, or cancelled (the add may still happen: abort it too)
            self.discard(request_id)
            raise
        self._wake.set()
        return request

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a request added with add_request; aborts it if the consumer stops early."""
        _, q = self._streams[request_id]
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        await self.add_request(request_id, prompt, params)
        async for out in self.stream(request_id):
            yield out

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._wake.set()

    def discard(self, request_id: str) -> None:
        """Abort a request whose stream will never be read."""
        self._streams.pop(request_id, None)
        self.abort(request_id)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
