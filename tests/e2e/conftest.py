"""A real `mili serve` process on loopback, per test module (see support/server.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.scripted import CHAIN, build_caller_checkpoint, build_scripted_checkpoint  # noqa: F401
from support.server import Server, metric  # noqa: F401

@pytest.fixture(scope="session")
def random_model(qwen3_checkpoint) -> Path:
    return qwen3_checkpoint("gqa4_realvocab")


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory) -> Path:
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
def server(random_model):
    s = Server(random_model)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def scripted_server(scripted_model):
    s = Server(scripted_model)
    yield s
    assert s.stop() == 0, s.output()
