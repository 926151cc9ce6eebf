"""Qwen3 thinking: split generated text into the ``<think>…</think>`` reasoning and the answer.

``split_reasoning`` is a pure function of the text so far, and both of its parts only ever grow as the
text grows, so a stream can send the difference between consecutive splits and never retract anything.

One rule for every dialect, vLLM's (its qwen3 reasoning parser): the reasoning is the text between the
tags and the content the text after ``</think>``, both as the model wrote them; no whitespace or newline
is stripped (Qwen3 writes ``</think>\n\n``, so the content starts with those newlines, as on vLLM).
"""

from __future__ import annotations

from mili.sampling_params import ThinkingTokens

THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str, final: bool = True) -> tuple[str | None, str]:
    """(reasoning or None, content). Reasoning is what a leading ``<think>`` opens (or, for templates
    that put ``<think>`` in the prompt, whatever precedes ``</think>``); None when there is none.
    While not ``final``, text that may still become a leading ``<think>`` is undecided: ("", "")."""
    stripped = text.lstrip()
    if not final and THINK_START.startswith(stripped):
        return "", ""
    opened = stripped.startswith(THINK_START)
    end = text.find(THINK_END)
    if not opened and end == -1:
        return None, text
    start = text.index(THINK_START) + len(THINK_START) if opened else 0
    if end == -1:
        reasoning = text[start:]
        if not final:  # hold back what may be the start of "</think>"
            reasoning = reasoning[:len(reasoning) - partial_suffix(reasoning, THINK_END)]
        return reasoning, ""
    return text[start:end] if end >= start else "", text[end + len(THINK_END):]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningStream:
    """Turns the growing text of one choice into (reasoning delta, content delta) pairs.

    ``prompt_opened``: the chat template already wrote ``<think>`` at the end of the prompt, so the
    generated text starts inside the reasoning."""

    def __init__(self, enabled: bool = True, prompt_opened: bool = False):
        self.enabled = enabled
        self.text = THINK_START if enabled and prompt_opened else ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = split_reasoning(self.text, final) if self.enabled else (None, self.text)
        reasoning = reasoning or ""
        r, c = reasoning[self._sent_reasoning:], content[self._sent_content:]
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        return r, c


def think_end_token_id(tokenizer) -> int | None:
    """The id of ``</think>`` when the vocabulary has it as one token (every Qwen3's), else None."""
    return _one_token(tokenizer, THINK_END)


def _one_token(tokenizer, text: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(text)
    return token_id if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else None


def thinking_tokens(tokenizer, message: str | None) -> ThinkingTokens | None:
    """What a thinking budget needs of the tokenizer: ``<think>`` and ``</think>`` as single tokens (None where the
    vocabulary lacks them: the model does not think), and the ids it forces: ``message`` (as written), ``</think>``."""
    start, end = _one_token(tokenizer, THINK_START), _one_token(tokenizer, THINK_END)
    if start is None or end is None:
        return None
    forced = tokenizer.encode(message, add_special_tokens=False) if message else []
    return ThinkingTokens(start, end, (*forced, end))


def constraint_start(tokenizer, prompt_text: str, thinking: bool) -> int | None:
    """The token after which a structured-output constraint starts in a chat reply: ``</think>`` when
    the model thinks first (thinking on, and the prompt did not close the thinking itself), else None."""
    if not thinking or THINK_END in prompt_text[-len(THINK_END) - 4:]:
        return None
    return think_end_token_id(tokenizer)
