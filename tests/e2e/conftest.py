"""Real `mili serve` processes on loopback (support/server.py), and the checkpoints the server tests share.

One family of fixtures: ``serve`` starts a server with the flags a module needs (each stopped when the module
ends, its exit code 0 checked); ``server`` is the default one (the random checkpoint, default flags, shared by
the session) unless a module defines its own; ``client`` is the official openai client on whichever ``server``
the module has."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.scripted import CHAIN, build_caller_checkpoint, build_scripted_checkpoint
from support.server import Server, openai_client

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def random_model(qwen3_checkpoint) -> Path:
    """A random Qwen3 on the real vocabulary and tokenizer (its replies are gibberish, but real token ids)."""
    return qwen3_checkpoint("gqa4_realvocab")


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory) -> Path:
    """A scripted checkpoint whose greedy chat reply is written in advance (support.scripted.CHAIN)."""
    return build_scripted_checkpoint(tmp_path_factory.mktemp("e2e") / "scripted", CHAIN)


@pytest.fixture(scope="session")
def caller_model(tmp_path_factory) -> tuple[Path, dict[int, int]]:
    """A scripted checkpoint that thinks, says a sentence and calls get_time (scripted.CALLER_TEXT), and its chain."""
    return build_caller_checkpoint(tmp_path_factory.mktemp("e2e") / "caller")


@pytest.fixture(scope="session")
def vision_chat_model(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL a server can chat with about images (support.vision.build_chat_vision_checkpoint)."""
    from support.vision import build_chat_vision_checkpoint

    return build_chat_vision_checkpoint(tmp_path_factory.mktemp("e2e") / "vision")


@pytest.fixture(scope="module")
def serve():
    """``serve(model, *flags, **kwargs)``: a started Server (support.server.Server's arguments). Every server
    started is stopped with SIGTERM when the module ends, and each must exit 0."""
    started: list[Server] = []

    def start(model, *flags: str, **kwargs) -> Server:
        started.append(Server(model, *flags, **kwargs))
        return started[-1]

    yield start
    codes = [(s.stop(), s) for s in started]  # (all stopped before any assertion)
    for code, s in codes:
        assert code == 0, s.output()


@pytest.fixture(scope="session")
def server(random_model):
    """The default server, one for the session (8 modules share it): the tests that use it leave it as they found
    it (nothing running, every KV page free or cached), and compare its counters before and after, never to 0."""
    s = Server(random_model)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def scripted_server(serve, scripted_model) -> Server:
    return serve(scripted_model)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)
