"""`mili serve --tensor-parallel-size 2` on the CPU: the OpenAI API works; a dead rank ends the server."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from support.server import Server, wait_for


def _rank_pids(core_pid: int) -> list[int]:
    """The core's tensor-parallel rank processes (multiprocessing spawn children, not its resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == core_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def tp_server(random_model):
    s = Server(random_model, "--tensor-parallel-size", "2")
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_tp2_server_answers_then_exits_when_a_rank_dies(tp_server):
    client = OpenAI(base_url=f"{tp_server.url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="test", prompt="Hello there", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8
    chat = client.chat.completions.create(model="test", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          stream=True, extra_body={"ignore_eos": True})
    assert sum(1 for c in chat if c.choices and c.choices[0].delta.content) >= 1
    core_pid = httpx.get(tp_server.url + "/health").json()["engine_core_pid"]
    ranks = _rank_pids(core_pid)
    assert len(ranks) == 1
    os.kill(ranks[0], signal.SIGKILL)
    assert wait_for(lambda: tp_server.proc.poll() is not None, 20), "the server kept running without a rank"
    assert tp_server.proc.returncode != 0


def test_the_same_command_under_torchrun(random_model):
    """torchrun starts every rank with the same command: rank 0 generates, rank 1 holds its shard; the
    text equals a single process's (float32, greedy). When done, rank 0 tells rank 1 to stop: rank 1 does not
    find the group closed under it (which it logs as "stops: ... Connection closed by peer"), and rank 0 leaves the
    group before its exit (its gloo teardown at exit aborted it in 1 run of 8)."""
    import subprocess
    import sys

    cmd = ["generate", str(random_model), "--prompt", "Hello there", "--max-tokens", "6", "--dtype", "float32",
           "--temperature", "0"]
    single = subprocess.run([sys.executable, "-m", "mili.cli", *cmd], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "mili.cli", *cmd], capture_output=True, text=True, timeout=300)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert single.stdout.strip() and ranks.stdout.strip() == single.stdout.strip()
    assert "tensor-parallel rank 1 stops" not in ranks.stderr, ranks.stderr[-3000:]
