"""The offline demo models, which need no download.

- ``demo``: a small Qwen3 (11M parameters) that MILI trained on the King James Bible with its own
  script (``python -m mili.demo.train``), shipped in the package (``mili/demo/checkpoint``: bf16
  safetensors, BPE tokenizer, ChatML template with thinking on/off). It writes KJV-style English and
  ends its chat turns by itself.
- ``demo-hybrid``: its hybrid twin, a Qwen3.5 text model (Gated DeltaNet + gated attention, 13M
  parameters) trained by the same script (``--arch hybrid``) on the same data with the same tokenizer,
  with a jointly trained MTP head (``mtp.*`` tensors, as the hub's Qwen3.5 checkpoints carry), shipped in
  ``mili/demo/checkpoint-hybrid``.
- ``demo-random``: a tiny random Qwen3 with a byte-level tokenizer, built locally on first use (config,
  bf16 safetensors, tokenizer, chat template, generation config) in the cache, the same bytes on every
  machine, and reused later. Its text is random, but it runs the whole engine: the tests that need
  exact properties of a random model (a 320-token byte vocabulary, say) use it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

DEMO_MODEL = "demo"
DEMO_RANDOM_MODEL = "demo-random"
DEMO_HYBRID_MODEL = "demo-hybrid"
DEMO_VERSION = "demo-random-v1"  # bump when the recipe below changes, so stale caches are not reused

_SEED = 1234
_INIT_STD = 0.05  # a little larger than HF's 0.02, so the random logits are not near-flat
# Qwen3's special tokens that the demo has too, with Qwen3's "special" flags (think tags are not).
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_NON_SPECIAL = ["<think>", "</think>"]
# ChatML, as Qwen3 renders it for plain conversations (no tools, no reasoning history).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# The files a finished build has; a folder missing one is not used.
_REQUIRED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json")
_lock = threading.Lock()


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("MILI_CACHE_DIR") or Path.home() / ".cache" / "mili"
    return Path(cache_dir).expanduser()


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in _REQUIRED)


def demo_checkpoint(hybrid: bool = False) -> str:
    """The path of the trained demo checkpoint (``hybrid``: its hybrid twin's): a folder inside the installed
    package."""
    from mili.demo import CHECKPOINT_DIR, HYBRID_CHECKPOINT_DIR

    folder = HYBRID_CHECKPOINT_DIR if hybrid else CHECKPOINT_DIR
    if not _is_complete(folder):
        from mili.errors import ModelLoadError

        name = DEMO_HYBRID_MODEL if hybrid else DEMO_MODEL
        raise ModelLoadError(f"the {name!r} checkpoint is missing from the package ({folder}): reinstall "
                             f"MILI, or use {DEMO_RANDOM_MODEL!r}")
    return str(folder)


def demo_random_checkpoint(cache_dir: str | os.PathLike | None = None) -> str:
    """The path of the random demo checkpoint folder (``<cache>/demo-random-v1``), built on first use.

    ``cache_dir`` defaults to ``$MILI_CACHE_DIR`` or ``~/.cache/mili``. The build is deterministic
    and atomic: it happens in a temporary folder beside the target, which is then renamed into
    place, so a reader never sees a half-built folder and two racing builders are both fine.
    """
    root = _cache_root(cache_dir)
    final = root / DEMO_VERSION
    if _is_complete(final):
        return str(final)
    with _lock:
        if _is_complete(final):
            return str(final)
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}.tmp-", dir=root))
        try:
            _build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp (and safetensors) make things private; a cache is not
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if final.exists() and not _is_complete(final):  # debris of some other writer
                trash = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}.old-", dir=root))
                try:
                    os.replace(final, trash / "x")
                except OSError:
                    pass
                shutil.rmtree(trash, ignore_errors=True)
            try:
                os.replace(tmp, final)
            except OSError:
                if not _is_complete(final):  # not a lost race: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return str(final)


def build_demo_tokenizer():
    """Byte-level BPE over the 256 byte symbols (no merges) plus Qwen3's chat tokens, wrapped as a
    ``transformers`` fast tokenizer with a ChatML template. Ids: bytes 0-255 (by byte value), then
    ``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258, ``<think>`` 259, ``</think>`` 260."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte <-> symbol table

    vocab = {symbol: b for b, symbol in sorted(bytes_to_unicode().items())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _NON_SPECIAL])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=4096,
        add_prefix_space=False)


def _build(path: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_demo_tokenizer()
    tokenizer.save_pretrained(path)
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    vocab_size = -(-len(tokenizer) // 64) * 64
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=True, rope_theta=1000000.0, initializer_range=_INIT_STD, bos_token_id=endoftext,
        eos_token_id=im_end, pad_token_id=endoftext)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(_SEED)
        model = Qwen3ForCausalLM(config).float().eval()
        with torch.no_grad():  # random norm gains, so the q/k/layer norms are exercised
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.8, 1.2)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 1.6 MB file needs no "writing shards" bar
    try:
        model.save_pretrained(path)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
