"""Shared fixtures: the tiny random checkpoints, each kind built once per session (on first use), and the real
Qwen3 tokenizer. The builders live in tests/support/; a test that needs a shape of its own calls them itself."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# Triton reads TRITON_INTERPRET when it is first imported (transformers may import it early): set it
# before anything else, so the kernel tests run on the CPU. MILI_TEST_GPU=1 runs them compiled on a GPU.
if os.environ.get("MILI_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One torch (OpenMP) thread a process unless the environment says otherwise, this one and every process it starts
# (servers, tensor-parallel ranks, the lower-ISA pytest): the suite runs several processes at once on few cores, the
# tiny models gain nothing from a second thread, and OpenMP's barriers between oversubscribed threads make every op
# wait for a scheduler slice (a float32 decode step of the tiny model took ~30 ms with 2 threads on 2 busy cores,
# ~1 ms with one). The CPU kernels' split of work over threads is still tested: test_cpu_kernels.py gives them 2.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from support.checkpoints import MOE_SHAPES, QWEN3_TOKENIZER, build_checkpoint, build_moe_checkpoint

if os.environ.get("TRITON_INTERPRET") == "1":  # (the interpreter's per-call listing of tl's builtins, done once)
    from support.triton_interpreter import install as _memoize_interpreter

    _memoize_interpreter()


def _built_once(root: Path, build: Callable[[Path, str], Path]) -> Callable[[str], Path]:
    """``get(kind)``: ``build(root / kind, kind)`` the first time a kind is asked for, the same folder after.
    The folders are shared by every test of the session: a test that changes files copies the folder first."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build(root / kind, kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``qwen3_checkpoint(shape)``: a random dense Qwen3 of ``support.checkpoints.SHAPES[shape]``."""
    return _built_once(tmp_path_factory.mktemp("qwen3"), build_checkpoint)


@pytest.fixture(scope="session")
def tiny_checkpoint(qwen3_checkpoint) -> Path:
    return qwen3_checkpoint("gqa_untied")


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``moe_checkpoint(shape)``: a random Qwen3 MoE of ``support.checkpoints.MOE_SHAPES[shape]`` (the "e8"
    shapes spell num_experts as Qwen's releases do)."""
    seeds = {name: i for i, name in enumerate(MOE_SHAPES)}
    return _built_once(tmp_path_factory.mktemp("moe"), lambda path, name: build_moe_checkpoint(
        path, seed=seeds[name], hub_spelling=name.startswith("e8"), **MOE_SHAPES[name]))


@pytest.fixture(scope="session")
def hybrid_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``hybrid_checkpoint(kind)``: a random Qwen3.5 / Qwen3.5 MoE / Qwen3-Next of ``support.hybrid.KINDS``."""
    from support.hybrid import build_hybrid_checkpoint

    return _built_once(tmp_path_factory.mktemp("hybrid"), build_hybrid_checkpoint)


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``vision_checkpoint(kind)``: a random Qwen3-VL / Qwen3-VL MoE / Qwen3.5 with its tower
    (``support.vision.KINDS``), with the image processor's preprocessor_config.json as the hub's folders have."""
    from support.vision import build_vision_checkpoint, image_processor

    def build(path: Path, kind: str) -> Path:
        build_vision_checkpoint(path, kind)
        image_processor().save_pretrained(path)
        return path

    return _built_once(tmp_path_factory.mktemp("vision"), build)


@pytest.fixture(scope="session")
def test_images(tmp_path_factory) -> list[Path]:
    """Two PNG files (64×96 and 96×64: 6 image tokens each for the tiny Qwen3-VL), alone in their folder."""
    from support.vision import write_images

    return write_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory) -> Callable[[str], tuple[Path, Path]]:
    """``gguf_model(kind)``: (the GGUF file, the HF checkpoint it was made from) for ``support.gguf_files.KINDS``."""
    from support.gguf_files import build_gguf_model

    root = tmp_path_factory.mktemp("gguf")
    built: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in built:
            built[kind] = build_gguf_model(root / kind, kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def retrieval_model(tmp_path_factory) -> Callable[[str], Path]:
    """``retrieval_model(kind)``: a tiny random Qwen3-Embedding-like (``embed``: sentence-transformers files in the
    hub's spelling, the tokenizer appending <|endoftext|>), Qwen3-Reranker-like (``rerank``: a causal LM) or converted
    reranker (``classifier``: Qwen3ForSequenceClassification, one label) on the real vocabulary (support.pooling)."""
    from support.pooling import build_embedding_checkpoint, build_reranker_checkpoint

    builders = {"embed": build_embedding_checkpoint,
                "rerank": build_reranker_checkpoint,
                "classifier": lambda path: build_reranker_checkpoint(path, classifier=True)}
    return _built_once(tmp_path_factory.mktemp("retrieval"), lambda path, kind: builders[kind](path))
