"""Streamed responses written by the engine's output loop itself, once a step, with no task per stream.

A route that streams the usual way returns a ``StreamingResponse`` over an async generator: each step, the
output loop wakes every stream's task, each task resumes a chain of generators (the engine's, the route's),
formats its event and awaits ``send`` through Starlette's response. With hundreds of streams that wake-up
and that chain cost more than the event itself. A ``StepStream`` is the other way round:

    output loop (one per step) ── for each of the step's outputs ──► StepStream.put ── events.feed ──► send

``events`` is the dialect's formatter, plain synchronous code (``feed`` an output, ``end`` the stream, ``fail``
it with an error). ``send`` is run eagerly, in place (``run_eagerly``): it writes to the socket without
waiting unless the client reads too slowly, and only then does that stream get a task, and a backlog that
its next writes join. Under uvicorn, once the response has started, an event that needs no waiting skips
``send`` too: ``ChunkWriter`` writes it to the transport as the chunk ``send`` would have written. The
response's own task (uvicorn's, per request) only waits for the end: the last write, or the client going
away, which aborts the requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Protocol

from starlette.responses import Response

from mili.outputs import RequestOutput

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
RAW_SEND = "mili.raw_send"  # the scope key of the server's own send (with_raw_send)


def with_raw_send(app):
    """``app`` with the server's own ``send`` kept in each HTTP request's scope, for a StepStream's events.
    Starlette hands a route's response a ``send`` wrapped three times over (its error middleware and two
    exception handlers: each notes that the response started, nothing more); a StepStream sends its start
    through that, so they know, and its events past them: an eighth of the per-token work otherwise. Outermost,
    around the whole app (uvicorn's app)."""
    async def outermost(scope, receive, send):
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await app(scope, receive, send)

    return outermost


class Events(Protocol):
    """A dialect's stream of events over one or more requests (``index``: which), as bytes to send."""

    def feed(self, index: int, out: RequestOutput) -> bytes: ...

    def end(self) -> bytes: ...  # after every request has finished (a usage event, a terminator)

    def fail(self, error: BaseException) -> bytes: ...  # in place of the rest (an error event, a terminator)


class ChunkWriter:
    """An event written straight to uvicorn's transport as one HTTP/1.1 chunk, exactly as uvicorn's own ``send``
    writes a body part (``b"%x\\r\\n" % len(body) + body + b"\\r\\n"``), without what that costs per event: the
    message dict, the coroutine and uvicorn's checks. Only for uvicorn's httptools protocol (MILI's
    dependencies), with a chunked response started and the transport writable; else (``write`` answers False)
    the event goes through ``send``, which waits for a slow reader, or returns once the client has gone.
    ``of`` answers None for any other server, or a uvicorn whose internals differ (tests/unit/test_step_stream.py
    checks that MILI's uvicorn takes this path)."""

    __slots__ = ("cycle", "flow", "transport_write")

    def __init__(self, cycle):
        self.cycle, self.flow, self.transport_write = cycle, cycle.flow, cycle.transport.write

    @classmethod
    def of(cls, send) -> ChunkWriter | None:
        cycle = getattr(send, "__self__", None)  # (uvicorn's send is its RequestResponseCycle's method)
        if (type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl"
                or not all(hasattr(cycle, a) for a in ("flow", "transport", "disconnected", "response_complete"))
                or getattr(cycle, "chunked_encoding", None) is not True or not hasattr(cycle.flow, "write_paused")):
            return None
        return cls(cycle)

    def write(self, data: bytes) -> bool:
        """Write ``data`` (not empty, not the last) now; False where ``send`` must take it instead."""
        cycle = self.cycle
        if self.flow.write_paused or cycle.disconnected or cycle.response_complete:
            return False
        self.transport_write(b"%x\r\n%b\r\n" % (len(data), data))
        return True


def run_eagerly(coro: Coroutine) -> asyncio.Task | None:
    """Run ``coro`` now, as far as it goes without waiting: None if it finished so, else a task that finishes
    it (Python 3.12's eager tasks, for 3.11). An exception it raises at once is raised here."""
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_resume(coro, waiting_on))


async def _resume(coro: Coroutine, waiting_on) -> None:
    """Drive ``coro`` on from where it yielded ``waiting_on`` (a future, or None for a bare yield), as a task's
    step would."""
    while True:
        try:
            if waiting_on is not None:
                waiting_on._asyncio_future_blocking = False
                await waiting_on
            else:
                await asyncio.sleep(0)
        except BaseException as e:  # (cancelled: the coroutine sees it where it waits)
            try:
                waiting_on = coro.throw(e)
            except StopIteration:
                return
            continue
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return


class _Part:
    """One request of a StepStream over several, as the engine's output loop sees it (an ``OutputSink``)."""

    __slots__ = ("stream", "index")

    def __init__(self, stream: StepStream, index: int):
        self.stream, self.index = stream, index

    def put(self, item: RequestOutput | BaseException) -> None:
        self.stream.put(item, self.index)


class StepStream(Response):
    """The SSE response of ``request_ids`` (already added to the engine with ``parts()`` as their sinks), its
    events made by ``events``, after ``first`` (the dialect's opening events, sent with the headers).
    ``abort(request_id)`` stops a request whose client has gone. ``track``, if set: one object per request whose
    ``out`` is kept at its latest output (the server's /status)."""

    def __init__(self, events: Events, request_ids: list[str], abort: Callable[[str], None], first: bytes = b""):
        self.background = None  # (what FastAPI reads of a Response before calling it)
        self.status_code = 200
        self.events, self.request_ids, self.abort = events, request_ids, abort
        self.track: list | None = None
        self.open = len(request_ids)  # requests not finished yet
        self.ended = False  # the last bytes are written (or being written)
        self._send = None  # the ASGI send, once the response has started
        self._chunks: ChunkWriter | None = None  # its shortcut (uvicorn's), where there is one
        self._backlog: list[bytes] = [first] if first else []  # bytes waiting for the send before them (or the start)
        self._writing: asyncio.Task | None = None  # a send waiting for a slow client

    def parts(self) -> list[StepStream | _Part]:
        """The requests' sinks, in order (one request's is the stream itself: one call less per token)."""
        return [self] if len(self.request_ids) == 1 else [_Part(self, i) for i in range(len(self.request_ids))]

    # -- from the output loop ----------------------------------------------------------------------
    def put(self, item: RequestOutput | BaseException, index: int = 0) -> None:
        if self.ended:
            return
        try:
            if isinstance(item, BaseException):
                return self._end(self.events.fail(item), abort_rest=True)
            if self.track is not None:
                self.track[index].out = item
            data = self.events.feed(index, item)
            if item.finished:
                self.open -= 1
                if not self.open:
                    return self._end(data + self.events.end())
        except Exception as e:  # a formatting bug ends this stream with an error event, not the output loop
            return self._end(self.events.fail(e), abort_rest=True)
        if data:
            self._write(data, last=False)

    def _end(self, data: bytes, abort_rest: bool = False) -> None:
        self.ended = True
        if abort_rest:
            self._abort_all()
        self._write(data, last=True)

    def _abandon(self) -> None:
        """The client has gone (or its connection broke): nothing more to send, the requests stop."""
        if not self.ended:
            self.ended = True
            self._abort_all()

    def _abort_all(self) -> None:
        for rid in self.request_ids:  # (a no-op for those finished or failed)
            self.abort(rid)

    def _write(self, data: bytes, last: bool) -> None:
        if self._send is None or self._writing is not None:  # not started, or a slow client: later, joined
            self._backlog.append(data)
            return
        if not last and self._chunks is not None and self._chunks.write(data):
            return
        try:
            self._writing = run_eagerly(self._send({"type": "http.response.body", "body": data,
                                                    "more_body": not last}))
        except Exception:  # the connection is unusable: as if the client had gone
            return self._abandon()
        if self._writing is not None:
            self._writing.add_done_callback(self._written)

    def _written(self, _task) -> None:
        self._writing = None
        self._flush()

    def _flush(self) -> None:
        if self._backlog:
            data = b"".join(self._backlog)
            self._backlog.clear()
            self._write(data, last=self.ended)

    # -- the response's own task ----------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        self._send = scope.get(RAW_SEND, send) if scope is not None else send
        self._chunks = ChunkWriter.of(self._send)
        self._flush()
        try:
            while (await receive())["type"] != "http.disconnect":
                pass  # (the body was read by the route: this waits for the end, or for the client to go)
        finally:
            self._abandon()  # (if the client went away first)
            if self._writing is not None:
                await asyncio.gather(self._writing, return_exceptions=True)
