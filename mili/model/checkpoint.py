"""A checkpoint folder without its weights: where it is (a local folder, a hub id, or the offline demo), its
``config.json`` (refusing a quantization MILI cannot run before anything loads) and its generation defaults, and
its tensors' names. No torch: the API processes read this; the weight loader (``loader.py``) is the engine's."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from mili.errors import ModelLoadError
from mili.model.checks import check_quantization

log = logging.getLogger("mili")

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "tokenizer*"]


def resolve_model_path(model: str) -> str:
    """A local checkpoint folder for ``model``: the demo name, a local path, a GGUF file (the folder made from its
    metadata, ``gguf.py``), or a hub id."""
    from mili.model.demo import (DEMO_HYBRID_MODEL, DEMO_MODEL, DEMO_RANDOM_MODEL, demo_checkpoint,
                                 demo_random_checkpoint)

    if model in (DEMO_MODEL, DEMO_HYBRID_MODEL):
        return demo_checkpoint(hybrid=model == DEMO_HYBRID_MODEL)
    if model == DEMO_RANDOM_MODEL:
        return demo_random_checkpoint()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").is_file()):
        from mili.model import gguf

        files = gguf.gguf_files(model)
        if files is not None:
            return gguf.prepare(files)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{model!r} is a folder but has no config.json")
        return str(path)
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelLoadError(f"model path {model!r} does not exist (and is not a hub id like 'Qwen/Qwen3-0.6B')")
    return _download(model)


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:  # honours HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # offline, not found, gated, network: all mean the same to the user
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        hint = (" (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else
                " (no network, or no such repository; pass a local folder instead)")
        raise ModelLoadError(f"could not fetch {repo_id!r} from the Hugging Face hub{hint}: "
                             f"{type(e).__name__}: {e}") from e


def load_hf_config(path: str):
    """The checkpoint's transformers config; a quantized checkpoint is refused here, before anything loads."""
    from transformers import AutoConfig

    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the config of {path!r}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"the config.json of {path!r} is not a JSON object")
    check_quantization(raw)
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read the config of {path!r}: {e}") from e


def load_generation_defaults(path: str) -> dict:
    """The sampling defaults a checkpoint ships (generation_config.json): temperature, top_p, top_k."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        log.warning("ignoring unreadable %s", file)
        return {}
    return {k: config[k] for k in ("temperature", "top_p", "top_k") if config.get(k) is not None}


def safetensors_files(path: str) -> list[str]:
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    missing = [f for f in files if not (folder / f).is_file()]
    if not files or missing:
        raise ModelLoadError(f"no safetensors weights in {path!r}" + (f" (missing {missing})" if missing else ""))
    return [str(folder / f) for f in files]


def tensor_names(path: str) -> list[str]:
    """Every tensor name of a checkpoint folder (read from the index or the files' headers, no data)."""
    from safetensors import safe_open

    from mili.model.gguf import checkpoint_names, gguf_folder_files

    if gguf_folder_files(path) is not None:
        return checkpoint_names(path)
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names = []
    for file in safetensors_files(path):
        with safe_open(file, "pt") as f:
            names += list(f.keys())
    return names
