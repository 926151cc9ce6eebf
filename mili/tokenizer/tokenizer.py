"""Loading a checkpoint's tokenizer and EOS ids, rendering chat prompts, and encoding prompts."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from mili.errors import ChatTemplateError, InvalidRequest, ModelLoadError, NotContinuable
from mili.tokenizer.tool_parsers import messages_for_template

TEMPLATE_IMAGE = {"type": "image"}  # an image part as chat templates read it (engine/media.py makes them)

# apply_chat_template's own parameters: a chat_template_kwargs key with one of these names would
# collide with (or silently change) how MILI calls it.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "add_generation_prompt", "tokenize", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
    "continue_final_message", "chat_template",
})


def load_tokenizer(path: str):
    """The (fast, ``tokenizers``-backed) Hugging Face tokenizer stored in the folder ``path``. Loaded once per process
    and folder as its files are (their sizes and modification times): engines built again from the same folder in one
    process share it, not reading Qwen's 11 MB tokenizer.json again (about a second each); a changed file loads
    afresh. (A tokenizer is not changed once loaded: MILI only reads it.)"""
    try:
        folder = os.path.isdir(path)  # (else a name transformers resolves itself)
        return _load_tokenizer(os.path.realpath(path) if folder else path, _files_state(path) if folder else ())
    except Exception as e:  # missing files, unknown class, corrupt json: all mean "cannot load"
        raise ModelLoadError(f"cannot load the tokenizer from {path!r}: {type(e).__name__}: {e}",
                             param="tokenizer") from e


def _files_state(path: str) -> tuple:
    """(name, size, mtime) of each file in the folder ``path`` (what a tokenizer loads from), or () if it is none."""
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file()))
    except OSError:
        return ()


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, state: tuple):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def load_eos_token_ids(path: str, tokenizer, hf_config) -> list[int]:
    """The token ids that end generation, in order, without duplicates.

    From ``generation_config.json`` in ``path`` when it names any (Qwen3: ``[<|im_end|>,
    <|endoftext|>]``), else the model config's ``eos_token_id``, else the tokenizer's EOS token.
    ``eos_token_id`` may be an int or a list in either file.
    """
    ids: list[int] = []
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path, encoding="utf-8") as f:
                ids = _as_id_list(json.load(f).get("eos_token_id"))
        except (OSError, ValueError, TypeError, AttributeError):
            ids = []  # an unreadable generation config is optional: fall through to the others
    if not ids and hf_config is not None:
        ids = _as_id_list(getattr(hf_config, "eos_token_id", None))
    if not ids and tokenizer is not None:
        ids = _as_id_list(getattr(tokenizer, "eos_token_id", None))
    return list(dict.fromkeys(ids))


def _normalize_messages(messages: Any) -> list[dict]:
    """Check the conversation's shape; text-only content-part lists are flattened to a string."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects",
                             param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content', "
                                 f"not {type(m).__name__}", param="messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text, and images as engine/media.py leaves them
            for part in content:
                if part != TEMPLATE_IMAGE and not (isinstance(part, dict) and part.get("type") == "text"
                                                   and isinstance(part.get("text"), str)):
                    raise InvalidRequest(f"messages[{i}].content: only text content parts "
                                         "({'type': 'text', 'text': ...}) and images are supported",
                                         param="messages")
            if TEMPLATE_IMAGE not in content:
                m = {**m, "content": "".join(part["text"] for part in content)}
        elif content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or null, "
                                 f"not {type(content).__name__}", param="messages")
        out.append(m)
    return out


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> str:
    """The prompt text for a conversation, rendered with the tokenizer's chat template.

    ``chat_template_kwargs`` go to the template (Qwen3: ``enable_thinking``, ``tools``...).
    ``continue_final_message`` (vLLM's, through transformers as vLLM does): the final message, an
    assistant's, is left open for the model to continue ("prefill"): the template renders it whole and the
    text is cut at the end of its content. Raises ``InvalidRequest`` (param ``messages``) when there is no
    template, the messages are malformed, or the template itself rejects them.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("this model's tokenizer has no chat template; send a plain prompt "
                             "(completions) instead of messages", param="messages")
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs))
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}",
                             param="chat_template_kwargs")
    conversation = messages_for_template(tokenizer, _normalize_messages(messages))
    if continue_final_message:
        _check_continuable(conversation, add_generation_prompt)
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **chat_template_kwargs)
    except Exception as e:  # jinja TemplateError (incl. raise_exception), TypeError, KeyError...
        raise ChatTemplateError(f"the chat template could not render these messages: "
                                f"{type(e).__name__}: {e}") from e
    if not isinstance(text, str):  # tokenize=False always gives text; guard against odd tokenizers
        raise InvalidRequest("the chat template did not render to text", param="messages")
    return text


def _check_continuable(messages: list[dict], add_generation_prompt: bool) -> None:
    """vLLM's rules for ``continue_final_message``: not with ``add_generation_prompt`` (which defaults to true),
    and the final message is the assistant's, with text to continue."""
    if add_generation_prompt:
        raise InvalidRequest("Cannot set both continue_final_message and add_generation_prompt to true "
                             "(add_generation_prompt defaults to true: send false)", param="add_generation_prompt")
    final = messages[-1]
    if final.get("role") != "assistant":
        raise NotContinuable("continue_final_message needs the last message to be the assistant's")
    if not isinstance(final.get("content"), str):
        raise NotContinuable("continue_final_message needs the final assistant message to have text content")


def encode_prompt(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``.

    Pass ``add_special_tokens=False`` for text rendered by a chat template (it already holds every
    special token it needs). With ``True`` the tokenizer's own specials (a BOS, for tokenizers that
    add one; Qwen3 adds none) are added, except a BOS the text already starts with.
    """
    if add_special_tokens:
        bos = getattr(tokenizer, "bos_token", None)
        if bos and text.startswith(bos):
            add_special_tokens = False
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
                ) -> tuple[str, list[int]]:
    """The chat template's text for ``messages`` and its token ids (its specials are in the text)."""
    text = apply_chat_template(tokenizer, messages, add_generation_prompt, chat_template_kwargs,
                               continue_final_message)
    return text, encode_prompt(tokenizer, text, add_special_tokens=False)


TURN_END = "<|im_end|>"  # how Qwen's chat templates end every turn (then a newline)
MAX_TURN_ENDS = 5  # a prompt's turn ends the prefix cache snapshots at: its first (the system prompt's) and last 4


def turn_end_tokens(tokenizer) -> tuple[int, int | None] | None:
    """The ids ending a chat turn: ``<|im_end|>`` and the newline token after it (None: one token does not spell
    "\\n"); None where the vocabulary has no ``<|im_end|>``."""
    end = tokenizer.convert_tokens_to_ids(TURN_END)
    if not isinstance(end, int) or end == tokenizer.unk_token_id:
        return None
    newline = tokenizer.encode("\n", add_special_tokens=False)
    return end, newline[0] if len(newline) == 1 else None


def turn_ends(token_ids: list[int], tokens: tuple[int, int | None], limit: int = MAX_TURN_ENDS) -> list[int]:
    """Where the chat turns in ``token_ids`` end: the position after each ``<|im_end|>`` (after its newline, when the
    newline follows), before the prompt's last token; the first and the last ``limit - 1`` of them. Any prompt is
    scanned, rendered by a chat template or not; the scan is ``list.index``'s (C), so a long prompt costs little."""
    end, newline = tokens
    found, i = [], -1
    while True:
        try:
            i = token_ids.index(end, i + 1)
        except ValueError:
            break
        pos = i + 2 if newline is not None and i + 1 < len(token_ids) and token_ids[i + 1] == newline else i + 1
        if pos < len(token_ids):
            found.append(pos)
    return found if len(found) <= limit else [found[0], *found[len(found) - limit + 1:]]
