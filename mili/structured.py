"""Structured outputs on xgrammar: checking a constraint (API side) and enforcing it (engine core).

API side, ``check(structured, param)``: builds the vocabulary-free grammar, which is cheap (milliseconds)
and finds every invalid JSON schema, regex, EBNF grammar or structural tag: an ``InvalidRequest`` naming
the request field. Engine core, ``GrammarManager``: compiles grammars against the tokenizer's vocabulary
in a worker thread (xgrammar releases the GIL while compiling, so steps go on meanwhile), cached by spec,
and fills a step's token bitmasks in parallel threads; ``SeqGrammar``: one matcher per constrained
sequence, advanced with each sampled token.

JSON whitespace is bounded (``MAX_WHITESPACE`` characters between two tokens of JSON), so even a random
model cannot spend its ``max_tokens`` on spaces; schemas are strict (xgrammar's default, as vLLM):
properties not listed are not generated.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from mili.errors import InvalidRequest
from mili.sampling_params import StructuredOutputsParams

log = logging.getLogger("mili")

CACHE_SIZE = 256  # compiled grammars kept by the engine core
MAX_WHITESPACE = 8  # at most this many whitespace characters wherever JSON allows whitespace
_JSON_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: any object, additional properties allowed


def _xgr():
    import xgrammar  # imports torch: loaded on first use only

    return xgrammar


def _json_options(kind: str) -> dict:
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE, "strict_mode": kind == "json"}


def _clean(error: Exception) -> str:
    """xgrammar's message without its C++ location prefix ("[21:30:35] /project/cpp/x.cc:83: ")."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)


def check(structured: StructuredOutputsParams, param: str) -> None:
    """Raise InvalidRequest (``param``) if the constraint cannot be built: a bad schema, regex or grammar."""
    kind, text = structured.spec()
    error = _spec_error(kind, text)
    if error is not None:
        what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
                "grammar": "grammar", "structural_tag": "structural tag"}[kind]
        raise InvalidRequest(f"invalid {what}: {error}", param=param)


@functools.lru_cache(maxsize=1024)
def _spec_error(kind: str, text: str) -> str | None:
    """What is wrong with a constraint, or None (cached: a client repeats its schemas)."""
    try:
        build_grammar(kind, text)
    except Exception as e:
        return _clean(e)
    return None


# xgrammar 0.2.8 writes the characters of a JSON string with maxLength as [^"\\\r\n] (in its EBNF), which
# lets a tab or another control character in: invalid JSON (RFC 8259 wants them escaped; json.loads
# refuses them). Its unbounded strings exclude \0-\x1f; bounded ones get that class here.
_BOUNDED_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def build_grammar(kind: str, text: str):
    """The vocabulary-free xgrammar ``Grammar`` of a spec (raises on an invalid one)."""
    grammar = _xgr().Grammar
    if kind == "regex":
        return grammar.from_regex(text)
    if kind == "grammar":
        return grammar.from_ebnf(text)
    if kind in ("json", "json_object"):
        built = grammar.from_json_schema(text if kind == "json" else _JSON_OBJECT_SCHEMA, **_json_options(kind))
    else:
        built = grammar.from_structural_tag(text)
    ebnf = str(built)
    return grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)) \
        if _BOUNDED_STRING_CHARS in ebnf else built


class GrammarManager:
    """The engine core's grammar compiler: one worker thread, the tokenizer's vocabulary loaded on first use."""

    def __init__(self, tokenizer_path: str, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's (the bitmask covers padding ids too: masked)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mili-grammar")
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # by spec, least recently used first
        self._batch = None  # xgrammar's BatchGrammarMatcher: fills the rows' bitmasks in threads
        self._fill_executor = ThreadPoolExecutor(1, thread_name_prefix="mili-bitmask")

    def compile(self, structured: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar, shared by every request with the same spec (one compile, at
        most ``CACHE_SIZE`` kept); the step loop polls it, so compiles never block a step."""
        spec = structured.spec()
        future = self._cache.get(spec)
        if future is None or future.cancelled():
            future = self._cache[spec] = self._executor.submit(self._compile, *spec)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        return future

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                xgr = _xgr()
                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def _compile(self, kind: str, text: str):
        return self._get_compiler().compile_grammar(build_grammar(kind, text))

    def bitmask(self, grammars: list[SeqGrammar | None], drafts: list[list[int]] | None = None) -> Future | None:
        """A future of the token bitmask of a step's sampling rows ([rows, ceil(vocab / 32)] int32) and the
        rows it constrains (those whose grammar is active; None if none is); None when no row can be. It is
        filled in threads (xgrammar's batch fill, without the GIL) while the model computes the step's logits.
        ``drafts`` (speculative decoding): each sequence's draft; it then has 1 + len(draft) rows, the row
        after each draft token allowing what the grammar allows after it."""
        drafts = drafts or [[] for _ in grammars]
        first = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        plain = [(g.matcher, first[i]) for i, g in enumerate(grammars) if g is not None and g.active and not drafts[i]]
        ahead = [(g, list(range(first[i], first[i + 1])), drafts[i]) for i, g in enumerate(grammars)
                 if g is not None and drafts[i]]
        if not plain and not ahead:
            return None
        return self._fill_executor.submit(self._fill, plain, ahead, first[-1])

    def _fill(self, plain: list, ahead: list, num_rows: int):
        xgr = _xgr()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        rows = [row for _, row in plain]
        if plain:
            self._batch.batch_fill_next_token_bitmask([m for m, _ in plain], bitmask, rows)
        for grammar, draft_rows, draft in ahead:
            rows += grammar.fill_ahead(bitmask, draft_rows, draft)
        return bitmask, sorted(rows) or None


class SeqGrammar:
    """One sequence's constraint: an xgrammar matcher, idle until ``start_after_token_id`` (if any) is sampled.

    ``stop_ids``: the tokens that may end the output once the grammar is complete (the request's EOS and
    stop token ids)."""

    __slots__ = ("matcher", "waiting_for")

    def __init__(self, compiled, stop_ids: list[int], start_after_token_id: int | None):
        self.matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=stop_ids or None)
        self.waiting_for = start_after_token_id

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def next_token_bitmask(self, vocab_size: int, ahead: list[int] = ()):
        """This sequence's allowed next tokens alone ([1, ceil(vocab / 32)] int32), without the batch fill; after
        the tokens ``ahead`` (drafts before this position) when given; None where no grammar applies (not
        started yet, or ``ahead`` broke or ended it: that row is never reached)."""
        bitmask = _xgr().allocate_token_bitmask(1, vocab_size)
        rows = [None] * len(ahead) + [0]
        return bitmask if self.fill_ahead(bitmask, rows, list(ahead)) == [0] else None

    def fill_ahead(self, bitmask, rows: list, draft: list[int]) -> list[int]:
        """Fill ``bitmask`` row ``rows[j]`` (None: skip) with the tokens allowed after ``draft[:j]``
        (speculative decoding; len(rows) <= len(draft) + 1), rolling the matcher back afterwards; returns the
        rows filled (where the grammar is active). A draft token the grammar forbids, or one that ends it,
        ends the filling: the rows after it are never reached (the sampler cannot accept a forbidden token,
        and a sequence ends at the token completing its grammar)."""
        filled, waiting, accepted = [], self.waiting_for, 0
        for j, row in enumerate(rows):
            if waiting is None and row is not None:
                self.matcher.fill_next_token_bitmask(bitmask, row)
                filled.append(row)
            if j == len(rows) - 1:
                break
            if waiting is not None:
                waiting = None if draft[j] == waiting else waiting
                continue
            if not self.matcher.accept_token(draft[j]):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break
        if accepted:
            self.matcher.rollback(accepted)
        return filled

    def accept(self, token: int) -> bool:
        """Advance with a sampled token; True when the output is complete (the grammar took a stop token)
        or the token broke it (which the bitmask prevents; logged, and the sequence ends)."""
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return False
        if not self.matcher.accept_token(token):
            log.error("token %d was sampled against its grammar; the sequence ends", token)
            return True
        return self.matcher.is_terminated()
