"""Images in on the CPU: the vision tower's time per image, and what one image adds to a request's time to first
token, on a random checkpoint of Qwen3-VL-2B-Instruct's shape (its vision tower whole: depth 24, hidden 1024, 16
heads, MLP 4096, patch 16, merge 2, DeepStack after blocks 5, 11, 17, output 2048 wide; its text model, hidden
2048, cut to a few layers), bf16 by default, on MILI's CPU linears as the engine loads them.

  tower -- ``encode_images`` over one image of each size (the processor's patches), the engine's own tower.
  ttft  -- the offline engine, a chat-shaped request of --text tokens with one 448×448 image (196 image tokens;
           a new image each time: the encoder cache misses, the prefix cache is off) against the same text without
           the image, and against text of the image request's length (what the image's tokens cost as text).
  start -- the tower's weights against the whole model's, for the released Qwen3.5 shapes (the question whether
           to serve them text only by default): parameter counts from their configs, no weights made.

Every workload runs --runs times after one warm-up, alternating, in one process; the table gives medians.

    python benchmarks/vision.py [--layers 4] [--runs 3] [--text 48] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from common import CACHE, DATA, machine, print_table, random_prompt, ttft

from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.sampling_params import SamplingParams

# Qwen3-VL-2B-Instruct's config.json (the hub's), the text model's layer count left to --layers
VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=2304,
              deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh")
TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=262144, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True})
TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
SIZES = (448, 1024)  # square images, pixels a side


def vl_checkpoint(layers: int, dtype: torch.dtype) -> str:
    """A random Qwen3-VL-2B-shaped checkpoint (text cut to ``layers``), with the Qwen3 tokenizer and Qwen3-VL's
    preprocessor_config.json (images up to 16,777,216 pixels, as the hub's); built once under the bench cache."""
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    path = CACHE / f"Qwen3-VL-2B-random-{str(dtype).removeprefix('torch.')}-{layers}layers"
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return str(path)
    torch.manual_seed(0)
    config = Qwen3VLConfig(text_config=dict(TEXT, num_hidden_layers=layers), vision_config=VISION,
                           tie_word_embeddings=True, **TOKENS)
    model = Qwen3VLForConditionalGeneration(config).to(dtype).eval()
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(DATA / "qwen3-tokenizer").save_pretrained(tmp)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3, size={"longest_edge": 16777216, "shortest_edge": 65536}
                             ).save_pretrained(tmp)
    os.replace(tmp, path)
    return str(path)


def random_image(side: int, seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def tower(engine, args) -> dict:
    """Seconds per ``encode_images`` call, each size in turn (the first round a warm-up)."""
    model, images = engine.core.runner.parts.model, engine.inputs.images
    inputs = {}
    for side in SIZES:
        _, add = images.prepare([TOKENS["image_token_id"]], [random_image(side, side)])
        pixels = np.frombuffer(add.pixel_values, dtype=np.float32).reshape(-1, add.patch_dim)
        inputs[side] = (torch.from_numpy(pixels.copy()), [tuple(g) for g in add.grid_thw])
    times = {side: [] for side in SIZES}
    for run in range(args.runs + 1):
        for side, (pixels, grid) in inputs.items():
            start = time.perf_counter()
            with torch.inference_mode():
                model.encode_images(pixels, grid)
            if run:
                times[side].append(time.perf_counter() - start)
        print(f"  tower: run {run} done", file=sys.stderr, flush=True)
    return times


def first_token(engine, args) -> dict:
    """TTFT of the three requests of one round, alternating, each with fresh text and a fresh image."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    image_tokens = (448 // 32) ** 2
    ttfts = {"one 448×448 image": [], "text only": [], "text of equal length": []}
    for run in range(args.runs + 1):
        text = random_prompt(args.text, run)
        with_image = text[:8] + [TOKENS["vision_start_token_id"], TOKENS["image_token_id"],
                                 TOKENS["vision_end_token_id"]] + text[8:]
        requests = {"one 448×448 image": (with_image, [random_image(448, 1000 + run)]), "text only": (text, None),
                    "text of equal length": (text + random_prompt(image_tokens + 2, 500 + run), None)}
        for label, (prompt, images) in requests.items():
            out = one_request(engine, prompt, images, params)
            if run:
                ttfts[label].append(ttft(out))
        print(f"  ttft: run {run} done", file=sys.stderr, flush=True)
    return ttfts


def one_request(engine, prompt: list[int], images, params):
    """Run one request alone to its end (``images``: PIL images or None); its final output."""
    request_id = engine.add_request(prompt, params, images=images).request_id
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def start_up() -> list[list]:
    """[shape, tower parameters, whole model's, the tower's share, its bf16 MiB, what the engine plans for the tower's
    activations and cache (hub processor: images up to 16,384 tokens; limit 4)] for the released Qwen3.5 shapes."""
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    from mili.model.vision import VisionTower
    from mili.runtime.encoder_cache import VisionBudget

    rows, folder = [], Path(tempfile.mkdtemp())
    (folder / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 16777216}}))
    for name in ("Qwen3.5-0.8B.config", "Qwen3.5-2B.reconstructed", "Qwen3.5-4B.config", "Qwen3.5-27B.config"):
        config = json.loads((DATA / "qwen3.5" / f"{name}.json").read_text())
        vision_config = SimpleNamespace(**config["vision_config"])
        with torch.device("meta"):
            vision = VisionTower(vision_config, torch.bfloat16)
        tower_params = sum(p.numel() for p in vision.parameters())
        text_params = text_parameters(config["text_config"], config.get("tie_word_embeddings", False))
        plan = VisionBudget.plan(EngineConfig(model=str(folder), device="cpu"),
                                 SimpleNamespace(vision_config=vision_config), str(folder), torch.bfloat16, 262144)
        shape = name.split(".config")[0].replace(".reconstructed", " (reconstructed)")
        rows.append([shape, f"{tower_params / 1e6:.0f} M", f"{(tower_params + text_params) / 1e6:.0f} M",
                     f"{100 * tower_params / (tower_params + text_params):.1f}%", f"{2 * tower_params / 2**20:.0f}",
                     f"{plan.reserve_bytes / 2**20:.0f}"])
    return rows


def text_parameters(text: dict, tied: bool) -> int:
    """The Qwen3.5 language model's parameters (transformers' class on the meta device; MTP head left out)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    fields = {k: v for k, v in text.items() if k not in ("model_type", "dtype")}
    fields["tie_word_embeddings"] = tied
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="text decoder layers (Qwen3-VL-2B has 28)")
    p.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up")
    p.add_argument("--text", type=int, default=48, help="text tokens of the chat request")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()

    path = vl_checkpoint(args.layers, getattr(torch, args.dtype))
    engine = LLMEngine(EngineConfig(model=path, dtype=args.dtype, max_model_len=8192, kv_cache_memory=1 << 30,
                                    enable_prefix_caching=False))
    towers, ttfts = tower(engine, args), first_token(engine, args)
    print(f"\nMILI vision, Qwen3-VL-2B shape (tower whole, text cut to {args.layers} layers), random weights, "
          f"{args.dtype}, weights: {engine.plan.weight_format}; {machine()}; median of {args.runs} runs after a "
          f"warm-up, alternating")
    rows = [[f"{side}×{side}", f"{(side // 16) ** 2}", f"{(side // 32) ** 2}", statistics.median(t),
             f"{min(t):.3f}-{max(t):.3f}"] for side, t in towers.items()]
    print_table("vision tower, one image", ["image", "patches", "tokens", "seconds", "range"], rows, digits=3)
    rows = [[label, statistics.median(t), f"{min(t):.3f}-{max(t):.3f}"] for label, t in ttfts.items()]
    print_table(f"time to first token, {args.text} text tokens (seconds)", ["request", "TTFT", "range"], rows,
                digits=3)
    print_table("Qwen3.5: the vision tower at start-up (bf16 weights)",
                ["shape", "tower", "model", "tower share", "tower MiB", "planned MiB"], start_up())


if __name__ == "__main__":
    main()
