"""Shared by the benchmarks: Qwen3-shaped random checkpoints, a driver over the engine, tables."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from mili.tools.bench import percentile, print_table, run_batch  # noqa: F401  (shared with mili bench)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # the official Qwen3 shapes and the real tokenizer, in the repository
CACHE = Path(os.environ.get("MILI_BENCH_CACHE", Path.home() / ".cache" / "mili" / "bench"))


def qwen3_checkpoint(name: str = "Qwen3-0.6B", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     layers: int | None = None) -> str:
    """A random-weight checkpoint of an official Qwen3 shape (dense or MoE), with the real tokenizer; built
    once. ``layers``: cut to that many decoder layers."""
    from transformers import (AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    path = CACHE / (f"{name}-random-{str(dtype).removeprefix('torch.')}-s{seed}"
                    + (f"-{layers}layers" if layers is not None else ""))
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return str(path)
    shape = {k: v for k, v in json.loads((DATA / "qwen3_configs.json").read_text())[name].items()
             if not k.startswith("_")}
    shape.pop("torch_dtype", None)
    if layers is not None:
        shape.update(num_hidden_layers=layers, max_window_layers=layers)
    moe = shape.get("model_type") == "qwen3_moe"
    config = (Qwen3MoeConfig if moe else Qwen3Config)(**shape)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config).to(dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(DATA / "qwen3-tokenizer").save_pretrained(tmp)
    os.replace(tmp, path)
    return str(path)


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids from the ordinary (non-special) vocabulary."""
    return torch.randint(0, 151643, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft(out) -> float:
    return out.metrics["first_token_time"] - out.metrics["arrival_time"]


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def hybrid_checkpoint(name: str, layers: int | None, dtype: torch.dtype) -> str:
    """A random-weight text model of a released Qwen3.5 shape (``layers``: cut to that many), with the Qwen3
    tokenizer; built once under the benchmark cache."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    path = CACHE / (f"{name}-random-{str(dtype).removeprefix('torch.')}" + (f"-{layers}layers" if layers else ""))
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return str(path)
    config = json.loads((DATA / "qwen3.5" / f"{name}.config.json").read_text())
    text = {k: v for k, v in config.get("text_config", config).items() if k not in ("model_type", "dtype")}
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    if layers:
        text.update(num_hidden_layers=layers, layer_types=text["layer_types"][:layers])
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).to(dtype).eval()
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(DATA / "qwen3-tokenizer").save_pretrained(tmp)
    os.replace(tmp, path)
    return str(path)
