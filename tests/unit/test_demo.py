"""The offline demo checkpoints: ``demo`` (trained by mili/demo/train.py, shipped in the package) and
``demo-random`` (built locally, deterministically); both loadable by transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mili.model.demo import DEMO_RANDOM_MODEL, DEMO_VERSION, demo_random_checkpoint


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory) -> Path:
    return Path(demo_random_checkpoint(tmp_path_factory.mktemp("cache-a")))


def test_builds_into_cache_dir(demo_path):
    assert DEMO_RANDOM_MODEL == "demo-random"
    assert demo_path.name == DEMO_VERSION == "demo-random-v1"
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"):
        assert (demo_path / f).is_file(), f
    # no temporary folders left beside it
    assert [p.name for p in demo_path.parent.iterdir()] == [DEMO_VERSION]
    # a second call reuses it
    mtime = (demo_path / "model.safetensors").stat().st_mtime_ns
    assert demo_random_checkpoint(demo_path.parent) == str(demo_path)
    assert (demo_path / "model.safetensors").stat().st_mtime_ns == mtime


def test_deterministic(demo_path, tmp_path):
    torch.manual_seed(99)
    state = torch.random.get_rng_state()
    other = Path(demo_random_checkpoint(tmp_path))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    for f in sorted(os.listdir(demo_path)):
        assert (demo_path / f).read_bytes() == (other / f).read_bytes(), f


def test_env_cache_dir(monkeypatch, tmp_path, demo_path):
    monkeypatch.setenv("MILI_CACHE_DIR", str(tmp_path / "envcache"))
    path = Path(demo_random_checkpoint())
    assert path == tmp_path / "envcache" / DEMO_VERSION
    from mili.model.checkpoint import resolve_model_path

    assert resolve_model_path(DEMO_RANDOM_MODEL) == str(path)
    assert (path / "model.safetensors").read_bytes() == (demo_path / "model.safetensors").read_bytes()


def test_config_and_tokenizer(demo_path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(demo_path)
    tok = AutoTokenizer.from_pretrained(demo_path)
    assert cfg.model_type == "qwen3"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 384, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 4096
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tok) == 261
    assert str(cfg.dtype).endswith("bfloat16")

    ids = {t: tok.convert_tokens_to_ids(t)
           for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]}
    assert list(ids.values()) == [256, 257, 258, 259, 260]
    assert tok.eos_token_id == ids["<|im_end|>"] == cfg.eos_token_id
    assert tok.pad_token_id == ids["<|endoftext|>"] == cfg.pad_token_id
    gen = json.loads((demo_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]

    # byte-level: every byte is one token, round trip is exact
    text = "Hi 👋🏽 你好 <think>x</think>"
    enc = tok.encode(text, add_special_tokens=False)
    assert enc[:3] == [ord("H"), ord("i"), ord(" ")] and ids["<think>"] in enc
    assert tok.decode(enc) == text
    assert tok.decode(enc + [ids["<|im_end|>"]], skip_special_tokens=True) == text  # think: not special

    from mili.tokenizer.tokenizer import apply_chat_template, load_eos_token_ids

    assert load_eos_token_ids(str(demo_path), tok, cfg) == [258, 256]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"}]
    assert apply_chat_template(tok, messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert apply_chat_template(tok, messages, True, {"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert apply_chat_template(tok, messages, False).endswith("Hello<|im_end|>\n")


def test_hf_forward(demo_path):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(demo_path)
    model = Qwen3ForCausalLM.from_pretrained(demo_path).eval()
    assert model.dtype == torch.bfloat16
    ids = tok.encode("<|im_start|>user\nHello<|im_end|>\n", add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits.float()).all()
    assert logits.float().std() > 0.1  # not flat


# -- the trained demo (mili/demo/checkpoint) ------------------------------------------------------------
DATA = Path(__file__).resolve().parents[1] / "data" / "demo"  # held-out chapters, the corpus's words
HELDOUT_CE_BOUND = 4.08  # nats per token; the shipped checkpoint measures 4.055 (docs/models.md)


def corpus_words() -> set[str]:
    return set((DATA / "words.txt").read_text().split())


def in_corpus_share(text: str) -> float:
    from mili.demo.train import words

    ws = words(text)
    return sum(w in corpus_words() for w in ws) / max(1, len(ws))


@pytest.fixture(scope="module")
def trained():
    from mili.model.demo import DEMO_MODEL, demo_checkpoint

    assert DEMO_MODEL == "demo"
    return Path(demo_checkpoint())


@pytest.fixture(scope="module")
def demo_llm():
    from mili import LLM

    return LLM("demo", dtype="float32")


def test_trained_demo_is_package_data_with_no_build_step(trained, monkeypatch, tmp_path):
    import mili
    from mili.model.checkpoint import resolve_model_path

    assert trained.parent.parent == Path(mili.__file__).parent  # mili/demo/checkpoint
    monkeypatch.setenv("MILI_CACHE_DIR", str(tmp_path))
    assert resolve_model_path("demo") == str(trained)
    assert not list(tmp_path.iterdir())  # nothing built, nothing cached
    assert (trained / "model.safetensors").stat().st_size < 40 * 2 ** 20
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    pyproject = tomllib.loads((Path(mili.__file__).parents[1] / "pyproject.toml").read_text())
    assert "checkpoint/*" in pyproject["tool"]["setuptools"]["package-data"]["mili.demo"]  # in the wheel


def test_trained_demo_config_and_tokenizer(trained):
    from transformers import AutoConfig, AutoTokenizer
    from safetensors import safe_open

    cfg = AutoConfig.from_pretrained(trained)
    tok = AutoTokenizer.from_pretrained(trained)
    assert cfg.model_type == "qwen3" and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (384, 1024, 6)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 2, 64)
    for width in (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim):
        assert width % 32 == 0  # MILI's CPU kernels: in_features a multiple of 32
    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert 10e6 <= sum(t.numel() for t in tensors.values()) <= 30e6
    assert len(tok) == cfg.vocab_size == 4096  # a BPE trained on the corpus, specials included

    ids = [tok.convert_tokens_to_ids(t) for t in
           ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]]
    assert ids == list(range(4089, 4096))
    assert tok.eos_token_id == ids[2] == cfg.eos_token_id and tok.pad_token_id == ids[0]
    gen = json.loads((trained / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids[2], ids[0]] and gen["do_sample"]
    text = "In the beginning God created the heaven and the earth. <think>x</think> Hello 👋"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc) == text and ids[3] in enc and len(enc) < len(text) / 2.5  # merges, exact round trip

    from mili.tokenizer.tokenizer import apply_chat_template

    messages = [{"role": "user", "content": "Hello"}]
    assert apply_chat_template(tok, messages) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert apply_chat_template(tok, messages, True, {"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_heldout_cross_entropy(trained):
    """Per-token cross-entropy on the 12 chapters training never saw (tests/data/demo/heldout.txt),
    read as the training script reads text (256-token windows), in float32."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from mili.demo.train import cross_entropy, evaluation_text, parse_chapters

    tok = AutoTokenizer.from_pretrained(trained)
    model = Qwen3ForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    ids = tok(evaluation_text(parse_chapters((DATA / "heldout.txt").read_text())), add_special_tokens=False)["input_ids"]
    ce, n = cross_entropy(model, ids, 256)
    assert n > 8000
    assert ce < HELDOUT_CE_BOUND, ce


@pytest.mark.parametrize("thinking", [False, True])
def test_greedy_hello_ends_by_itself_in_corpus_english(demo_llm, thinking):
    from mili import SamplingParams

    out = demo_llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=100),
                        chat_template_kwargs={"enable_thinking": thinking}, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 100, out.text
    assert out.token_ids[-1] == demo_llm.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert out.text.strip() and in_corpus_share(out.text) >= 0.9, out.text


def test_replies_are_english_from_the_corpus(demo_llm):
    from mili import SamplingParams

    prompts = ["Who are you?", "What does John 3:16 say?", "Tell me about wisdom.", "Give me a verse."]
    outs = demo_llm.chat([[{"role": "user", "content": p}] for p in prompts],
                         SamplingParams(temperature=0, max_tokens=100),
                         chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(in_corpus_share(t) >= 0.9 for t in texts), texts
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 3, texts


def test_training_a_few_steps_lowers_the_loss(tmp_path):
    """The training script itself, on a slice of the corpus (the held-out chapters) with a small vocabulary."""
    import csv

    from mili.demo.train import main

    assert main(["--out", str(tmp_path), "--corpus", str(DATA / "heldout.txt"), "--steps", "16",
                 "--batch", "4", "--seq-len", "64", "--vocab-size", "512", "--chat-samples", "200",
                 "--log-every", "1", "--threads", "1", "--no-final"]) == 0
    losses = [float(r["loss"]) for r in csv.DictReader(open(tmp_path / "loss.csv"))]
    assert len(losses) == 16
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses
    assert (tmp_path / "checkpoint" / "model.safetensors").is_file()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 16 and result["tokens_seen"] == 16 * 4 * 64
