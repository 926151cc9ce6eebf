"""Shared fixtures: tiny random Qwen3 checkpoints built by the tests, and the real Qwen3 tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

# Triton reads TRITON_INTERPRET when it is first imported (transformers may import it early): set it
# before anything else, so the kernel tests run on the CPU. MILI_TEST_GPU=1 runs them compiled on a GPU.
if os.environ.get("MILI_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from support.checkpoints import QWEN3_TOKENIZER, SHAPES, build_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_checkpoint(root / name, name) for name in SHAPES if name != "slow"}


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoints) -> Path:
    return checkpoints["gqa_untied"]


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
