"""``mili serve --api-server-count N``: N API processes on one port, one engine core behind them.

The ``mili serve`` process (the supervisor) starts the engine core (``SharedCore``) and waits for the model,
binds the port, then spawns N API processes: each runs its own uvicorn, FastAPI app and ``AsyncLLM``
(tokenizer, output processor) connected to the one core, so requests through any of them are scheduled and
batched together. Each listens on the port with SO_REUSEPORT (the supervisor's bound socket keeps it from
anyone else), so the kernel spreads new connections evenly over them; a listening socket they all shared
would not (the process that wakes first accepts a whole burst). Without SO_REUSEPORT they share one.

- ``/metrics`` answers for the whole server from any process: prometheus_client's multiprocess mode (each
  process writes its series to files in a shared folder; the one that answers sums them). The engine's
  gauges are the same in every process (the core sends its stats to all) and are reported once
  (``mostrecent``); its running totals (preemptions, speculative decoding) are counted by process 0 only.
- ``/health`` answers the engine's state (the same in every process) and lists every API process's pid
  (``api_server_pids``); ``/status/{id}`` asks the other processes for a request it did not serve (a unix
  socket each, in the run folder).
- Deaths: if the core dies, every API process fails its open streams (EngineDeadError) and exits non-zero,
  and so does the server. If an API process dies, the server goes down: the core aborts its requests
  (``ClientGone``), the others drain as on SIGTERM, then the core stops, and the exit code is non-zero, for
  a supervisor (systemd, Kubernetes) to restart it.
  If the supervisor itself dies, the core and the API processes follow it (PR_SET_PDEATHSIG).
- SIGTERM/SIGINT to the supervisor: every API process drains (``--shutdown-timeout``), then the core stops;
  exit code 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import wait

log = logging.getLogger("mili")
_CORE_DEATH_WAIT_S = 15.0  # after the core dies, the API processes get this long to fail their streams and exit
_PIDS_FILE = "api_server_pids.json"


class ApiServers:
    """What one API process knows of the others: its index, their number, the run folder they share, the
    barrier they all pass once connected to the core (so none serves before all can), and the address they
    listen on (``reuse_port``: each its own socket; else the one socket it is given)."""

    def __init__(self, index: int, count: int, run_dir: str, barrier=None, address: tuple | None = None,
                 reuse_port: bool = False):
        self.index, self.count, self.run_dir, self.barrier = index, count, run_dir, barrier
        self.address, self.reuse_port = address, reuse_port

    def listener(self, shared: socket.socket | None) -> socket.socket:
        """The socket this process accepts connections on: its own on the shared port, or ``shared``."""
        return shared if not self.reuse_port else bind_port(*self.address, reuse_port=True, listen=True)

    def pids(self) -> list[int]:
        """Every API process's pid (the supervisor writes them once they are started)."""
        try:
            with open(os.path.join(self.run_dir, _PIDS_FILE)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return [os.getpid()]

    def status_path(self, index: int) -> str:
        return os.path.join(self.run_dir, f"api{index}.sock")

    def status_socket(self) -> socket.socket:
        """This process's unix socket on which the others ask for the status of its requests."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.status_path(self.index))
        sock.listen(64)
        sock.setblocking(False)
        return sock

    async def serve_statuses(self, sock: socket.socket, statuses: dict) -> None:
        """Answer the other processes' questions: a request id a line, its status (JSON, or null) a line."""
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                request_id = (await reader.readline()).decode().strip()
                entry = statuses.get(request_id)
                writer.write(json.dumps(entry.as_dict() if entry is not None else None).encode() + b"\n")
                await writer.drain()
            finally:
                writer.close()

        server = await asyncio.start_unix_server(answer, sock=sock)
        async with server:
            await server.serve_forever()

    async def find_status(self, request_id: str) -> dict | None:
        """The status of a request another API process served (None if none knows it)."""
        for index in range(self.count):
            if index == self.index:
                continue
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.status_path(index)), 2)
                try:
                    writer.write(request_id.replace("\n", " ").encode() + b"\n")
                    await writer.drain()
                    entry = json.loads(await asyncio.wait_for(reader.readline(), 2) or b"null")
                finally:
                    writer.close()
            except (OSError, asyncio.TimeoutError, ValueError):
                continue
            if entry is not None:
                return entry
        return None


def bind_port(host: str, port: int, reuse_port: bool, listen: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 if the host has a colon), as uvicorn binds one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from mili.errors import InvalidRequest

        raise InvalidRequest(f"cannot listen on {host}:{port}: {e.strerror}", param="port") from e
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def connect_api_server(config, servers: ApiServers, link):
    """In an API process: its AsyncLLM connected to the shared core, once every API process has one; exits
    2 (the error printed) if it cannot start, 1 if another could not."""
    import threading

    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s [api {servers.index}]: %(message)s")
    from mili.process import die_with_parent

    die_with_parent()
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor only, which asks each process to drain once
    from mili.engine.async_llm import AsyncLLM
    from mili.errors import MiliError

    try:
        engine = AsyncLLM(config, link=link)
    except MiliError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        servers.barrier.wait(120)
    except threading.BrokenBarrierError:
        sys.exit(1)  # another did not start (the supervisor says why)
    return engine


def serve_api_servers(args, config, api_server_main) -> int:
    """The supervisor: the core, the listening socket, ``args.api_server_count`` processes running
    ``api_server_main(args, config, servers, sock, link)`` (``mili.cli``'s, which connects through
    ``connect_api_server``); returns the server's exit code."""
    from mili.engine.shared_core import SharedCore

    count = args.api_server_count
    run_dir = tempfile.mkdtemp(prefix="mili-serve-")
    metrics_dir = os.path.join(run_dir, "metrics")
    os.mkdir(metrics_dir)
    # prometheus_client reads it when first imported: the API processes (spawned) inherit it
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    core = sock = None
    try:
        core = SharedCore(config, count)  # a checkpoint it cannot run fails here
        # SO_REUSEPORT: this socket (bound, not listening: no connection goes to it) holds the port, and each
        # API process listens on its own; else the API processes share this one
        reuse_port = hasattr(socket, "SO_REUSEPORT")
        sock = bind_port(args.host, args.port, reuse_port)
        address = (args.host, sock.getsockname()[1])
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(count)
        procs = [ctx.Process(target=api_server_main, name=f"mili-api-server-{i}",
                             args=(args, config, ApiServers(i, count, run_dir, barrier, address, reuse_port),
                                   None if reuse_port else sock, core.link(i)))
                 for i in range(count)]
        for p in procs:
            p.start()
        if not reuse_port:
            sock.close()  # (the API processes hold it)
        with open(os.path.join(run_dir, _PIDS_FILE + ".tmp"), "w") as f:
            json.dump([p.pid for p in procs], f)
        os.replace(os.path.join(run_dir, _PIDS_FILE + ".tmp"), os.path.join(run_dir, _PIDS_FILE))
        log.info("%d API processes (pids %s) share the engine core (pid %d)", count,
                 ", ".join(str(p.pid) for p in procs), core.process.pid)
        return _supervise(core, procs, barrier, args.shutdown_timeout)
    finally:
        if sock is not None:
            sock.close()
        if core is not None:
            core.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)


def _supervise(core, procs: list, barrier, shutdown_timeout: float) -> int:
    stopping = []  # a signal came: the API processes drain

    def on_signal(signum, _frame) -> None:
        if not stopping:
            stopping.append(signum)
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    code = 0
    told = set()  # the API processes whose exit the core has heard of
    while any(p.is_alive() for p in procs):
        wait([p.sentinel for p in procs if p.is_alive()] + [core.process.sentinel], timeout=0.5)
        reason = core.dead_reason()
        if reason is not None:  # every API process fails its streams and exits non-zero by itself
            log.error("the engine core stopped (%s): the API processes fail their streams and exit", reason)
            barrier.abort()  # (any still starting stops waiting for the others)
            deadline = time.monotonic() + _CORE_DEATH_WAIT_S
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
            print(f"error: the engine stopped: {reason}", file=sys.stderr)
            return 1
        # which have exited, read once: a process that dies between two reads would otherwise be taken for one that
        # exited 0 on its own (its death then unlogged, the others stopped as by a signal)
        exited = [i for i, p in enumerate(procs) if not p.is_alive()]
        for i in exited:
            if i not in told:
                told.add(i)
                core.client_gone(i)  # (its requests, if it died, end in the core too)
        gone = [procs[i] for i in exited if procs[i].exitcode != 0]
        if gone and not stopping:  # an API process died: the server goes down, the others draining first
            p = gone[0]
            log.error("API process %s (pid %d) exited with code %s: the server stops", p.name, p.pid, p.exitcode)
            code = p.exitcode if p.exitcode and p.exitcode > 0 else 1
            barrier.abort()  # (the others, if still starting, stop waiting for it)
            on_signal(signal.SIGTERM, None)
        elif not stopping and exited:  # one exited 0 on its own: as a signal
            barrier.abort()
            on_signal(signal.SIGTERM, None)
    for p in procs:
        p.join(shutdown_timeout + 5)
        # (one the SIGTERM found still starting, before uvicorn's handler, had nothing to drain)
        if p.exitcode not in (0, -signal.SIGTERM) and code == 0:
            code = 1
    return code
