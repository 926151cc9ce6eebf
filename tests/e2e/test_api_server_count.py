"""`mili serve --api-server-count 2`: two API processes on one port, one engine core behind them (one batch,
one /metrics); the core's death fails the streams of both and the server exits non-zero; an API process's
death takes the server down (non-zero) after the other drains."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from support.server import Server, metric, process_gone, start_streams, wait_for


def _clients_per_process(url: str, per_process: int) -> dict[int, list[httpx.Client]]:
    """Keep-alive clients, ``per_process`` of them connected to each API process: a client's /health tells
    which process took its connection, and its next requests go through that connection."""
    by_pid: dict[int, list[httpx.Client]] = {}
    spare = []
    for _ in range(200):
        c = httpx.Client(base_url=url, timeout=120)
        pid = c.get("/health").json()["api_server_pid"]
        if len(by_pid.setdefault(pid, [])) < per_process:
            by_pid[pid].append(c)
        else:
            spare.append(c)
        if len(by_pid) == 2 and all(len(v) == per_process for v in by_pid.values()):
            break
    for c in spare:
        c.close()
    assert len(by_pid) == 2 and all(len(v) == per_process for v in by_pid.values()), by_pid
    return by_pid


def _metric(url: str, name: str) -> float:
    try:
        return metric(url, name)
    except KeyError:  # (a labelled series appears with its first count)
        return 0.0


@pytest.fixture(scope="module")
def two(serve, random_model):
    return serve(random_model, "--api-server-count", "2")


def test_two_processes_serve_one_port(two):
    health = httpx.get(two.url + "/health").json()
    pids = {httpx.get(two.url + "/health").json()["api_server_pid"] for _ in range(40)}
    assert pids == set(health["api_server_pids"]) and len(pids) == 2
    assert health["engine_core_pid"] not in pids and two.proc.pid not in pids


def test_requests_through_both_run_in_one_batch_and_metrics_count_all(two):
    by_pid = _clients_per_process(two.url, 3)
    clients = [c for cs in by_pid.values() for c in cs]
    success = 'mili:request_success_total{finished_reason="length"}'
    names = (success, "mili:generation_tokens_total", "mili:prompt_tokens_total",
             "mili:e2e_request_latency_seconds_count")
    before = {name: _metric(two.url, name) for name in names}
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 400, "ignore_eos": True}
    sinks, threads = start_streams(clients, body)
    # the core runs all six, from both processes, in one batch: its gauge (the same through either process)
    assert wait_for(lambda: httpx.get(two.url + "/health").json()["num_requests_running"] == 6, 30)
    for t in threads:
        t.join(120)
    for sink in sinks:
        assert sink[-1][1] == "data: [DONE]"
        assert json.loads(sink[-2][1][6:])["choices"][0]["finish_reason"] == "length"
    # /metrics (through either process) counts the requests of both, once each
    for _ in range(4):
        assert metric(two.url, success) - before[success] == 6
        assert metric(two.url, "mili:generation_tokens_total") - before["mili:generation_tokens_total"] == 6 * 400
        assert metric(two.url, "mili:prompt_tokens_total") - before["mili:prompt_tokens_total"] == 6 * 4
        assert metric(two.url, "mili:e2e_request_latency_seconds_count") - before[
            "mili:e2e_request_latency_seconds_count"] == 6
    assert wait_for(lambda: metric(two.url, "mili:num_requests_running") == 0, 10)
    text = httpx.get(two.url + "/metrics").text
    assert text.count("\nmili:num_requests_running ") == 1 and text.count('mili:model_info{model_name="test",task="generate"} 1.0') == 1
    for c in clients:
        c.close()


def test_status_of_a_request_another_process_served(two):
    by_pid = _clients_per_process(two.url, 1)
    (a,), (b,) = by_pid.values()
    rid = a.post("/generate", json={"prompt": "hello", "max_tokens": 3}).json()["request_id"]
    assert b.get(f"/status/{rid}").json() == {"request_id": rid, "status": "completed", "tokens_generated": 3,
                                              "tokens_remaining": 0}
    assert b.get("/status/no-such-id").json() == {"request_id": "no-such-id", "status": "not_found"}
    a.close()
    b.close()


def test_core_killed_fails_the_streams_of_both_processes(random_model, tmp_path):
    s = Server(random_model, "--api-server-count", "2", log_dir=tmp_path)
    try:
        health = httpx.get(s.url + "/health").json()
        core_pid, api_pids = health["engine_core_pid"], health["api_server_pids"]
        by_pid = _clients_per_process(s.url, 1)
        sinks, threads = start_streams([c for cs in by_pid.values() for c in cs],
                                        {"prompt": "a long story", "max_tokens": 900, "ignore_eos": True})
        time.sleep(0.2)
        os.kill(core_pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(30)
        for sink in sinks:  # the stream through each process ends with an SSE error event, within 2 s
            assert sink[-1][1] == "data: [DONE]", sink[-3:]
            error = json.loads(sink[-2][1][6:])["error"]
            assert error["code"] == "engine_dead" and "engine stopped" in error["message"]
            assert sink[-2][0] - killed < 2.0
        s.proc.wait(20 - (time.monotonic() - killed))  # the server exits, non-zero
        assert s.proc.returncode != 0
        assert all(wait_for(lambda: process_gone(pid), 5) for pid in api_pids)
    finally:
        s.stop()


def test_api_process_killed_takes_the_server_down(random_model, tmp_path):
    """The choice written down (docs/serving/index.md, mili serve --help): the other API process drains its requests, then
    the core stops, and the server exits non-zero for its supervisor to restart it."""
    # (the survivor drains its 300 tokens within the grace period even on a loaded machine)
    s = Server(random_model, "--api-server-count", "2", "--shutdown-timeout", "60", log_dir=tmp_path)
    try:
        health = httpx.get(s.url + "/health").json()
        core_pid = health["engine_core_pid"]
        by_pid = _clients_per_process(s.url, 1)
        (victim, (victim_client,)), (_, (other_client,)) = by_pid.items()
        sinks, threads = start_streams([victim_client, other_client], {"prompt": "finish me", "max_tokens": 300,
                                                                        "ignore_eos": True})
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert sinks[1][-1][1] == "data: [DONE]"  # the survivor's stream finished
        assert json.loads(sinks[1][-2][1][6:])["choices"][0]["finish_reason"] == "length"
        assert sinks[0][-1][1].startswith("transport error")  # (the victim's connection broke)
        assert s.proc.wait(30) != 0
        assert wait_for(lambda: process_gone(core_pid), 10)
        assert "exited with code -9: the server stops" in s.output()
        assert "is gone: 1 of its requests aborted" in s.output()  # the core stopped computing it
    finally:
        s.stop()
