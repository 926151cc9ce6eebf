"""Incremental detokenization and stop strings, one ``TextStream`` per generated sequence.

Byte-level BPE (Qwen3) splits one character over several tokens, so a token's text is not always a
whole character. ``tokenizers``' own ``DecodeStream`` (Rust, O(1) work per token) emits text only once
it forms whole characters; whatever it still holds when the sequence ends is taken from one final
``decode``. The stream's text therefore equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``
when no stop string cut it.
"""

from __future__ import annotations

from functools import partial

from tokenizers.decoders import DecodeStream


class TextStream:
    """The output text of one sequence, built token by token, with stop strings and streaming.

    ``text`` only ever holds complete characters. ``take_delta()`` hands out text once, never
    retracting it: while the stream runs it keeps back the longest suffix that could still become a
    stop string. When a stop string appears, the text is cut just before the earliest one (which is
    not part of the output) and the stream is finished; ``stop_string`` says which one matched.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | str | None,
                 skip_special_tokens: bool = True):
        # The output is decoded on its own (not after the prompt's tail) so that ``text`` is exactly
        # ``tokenizer.decode(output_ids)``; byte-level BPE needs no left context.
        self.num_prompt_tokens = len(prompt_token_ids) if prompt_token_ids is not None else 0
        if isinstance(stop, str):
            stop = [stop]
        self.stop: list[str] = list(dict.fromkeys(s for s in (stop or []) if s))
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._tokenizer, self._skip_special_tokens = tokenizer, skip_special_tokens
        # DecodeStream.step(tokenizer, id), bound once: fast (Rust) tokenizers only, like every Qwen3's
        self._step = partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, tokenizer.backend_tokenizer)
        self._ids: list[int] = []  # the output's ids (for the last decode)
        self._parts: list[str] = []  # the text, in pieces (joined lazily)
        self._len = 0
        self._tail = ""  # the text's last (longest stop - 1) characters: where a match can start
        self._unsent: list[str] = []  # text not yet taken by take_delta(), in pieces
        self._hold = 0  # length of the suffix that may be the start of a stop string
        self.num_tokens = 0
        self.finished = False
        self.stop_string: str | None = None

    # -- reading ----------------------------------------------------------------------------
    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def take_delta(self) -> str:
        """Text not taken before; while running, minus a suffix that may start a stop string."""
        unsent = self._unsent
        if not unsent:
            return ""
        pending = unsent[0] if len(unsent) == 1 else "".join(unsent)
        keep = 0 if self.finished or not self._hold else min(self._hold, len(pending))
        if not keep:  # (the usual case: no stop string could start here)
            self._unsent = []
            return pending
        out = pending[:len(pending) - keep]
        self._unsent = [pending[len(out):]]
        return out

    # -- writing ----------------------------------------------------------------------------
    def append(self, token_id: int) -> bool:
        """Add one generated token; True when a stop string now appears (the stream then ends)."""
        if self.finished:
            return False
        self.num_tokens += 1
        token_id = int(token_id)
        self._ids.append(token_id)
        try:
            new = self._step(token_id)
        except Exception:  # an id past the tokenizer's vocabulary (embedding padding): no text
            return False
        if not new:
            return False
        if self.stop:
            return self._add_checked(new)
        self._parts.append(new)  # (_add, inline: this runs per token)
        self._unsent.append(new)
        self._len += len(new)
        return False

    def finish(self) -> None:
        """The sequence ended for another reason (EOS, length, abort): release everything held."""
        if self.finished:
            return
        # everything pushed so far was handed out (only a stop string cuts the text, and it ends the stream);
        # a dangling partial character becomes U+FFFD, as in decode()
        rest = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)[self._len:]
        if rest:
            self._add(rest)
        self.finished = True
        self._hold = 0

    # -- internals --------------------------------------------------------------------------
    def _add(self, new: str) -> None:
        self._parts.append(new)
        self._unsent.append(new)
        self._len += len(new)

    def _add_checked(self, new: str) -> bool:
        tail = self._tail
        window = tail + new
        best = -1
        best_stop = None
        for s in self.stop:
            # Every earlier match was found already, so a new one must end inside ``new``.
            i = window.find(s, max(0, len(tail) - len(s) + 1))
            if i != -1 and (best == -1 or i < best):
                best, best_stop = i, s
        if best_stop is not None:
            cut = self._len - len(tail) + best  # the stop string starts here in the full text
            self._add(new)
            self._truncate(cut)
            self.stop_string = best_stop
            self.finished = True
            self._hold = 0
            return True
        self._add(new)
        keep = self._max_stop - 1
        self._tail = window[-keep:] if keep > 0 else ""
        self._hold = self._stop_prefix_len(self._tail)
        return False

    def _stop_prefix_len(self, tail: str) -> int:
        """Length of the longest suffix of ``tail`` that is a proper prefix of a stop string."""
        for k in range(len(tail), 0, -1):
            suffix = tail[-k:]
            if any(len(s) > k and s.startswith(suffix) for s in self.stop):
                return k
        return 0

    def _truncate(self, cut: int) -> None:
        text = self.text
        pending = "".join(self._unsent)
        sent = self._len - len(pending)
        cut = max(cut, sent)  # never retract text already taken (cannot happen: it was held)
        self._parts = [text[:cut]] if cut else []
        self._unsent = [pending[:cut - sent]] if cut > sent else []
        self._len = cut
