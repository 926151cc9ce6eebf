"""SharedCore: one engine core for several API processes (``mili serve --api-server-count N``).

The ``mili serve`` process starts the core and keeps a control pair of sockets to it (it hears Ready and
Dead, and sends Shutdown once every API process has drained); each API process binds its own pair
(``CoreLink``, ``AsyncLLM(link=...)``). The core pulls the inputs of all of them into one scheduler and
one prefix cache, and sends each request's outputs back to the process that added it
(``AddRequest.client``), its gauges to all::

    API process 0 ─┐ AddRequest, Abort, FinishSeqs         ┌─► API process 0: its deltas, the stats
    API process 1 ─┼───────────► engine core (one batch) ──┼─► API process 1: its deltas, the stats
    mili serve ────┘ Shutdown                              └─► mili serve: Ready, Dead
"""

from __future__ import annotations

import logging
import os

import zmq

from mili.config import EngineConfig
from mili.engine.async_llm import CoreLink, ipc_prefix, wait_ready
from mili.engine.core_start import start_core
from mili.engine.input_processor import InputProcessor
from mili.engine.messages import ClientGone, Dead, Shutdown, encode, output_decoder


class SharedCore:
    def __init__(self, config: EngineConfig, num_clients: int):
        """Start the engine core for ``num_clients`` API processes and wait until it has loaded the model
        (raises ModelLoadError / InvalidRequest if it cannot, as ``AsyncLLM`` does)."""
        inputs = InputProcessor(config)  # fails fast on a bad checkpoint, before the core starts
        base = ipc_prefix()
        self.prefixes = [f"{base}-api{i}" for i in range(num_clients)]
        self._ctx = zmq.Context()
        self._control = self._ctx.socket(zmq.PUSH)
        self._control.bind(f"ipc://{base}-control-in")
        self._events = self._ctx.socket(zmq.PULL)
        self._events.bind(f"ipc://{base}-control-out")
        self.process = start_core(config, inputs.model_config, inputs.model_path,
                                  [f"ipc://{p}-in" for p in self.prefixes] + [f"ipc://{base}-control-in"],
                                  [f"ipc://{p}-out" for p in self.prefixes], os.getpid(),
                                  logging.getLogger("mili").getEffectiveLevel(), f"ipc://{base}-control-out")
        self.model_path = inputs.model_path
        self.info = wait_ready(self._events, self.process)

    def link(self, index: int) -> CoreLink:
        """What API process ``index`` needs to connect (``AsyncLLM(config, link=...)``)."""
        return CoreLink(index, self.prefixes[index], self.process.pid)

    def client_gone(self, index: int) -> None:
        """API process ``index`` has exited: the core aborts its requests and stops sending to it."""
        try:
            self._control.send(encode(ClientGone(index)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def dead_reason(self) -> str | None:
        """Why the core stopped (its last word), once it has; None while it runs."""
        if self.process.is_alive():
            return None
        while self._events.poll(0):
            msg = output_decoder.decode(self._events.recv())
            if isinstance(msg, Dead):
                return msg.reason
        return f"the engine core process exited (exit code {self.process.exitcode})"

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the core to stop (the API processes have gone) and wait for it (then kill it); idempotent."""
        if self._ctx.closed:
            return
        if self.process.is_alive():
            try:
                self._control.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        self._control.close(0)
        self._events.close(0)
        self._ctx.term()
