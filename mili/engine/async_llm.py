"""AsyncLLM: the server's engine. The engine core runs in its own process; this side tokenizes, validates,
and turns the core's one-message-per-step deltas into per-request asyncio streams.

    API process                                   engine core process (mili.engine.core_process)
    add_request ── AddRequest ──► ZMQ PUSH/PULL ──► drain inputs, step, send one StepMessage per step
    output loop ◄── StepMessage ◄── ZMQ PUSH/PULL ◄──┘
      OutputProcessor: detokenize, stop strings (→ FinishSeqs to the core), per-request queues

One event-loop wake-up per step message. If the core dies, every open stream gets an
``EngineDeadError`` and ``on_dead`` runs (the server exits non-zero); if this process dies, the core
follows it (PR_SET_PDEATHSIG, and a parent check in its loop).

With ``mili serve --api-server-count N`` the ``mili serve`` process starts the core (``SharedCore``) and
N API processes each connect an ``AsyncLLM`` to it through a ``CoreLink``: each binds its own socket pair,
and the core sends each request's outputs back to the process that added it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, Protocol

import zmq
import zmq.asyncio

from mili.config import EngineConfig
from mili.engine.input_processor import InputProcessor
from mili.engine.messages import (Abort, AddRequest, Dead, FinishSeqs, Ready, Shutdown, StepMessage, encode,
                                  output_decoder)
from mili.engine.output_processor import OutputProcessor
from mili.errors import EngineDeadError, InvalidRequest, ModelLoadError, RequestFailed
from mili.outputs import RequestOutput
from mili.sampling_params import SamplingParams

log = logging.getLogger("mili")
_LIVENESS_S = 0.2  # the output loop checks that the core is alive this often when no message comes


class CoreLink(NamedTuple):
    """An engine core another process started and shares (``mili serve --api-server-count``): this API
    process's index among those it serves, the prefix of its socket pair's IPC paths, the core's pid."""

    index: int
    ipc: str
    core_pid: int


class AsyncLLM:
    def __init__(self, config: EngineConfig, core_in_thread: bool = False, link: CoreLink | None = None,
                 while_loading: Callable[[], object] | None = None):
        """Start the engine core (in a process; ``core_in_thread`` for tests) and wait until it has loaded
        the model, or with ``link`` connect to a core another process started. ``while_loading``: the caller's
        own start-up, run while the core loads (the server's modules). Raises ModelLoadError / InvalidRequest if it
        cannot."""
        self.inputs = InputProcessor(config)  # fails fast on a bad checkpoint, before the core starts
        self.outputs = OutputProcessor(self.inputs.tokenizer)
        self._streams: dict[str, _Collector] = {}  # each request's outputs waiting for its consumer
        self._unscheduled: set[str] = set()  # added, no output yet: the queue the server limits
        self.error: EngineDeadError | None = None
        self.on_step: Callable[[StepMessage, list[RequestOutput]], None] | None = None  # metrics
        self.on_dead: Callable[[], None] | None = None
        self._ctx = zmq.Context()
        ipc = ipc_prefix() if link is None else link.ipc
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.bind(f"ipc://{ipc}-in")
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.bind(f"ipc://{ipc}-out")
        self.core = None  # the EngineCore itself, when it runs in a thread
        self.client_index = 0 if link is None else link.index  # (sent with each request to a shared core)
        self._owns_core = link is None
        if link is not None:
            self._worker = SharedCoreProcess(link.core_pid)
        elif core_in_thread:
            from mili.engine.core import EngineCore
            from mili.engine.core_process import run_core

            self.core = EngineCore(config, self.inputs.model_config, self.inputs.model_path)
            self._worker = threading.Thread(target=run_core, args=(lambda: self.core, f"ipc://{ipc}-in",
                                            f"ipc://{ipc}-out"), name="mili-engine-core", daemon=True)
            self._worker.start()
        else:
            from mili.engine.core_start import start_core

            self._worker = start_core(config, self.inputs.model_config, self.inputs.model_path, f"ipc://{ipc}-in",
                                      f"ipc://{ipc}-out", os.getpid(), logging.getLogger("mili").getEffectiveLevel())
        if while_loading is not None:
            while_loading()
        self.info = wait_ready(self._from_core, self._worker)
        self.inputs.core_ready(self.info)  # (its batch limits, auto sized by its device, in self.config)
        self._task: asyncio.Task | None = None

    # what the server reads
    config = property(lambda self: self.inputs.config)
    tokenizer = property(lambda self: self.inputs.tokenizer)
    model_path = property(lambda self: self.inputs.model_path)
    model_config = property(lambda self: self.inputs.model_config)
    generation_defaults = property(lambda self: self.inputs.generation_defaults)
    max_model_len = property(lambda self: self.info.max_model_len)

    def _alive(self) -> bool:
        return self._worker.is_alive()

    # -- the output loop (on the event loop) ---------------------------------------------------
    def start(self) -> None:
        """Start reading the core's messages; call from the running event loop (the server's startup)."""
        self._task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        sock = zmq.asyncio.Socket.from_socket(self._from_core)
        try:
            while True:
                if not await sock.poll(_LIVENESS_S * 1000):
                    if not self._alive():
                        return self._fail("the engine core process exited")
                    continue
                msg = output_decoder.decode(await sock.recv())
                if isinstance(msg, Dead):
                    return self._fail(msg.reason)
                if isinstance(msg, StepMessage):
                    self._handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug on this side: fail loudly rather than hang every stream
            log.exception("the engine output loop failed")
            self._fail(f"{type(e).__name__}: {e}")

    def _handle(self, msg: StepMessage) -> None:
        outputs, stopped, failed = self.outputs.process(msg.deltas)
        if stopped:
            self._to_core.send(encode(FinishSeqs(stopped)))
        if failed:  # their output could not be processed here: the core stops computing them
            self._to_core.send(encode(Abort([request_id for request_id, _ in failed])))
            msg.failures = [*msg.failures, *failed]
        streams, unscheduled = self._streams, self._unscheduled
        for out in outputs:
            unscheduled.discard(out.request_id)
            c = streams.pop(out.request_id, None) if out.finished else streams.get(out.request_id)
            if c is not None:
                c.put(out)
        for errors, kind in ((msg.errors, InvalidRequest), (msg.failures, RequestFailed)):
            for request_id, message in errors:  # refused when added (400), or failed while running (500)
                self.outputs.remove(request_id)
                unscheduled.discard(request_id)
                c = streams.pop(request_id, None)
                if c is not None:
                    c.put(kind(message))
        if self.on_step is not None:
            self.on_step(msg, outputs)

    def _fail(self, reason: str) -> None:
        if self.error is not None:
            return
        log.error("the engine core stopped: %s", reason)
        self.error = EngineDeadError(f"the engine stopped: {reason}")
        for c in list(self._streams.values()):
            c.put(self.error)
        self._streams.clear()
        self.outputs.requests.clear()
        self._unscheduled.clear()
        if self.on_dead is not None:
            self.on_dead()

    # -- requests -------------------------------------------------------------------------------
    @property
    def num_unscheduled(self) -> int:
        return len(self._unscheduled)

    def live_request_ids(self):
        return self.outputs.requests.keys()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    sink: OutputSink | None = None, lora=None) -> None:
        """Validate and send one request (raises InvalidRequest etc.); read it with ``stream``, or have each
        step's output (and an error, in its place) handed to ``sink.put`` by the output loop as it comes.
        ``lora``: its LoRA adapter (mili.lora.LoRARequest)."""
        self._check_new(request_id)
        self._send(self.inputs.make_request(prompt, params, request_id, lora=lora), prompt, sink)

    async def add_request_with_images(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                                      images: list, sink: OutputSink | None = None) -> None:
        """``add_request`` for a prompt with images (PIL images, one per image placeholder: engine/image_inputs.py),
        processed in a worker thread: resizing a large image takes long enough to stall every stream."""
        self._check_new(request_id)
        add = await asyncio.to_thread(self.inputs.make_request, prompt, params, request_id, images)
        self._check_new(request_id)  # (still: the engine may have stopped meanwhile)
        self._send(add, prompt, sink)

    def _check_new(self, request_id: str) -> None:
        if self.error is not None:
            raise self.error
        if request_id in self.outputs.requests or request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")

    def _send(self, add: AddRequest, prompt: str | list[int], sink: OutputSink | None) -> None:
        request_id = add.request_id
        if self.client_index:
            add.client = self.client_index
        self.outputs.add(add, prompt if isinstance(prompt, str) else None)
        self._streams[request_id] = _Collector() if sink is None else sink
        self._unscheduled.add(request_id)
        self._to_core.send(encode(add))

    def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a request just added with add_request (no sink); aborts it if the consumer stops early."""
        return self._read(request_id, self._streams[request_id])

    async def _read(self, request_id: str, collector: _Collector) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = collector.item
                if item is None:
                    item = await collector.wait()
                collector.item = None
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       images: list | None = None) -> AsyncIterator[RequestOutput]:
        if images:
            await self.add_request_with_images(request_id, prompt, params, images)
        else:
            self.add_request(request_id, prompt, params)
        async for out in self.stream(request_id):
            yield out

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._unscheduled.discard(request_id)
        if request_id in self.outputs.requests:
            self.outputs.remove(request_id)
            if self.error is None:
                self._to_core.send(encode(Abort([request_id])))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the core to stop and wait for it (then kill it); idempotent."""
        if self._ctx.closed:
            return
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._owns_core and self._alive():  # (a shared core is its starter's to stop)
            try:
                self._to_core.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._worker.join(timeout)
            if self._alive() and hasattr(self._worker, "kill"):
                self._worker.kill()
                self._worker.join(5)
        self._to_core.close(0)
        self._from_core.close(0)
        self._ctx.term()

    @property
    def core_pid(self) -> int | None:
        """The engine core process's pid (None when it runs in a thread)."""
        return getattr(self._worker, "pid", None)

    @property
    def exitcode(self) -> int | None:
        return getattr(self._worker, "exitcode", None)


class OutputSink(Protocol):
    """Where the output loop hands a request's outputs: each step's, then its last (finished) one, or an error
    in place of the rest (EngineDeadError, InvalidRequest, RequestFailed). Called on the event loop, within the
    step's handling: it must not block."""

    def put(self, item: RequestOutput | BaseException) -> None: ...


class _Collector:
    """One request's outputs on their way to its consumer (vLLM's RequestOutputCollector): at most one unread
    item, a later output merged into it (``_merge``) and an error taking its place, and a future that wakes
    the consumer when it waits. Putting costs no event-loop call unless the consumer waits; a consumer that
    falls behind reads one merged output for several steps."""

    __slots__ = ("item", "waiter")

    def __init__(self):
        self.item: RequestOutput | BaseException | None = None
        self.waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        earlier = self.item
        if earlier is None or isinstance(item, BaseException):
            self.item = item  # an error takes the place of what is unread
        elif not isinstance(earlier, BaseException):  # (an unread error stays: nothing follows it)
            self.item = _merge(earlier, item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> RequestOutput | BaseException:
        """The next item, once there is one."""
        while self.item is None:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.item


def wait_ready(sock: zmq.Socket, worker) -> Ready:
    """The core's ``Ready`` from ``sock`` once it has loaded the model. Its ``Dead`` raises ModelLoadError (the
    checkpoint) or EngineDeadError, as does ``worker`` (its process or thread) exiting without a word."""
    while True:
        if sock.poll(200):
            msg = output_decoder.decode(sock.recv())
            if isinstance(msg, Ready):
                return msg
            if isinstance(msg, Dead):
                worker.join(10)
                raise (ModelLoadError(msg.reason) if msg.load_error else
                       EngineDeadError(f"the engine core failed while loading: {msg.reason}"))
        elif not worker.is_alive():
            raise EngineDeadError(f"the engine core exited while loading the model (exit code "
                                  f"{getattr(worker, 'exitcode', None)})")


def ipc_prefix() -> str:
    """A fresh path prefix for a pair of IPC sockets (``-in`` and ``-out`` are appended)."""
    return os.path.join(tempfile.gettempdir(), f"mili-{os.getpid()}-{uuid.uuid4().hex[:8]}")


class SharedCoreProcess:
    """The engine core as an API process that did not start it sees it: alive or not, by its pid."""

    def __init__(self, pid: int):
        self.pid, self.exitcode = pid, None

    def is_alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:  # (a zombie not yet reaped by its parent is dead)
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return not os.path.isdir("/proc/self") and _pid_exists(self.pid)

    def join(self, timeout: float | None = None) -> None:
        pass


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _merge(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two queued outputs of one request as one: the later (its token and logprob lists are the live ones,
    so they hold both steps), with the text deltas of both. A consumer that falls behind under load
    then sends one event for several steps instead of one per step (vLLM's output collector does this)."""
    deltas = {o.index: o.delta for o in earlier.outputs}
    for o in later.outputs:
        o.delta = deltas.get(o.index, "") + o.delta
    return later
