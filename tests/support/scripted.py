"""Scripted checkpoints: real Qwen3 checkpoints whose greedy output is written in advance (a chain of token ids),
the chains the server tests use, and the chat template's token counts for their prompts."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from support.checkpoints import QWEN3_TOKENIZER, add_tokenizer


def build_scripted_checkpoint(path: Path, chain: dict[int, int], hidden: int = 32) -> Path:
    """A real Qwen3 checkpoint whose greedy next token is ``chain[current token]``.

    Each token of the chain gets a one-hot embedding; every layer's residual branch is zeroed (o_proj,
    down_proj), so the final hidden state is the current token's (normalised) embedding, and an untied
    lm_head maps it to its successor. Tokens outside the chain get small random embeddings."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokens = list(dict.fromkeys([*chain, *chain.values()]))
    assert len(chain) <= hidden
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False, eos_token_id=151645, bos_token_id=None, pad_token_id=151643)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.normal_(0, 0.01)
        head.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, (current, nxt) in enumerate(chain.items()):
            emb[current].zero_()
            emb[current, i] = 1.0
            head[nxt, i] = 4.0  # a margin of 4 * sqrt(hidden) logits over every other token
        del tokens
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(path)
    add_tokenizer(path)
    return path


# The scripted model's greedy answer to a chat prompt: "<think>Let me think</think>\n\nHello!" with
# thinking on; "Hello!" with it off (the template then ends the prompt with "</think>\n\n").
CHAIN = {198: 151667, 151667: 10061, 10061: 752, 752: 1744, 1744: 151668, 151668: 271, 271: 9707,
         9707: 0, 0: 151645}


# A scripted model that thinks, talks and calls a tool: with thinking on, "<think>Let me think</think>\n\n"
# then CALLER_TEXT; with it off (the prompt then ends with "</think>\n\n", token 271), CALLER_TEXT alone.
CALLER_THINKING = {198: 151667, 151667: 10061, 10061: 752, 752: 1744, 1744: 151668, 151668: 271}
CALLER_TEXT = 'I will check.\n<tool_call>\n{"name": "get_time", "arguments" : {"zone":"CET"}}\n</tool_call>'


def build_caller_checkpoint(path: Path) -> tuple[Path, dict[int, int]]:
    """The scripted checkpoint above, and its chain."""
    chain = {**CALLER_THINKING, **script_text(271, CALLER_TEXT, avoid=tuple(CALLER_THINKING))}
    return build_scripted_checkpoint(path, chain, hidden=64), chain


def chain_length(chain: dict[int, int], start: int, end: int = 151645) -> int:
    """How many tokens the scripted model writes after ``start``, ``end`` included."""
    n, token = 0, start
    while token != end:
        token, n = chain[token], n + 1
    return n


@functools.cache
def _qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)


def prompt_tokens(messages: list[dict], **kwargs) -> int:
    """How many tokens HF's Qwen3 chat template makes of ``messages`` (with the generation prompt);
    ``kwargs`` go to the template (tools, enable_thinking)."""
    tokenizer = _qwen3_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


@functools.cache
def _vocab_pieces() -> dict[str, list[int]]:
    """The Qwen3 vocabulary by decoded text: each piece's token ids (pieces that are not whole characters left out)."""
    backend = _qwen3_tokenizer().backend_tokenizer
    pieces: dict[str, list[int]] = {}
    for token, i in backend.get_vocab().items():
        piece = backend.decoder.decode([token])
        if "\ufffd" not in piece:
            pieces.setdefault(piece, []).append(i)
    return pieces


def script_text(start: int, text: str, end: int = 151645, avoid: tuple[int, ...] = ()) -> dict[int, int]:
    """A chain (for ``build_scripted_checkpoint``) whose greedy output after token ``start`` decodes to
    ``text``, then ``end``. The chain is first-order, so no token may appear twice: repeated pieces of
    ``text`` are spelled with other tokens (longest unused vocabulary piece first), and none of ``avoid``
    (the tokens of another chain this one joins) is used."""
    pieces = _vocab_pieces()
    import random

    rng = random.Random(0)
    for _ in range(5000):  # random spellings (longer pieces likelier) until one uses no token twice
        used, ids, pos = {start, end, *avoid}, [], 0
        while pos < len(text):
            options = [(length, i) for length in range(min(16, len(text) - pos), 0, -1)
                       for i in pieces.get(text[pos:pos + length], []) if i not in used]
            if not options:
                break
            length, i = rng.choices(options, weights=[n * n for n, _ in options])[0]
            ids.append(i)
            used.add(i)
            pos += length
        if pos == len(text):
            break
    else:
        raise ValueError(f"no spelling of {text!r} found that uses each token once")
    chain = [start, *ids, end]
    return dict(zip(chain, chain[1:]))
