"""A real `mili serve` process on loopback (Server), and what the tests read of it: metrics, streams, processes."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent


class Budget:
    """``seconds`` of waiting, counted as this machine runs: a gap longer than ``GAP`` between two looks (the VM
    paused or snapshotted, as CI's has been for minutes mid-run, its monotonic clock jumping on resume) counts as
    ``GAP``, so a wait fails for what the server did, not for time the machine was stopped."""

    GAP = 2.0

    def __init__(self, seconds: float):
        self.left, self.last = seconds, time.monotonic()

    def spent(self) -> bool:
        now = time.monotonic()
        self.left -= min(now - self.last, self.GAP)
        self.last = now
        return self.left <= 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path | str, *args: str, env: dict | None = None, log_dir: Path | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = (log_dir or Path(model).parent) / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        argv = ["serve", str(model), "--port", str(self.port), "--served-model-name", "test", "--dtype", "float32",
                "--max-model-len", "1024", *args]
        # MILI_TEST_API_SERVER_COUNT=2: every server test runs with that many API processes
        if os.environ.get("MILI_TEST_API_SERVER_COUNT") and "--api-server-count" not in args:
            argv += ["--api-server-count", os.environ["MILI_TEST_API_SERVER_COUNT"]]
        run_env = {**os.environ, "MILI_NO_PROGRESS": "1", **(env or {})}
        if env is None and _forks().ready():  # forked off support.forkserver: the same process, its imports done
            self.proc = _forks().start(argv, run_env, self.log_path)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "mili.cli", *argv], stdout=self.log,
                                         stderr=subprocess.STDOUT, env=run_env)
        started, budget = time.monotonic(), Budget(120)
        while not budget.spent():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()  # (not left running: the module's other servers and tests share this machine)
        raise RuntimeError(f"server did not start in {time.monotonic() - started:.0f} s (load average "
                           f"{os.getloadavg()[0]:.1f}): {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM, as an orchestrator would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.flush()
        return self.proc.returncode


class _ForkServer:
    """support.forkserver's process, one per test process, started by its first server: it forks each server whose
    environment is the one it was started in (the imports it did then were made under that environment)."""

    def __init__(self):
        self.env = dict(os.environ)
        code = f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); import support.forkserver as f; f.serve_forks()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=self.env)
        self.lock = threading.Lock()

    def ready(self) -> bool:
        return self.proc.poll() is None and dict(os.environ) == self.env

    def ask(self, request: dict) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
        return json.loads(reply)

    def start(self, argv: list[str], env: dict, log: Path) -> "ForkedProcess":
        reply = self.ask({"start": argv, "env": env, "log": str(log), "cwd": os.getcwd()})
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return ForkedProcess(self, reply["pid"], argv)


class ForkedProcess:
    """What the tests use of Popen (pid, returncode, poll, wait, send_signal, kill) for a process the fork server
    started. Its pid cannot be reused while the tests can still signal it: the fork server reaps it only when a
    poll or wait here finds it ended."""

    def __init__(self, forks: _ForkServer, pid: int, argv: list[str]):
        self.forks, self.pid, self.args, self.returncode = forks, pid, argv, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.forks.ask({"wait": self.pid, "timeout": 0})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.forks.ask({"wait": self.pid, "timeout": timeout})["code"]
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@functools.cache
def _forks() -> _ForkServer:
    return _ForkServer()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False; counted as Budget counts)."""
    budget = Budget(timeout)
    while not budget.spent():
        if predicate():
            return True
        time.sleep(0.05)
    return False


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _stream_into(client: httpx.Client, body: dict, sink: list, started: threading.Event) -> None:
    try:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    sink.append((time.monotonic(), line))
                    started.set()
    except httpx.HTTPError as e:
        sink.append((time.monotonic(), f"transport error: {e}"))
    started.set()


def start_streams(clients: list[httpx.Client], body: dict, wait_s: float = 60):
    """One streamed /v1/completions ``body`` per client (``base_url`` set), each in a thread, returned once each
    has its first event: (a list per stream of (arrival time, "data: ..." line or "transport error: ..."), the
    threads)."""
    sinks = [[] for _ in clients]
    events = [threading.Event() for _ in clients]
    threads = [threading.Thread(target=_stream_into, args=(c, body, sink, ev))
               for c, sink, ev in zip(clients, sinks, events)]
    for t in threads:
        t.start()
    assert all(ev.wait(wait_s) for ev in events)
    return sinks, threads


def openai_client(server: Server, api_key: str = "unused", timeout: float = 120):
    """The official openai client on ``server``'s /v1, without retries (a failure shows at once)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)
