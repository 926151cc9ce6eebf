"""StepStream (server/step_stream.py) in-process, against a fake ASGI connection: the output loop's writes in
order however slowly the client reads, the end once, the requests aborted when the client goes, a formatter's
failure an error event rather than the output loop's."""

from __future__ import annotations

import asyncio

import pytest

from mili.outputs import CompletionOutput, RequestOutput
from mili.server.step_stream import StepStream, run_eagerly


def _out(rid: str, delta: str, finished: bool = False) -> RequestOutput:
    o = CompletionOutput(index=0, text=delta, token_ids=[1], delta=delta,
                         finish_reason="length" if finished else None)
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[1], outputs=[o], finished=finished)


class _Events:
    def __init__(self, fail_on: str | None = None):
        self.fail_on = fail_on

    def feed(self, index: int, out: RequestOutput) -> bytes:
        if out.outputs[0].delta == self.fail_on:
            raise ValueError("a formatting bug")
        return f"{index}:{out.outputs[0].delta};".encode()

    def end(self) -> bytes:
        return b"END"

    def fail(self, error: BaseException) -> bytes:
        return f"ERR {error};".encode()


class _Connection:
    """uvicorn's side of one response: ``send`` waits (flow control) while ``paused``; ``receive`` returns the
    disconnect once the response is complete or the client has gone."""

    def __init__(self):
        self.sent: list[tuple[bytes, bool]] = []
        self.paused: asyncio.Future | None = None
        self.done = asyncio.Event()

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            return
        if self.paused is not None:
            await self.paused
        self.sent.append((message["body"], message["more_body"]))
        if not message["more_body"]:
            self.done.set()

    async def receive(self) -> dict:
        await self.done.wait()
        return {"type": "http.disconnect"}

    def body(self) -> bytes:
        return b"".join(body for body, _ in self.sent)


def _two_requests(events: _Events | None = None):
    """A StepStream over requests "a" and "b", their sinks, a fake connection, and the list of aborted ids."""
    aborted: list[str] = []
    stream = StepStream(events or _Events(), ["a", "b"], aborted.append)
    a, b = stream.parts()
    return stream, a, b, _Connection(), aborted


def test_run_eagerly_runs_in_place_and_hands_a_wait_to_a_task():
    async def main():
        trace = []

        async def quick():
            trace.append("quick")

        assert run_eagerly(quick()) is None and trace == ["quick"]  # done before run_eagerly returned
        gate = asyncio.get_running_loop().create_future()

        async def waits():
            trace.append("before")
            trace.append(await gate)

        task = run_eagerly(waits())
        assert task is not None and trace[-1] == "before"
        gate.set_result("after")
        await task
        assert trace[-1] == "after"

        async def fails():
            raise KeyError("at once")

        with pytest.raises(KeyError):
            run_eagerly(fails())

    asyncio.run(main())


def test_slow_client_gets_every_event_in_order_and_the_end_once():
    async def main():
        stream, a, b, conn, aborted = _two_requests()
        a.put(_out("a", "x"))  # before the response started: kept
        response = asyncio.ensure_future(stream(None, conn.receive, conn.send))
        await asyncio.sleep(0)
        conn.paused = asyncio.get_running_loop().create_future()  # the client stops reading
        b.put(_out("b", "y"))
        a.put(_out("a", "z", finished=True))
        b.put(_out("b", "w"))
        assert conn.body() == b"0:x;"  # the rest waits behind the paused write
        conn.paused.set_result(None)
        conn.paused = None
        await asyncio.sleep(0.01)
        b.put(_out("b", "v", finished=True))
        b.put(_out("b", "late"))  # after the end: ignored
        await asyncio.wait_for(response, 5)
        assert conn.body() == b"0:x;1:y;0:z;1:w;1:v;END"
        assert [more for _, more in conn.sent].count(False) == 1 and conn.sent[-1][1] is False
        assert aborted == []

    asyncio.run(main())


def test_client_gone_aborts_the_unfinished_requests():
    async def main():
        stream, a, b, conn, aborted = _two_requests()
        response = asyncio.ensure_future(stream(None, conn.receive, conn.send))
        a.put(_out("a", "x"))
        await asyncio.sleep(0)
        conn.done.set()  # the client disconnects
        await asyncio.wait_for(response, 5)
        assert aborted == ["a", "b"]
        a.put(_out("a", "y"))  # the output loop may still hand one over: nothing is sent
        assert conn.body() == b"0:x;"

    asyncio.run(main())


@pytest.mark.parametrize("failure", ["engine", "formatter"])
def test_an_error_ends_the_stream_with_the_error_event_and_aborts_the_rest(failure):
    async def main():
        stream, a, b, conn, aborted = _two_requests(_Events(fail_on="boom"))
        response = asyncio.ensure_future(stream(None, conn.receive, conn.send))
        await asyncio.sleep(0)
        a.put(_out("a", "x"))
        if failure == "engine":
            b.put(RuntimeError("core died"))
        else:
            b.put(_out("b", "boom"))  # raises in feed: the output loop must not see it
        await asyncio.wait_for(response, 5)
        message = "core died" if failure == "engine" else "a formatting bug"
        assert conn.body() == f"0:x;ERR {message};".encode() and conn.sent[-1][1] is False
        assert aborted == ["a", "b"]

    asyncio.run(main())


def test_under_uvicorn_events_go_straight_to_the_transport_and_a_stalled_reader_loses_nothing(monkeypatch):
    """Through a real uvicorn (httptools) and a real socket: events are written as chunks by ChunkWriter (no
    ``send`` per event), and while the client does not read, the transport pauses and the events wait in the
    backlog behind ``send``, then arrive whole and in order."""
    import httpx
    import uvicorn

    from mili.server.step_stream import ChunkWriter, with_raw_send

    direct = []
    write = ChunkWriter.write

    def counting(self, data):
        took = write(self, data)
        direct.append(took)
        return took

    monkeypatch.setattr(ChunkWriter, "write", counting)
    big = "z" * 65536  # events large enough to fill the socket's buffers while nobody reads

    async def main():
        streams: list[StepStream] = []

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            stream = StepStream(_Events(), ["a"], lambda rid: None)
            streams.append(stream)
            await stream(scope, receive, send)

        config = uvicorn.Config(with_raw_send(app), host="127.0.0.1", port=0, http="httptools", loop="asyncio",
                                lifespan="off", log_level="warning")
        server = uvicorn.Server(config)
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("GET", f"http://127.0.0.1:{port}/") as r:
                    while not streams:  # (appended as the response starts: __call__ runs to its first await)
                        await asyncio.sleep(0.01)
                    (part,) = streams[0].parts()
                    for i in range(3):
                        part.put(_out("a", f"small{i}"))
                    assert direct == [True] * 3  # (each through uvicorn's shortcut: ChunkWriter.write took it)
                    for i in range(100):  # ~6.5 MB, not read yet
                        part.put(_out("a", f"{i}{big}"))
                        await asyncio.sleep(0)
                    assert False in direct  # the transport paused: those went behind send
                    part.put(_out("a", "last", finished=True))
                    body = b"".join([chunk async for chunk in r.aiter_bytes()])
            expected = "".join([f"0:small{i};" for i in range(3)] + [f"0:{i}{big};" for i in range(100)])
            assert body == (expected + "0:last;END").encode()
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)

    asyncio.run(main())
