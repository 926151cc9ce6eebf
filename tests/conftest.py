"""Shared fixtures: tiny random Qwen3 checkpoints built by the tests, and the real Qwen3 tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import QWEN3_TOKENIZER, SHAPES, build_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_checkpoint(root / name, name) for name in SHAPES}


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoints) -> Path:
    return checkpoints["gqa_untied"]


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
