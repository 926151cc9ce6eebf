"""The engine core process: ``run_core`` steps an ``EngineCore`` (mili/engine/core.py) and routes its messages.

``run_core`` is the loop of the engine core process (or of a thread, for tests): take new requests and
aborts without blocking, step, send one message per step. If the API process goes away, it exits. With
several API processes (``mili serve --api-server-count``), ``Outputs`` sends each its own requests' outputs.
``core_process_main`` is the process's entry point.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from mili.config import EngineConfig, ModelConfig
from mili.engine.core import EngineCore
from mili.engine.messages import (
    Abort,
    AddRequest,
    ClientGone,
    Dead,
    FinishSeqs,
    Shutdown,
    StepMessage,
    encode,
    input_decoder,
)
from mili.process import die_with_parent, freeze_heap

log = logging.getLogger("mili")
STATS_PERIOD_S = 0.25  # while busy, the gauges refresh this often (and whenever a request ends)


def run_core(core_factory, input_address: str | list[str], output_address: str | list[str],
             parent_pid: int | None = None, control_address: str | None = None) -> int:
    """The engine core's loop; returns when told to shut down (0), or after a failure (1).

    ``core_factory()`` builds the EngineCore (the model loads here). ``parent_pid``: exit if that
    process goes away (None in a thread). Several addresses (``mili serve --api-server-count``): one
    pair per API process, the requests of all of them in one scheduler; ``control_address`` (the
    ``mili serve`` process that started the core) hears only Ready and Dead.
    """
    import zmq

    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)  # (fair-queued from every API process)
    for address in [input_address] if isinstance(input_address, str) else input_address:
        inputs.connect(address)
    sockets = []
    for address in ([output_address] if isinstance(output_address, str) else list(output_address)) + (
            [control_address] if control_address else []):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(address)
        sockets.append(sock)
    outputs = Outputs(sockets[:-1] if control_address else sockets, sockets[-1] if control_address else None)
    core = None
    try:
        try:
            core = core_factory()
        except Exception as e:
            from mili.errors import MiliError

            if not isinstance(e, MiliError):
                log.exception("the engine core failed to load the model")
            outputs.send_all(Dead(str(e), load_error=isinstance(e, MiliError)))
            return 1
        outputs.send_all(core.ready())
        return _loop(core, inputs, outputs, parent_pid)
    except BaseException as e:  # a bug, an OOM: say so, then exit non-zero
        log.exception("the engine core died")
        try:
            outputs.send_all(Dead(f"{type(e).__name__}: {e}"), zmq.NOBLOCK)
        except Exception:
            pass
        return 1
    finally:
        if core is not None:
            core.runner.close()
        inputs.close(0)
        for sock in sockets:
            sock.close()
        ctx.term()


class Outputs:
    """Where the core's messages go: one socket per API process. With one (the usual case) every step
    message goes to it whole; with several, each request's deltas and errors go to the process that sent
    it (``AddRequest.client``), and the engine's gauges (``stats``) to all of them."""

    def __init__(self, sockets: list, control=None):
        self.sockets, self.control = sockets, control
        self.single = sockets[0] if len(sockets) == 1 else None
        self.owner: dict[str, int] = {}  # request id -> its API process (several only)
        self.gone: set[int] = set()  # API processes that exited: nothing more is sent to them

    def send_all(self, msg, flags: int = 0) -> None:
        """Ready and Dead: every API process (and the control socket) hears them."""
        data = encode(msg)
        for i, sock in enumerate(self.sockets + ([self.control] if self.control is not None else [])):
            if i not in self.gone:
                sock.send(data, flags)

    def add(self, add: AddRequest) -> None:
        if self.single is None:
            self.owner[add.request_id] = add.client

    def client_gone(self, core: EngineCore, client: int) -> None:
        """API process ``client`` exited: its requests are aborted, and it is sent nothing more."""
        self.gone.add(client)
        request_ids = [request_id for request_id, owner in self.owner.items() if owner == client]
        if request_ids:
            log.warning("API process %d is gone: %d of its requests aborted", client, len(request_ids))
        core.abort_requests(request_ids)
        self.forget(core, request_ids)

    def forget(self, core: EngineCore, request_ids) -> None:
        """Drop the owners of requests that left the core (aborted, stopped by the API side)."""
        if self.single is None:
            for request_id in request_ids:
                if request_id not in core.requests:
                    self.owner.pop(request_id, None)

    def send_step(self, msg: StepMessage, core: EngineCore) -> None:
        if self.single is not None:
            return self.single.send(encode(msg))
        parts: dict[int, StepMessage] = {}

        def part(client: int) -> StepMessage:
            p = parts.get(client)
            if p is None:
                p = parts[client] = StepMessage([], msg.num_preemptions, msg.stats, [], [])
            return p

        owner, seen = self.owner, set()
        for d in msg.deltas:
            client = owner.get(d.request_id)
            if client is not None:
                part(client).deltas.append(d)
                seen.add(d.request_id)
        for field in ("errors", "failures"):
            for entry in getattr(msg, field):
                client = owner.get(entry[0])
                if client is not None:
                    getattr(part(client), field).append(entry)
                    seen.add(entry[0])
        if msg.stats is not None:
            for client in range(len(self.sockets)):
                part(client)
        for client, p in parts.items():
            if client not in self.gone:
                self.sockets[client].send(encode(p))
        self.forget(core, seen)


def _loop(core: EngineCore, inputs, outputs: Outputs, parent_pid: int | None) -> int:
    stats_at = float("-inf")
    idle_stats_sent = False
    while True:
        while inputs.poll(0):  # take everything that arrived, never blocking
            msg = input_decoder.decode(inputs.recv())
            if isinstance(msg, AddRequest):
                outputs.add(msg)
                try:
                    core.add_request(msg)
                except Exception as e:
                    error = (msg.request_id, f"{type(e).__name__}: {e}")
                    outputs.send_step(StepMessage([], core.scheduler.num_preemptions, errors=[error]), core)
            elif isinstance(msg, Abort):
                core.abort_requests(msg.request_ids)
                outputs.forget(core, msg.request_ids)
            elif isinstance(msg, FinishSeqs):
                core.finish_seqs(msg.seqs)
                outputs.forget(core, [request_id for request_id, _ in msg.seqs])
            elif isinstance(msg, Shutdown):
                return 0
            elif isinstance(msg, ClientGone):
                outputs.client_gone(core, msg.client)
        if core.has_work():
            idle_stats_sent = False
            deltas = core.step()  # with only grammars compiling: waits a few ms for one
            errors, failures = core.take_failed(), core.take_failures()
            now = time.monotonic()
            stats = None
            if core.stats_due or now - stats_at >= STATS_PERIOD_S:
                stats, stats_at = core.stats(), now
                if _parent_gone(parent_pid):
                    return 1
                core.runner.check_workers()
            if deltas or stats or errors or failures:
                outputs.send_step(StepMessage(deltas, core.scheduler.num_preemptions, stats, errors, failures), core)
            continue
        if not idle_stats_sent or core.stats_due:  # the gauges at rest: nothing running
            outputs.send_step(StepMessage([], core.scheduler.num_preemptions, core.stats()), core)
            idle_stats_sent = True
        if not inputs.poll(1000):
            if _parent_gone(parent_pid):
                return 1
            core.runner.check_workers()  # a dead tensor-parallel rank ends the core (and so the server)


def _parent_gone(parent_pid: int | None) -> bool:
    """The API process that started this core is gone (this process was re-parented)."""
    if parent_pid is None or os.getppid() == parent_pid:
        return False
    log.error("the API server process is gone: the engine core exits")
    return True


def core_process_main(config: EngineConfig, model_config: ModelConfig, model_path: str,
                      input_address: str | list[str], output_address: str | list[str], parent_pid: int,
                      log_level: int, control_address: str | None = None) -> None:
    """The engine core process: dies with its parent, leaves SIGINT/SIGTERM to it (it drains, then says)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level)  # (forked: the handler is the parent's, basicConfig did nothing)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    def load() -> EngineCore:
        core = EngineCore(config, model_config, model_path)
        freeze_heap()
        return core

    code = run_core(load, input_address, output_address, parent_pid, control_address)
    raise SystemExit(code)
