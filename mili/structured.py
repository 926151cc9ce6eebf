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

    def bitmask(self, grammars: list[SeqGrammar | None]) -> Future | None:
        """A future of the token bitmask of a step's sampling rows ([rows, ceil(vocab / 32)] int32) and the
        rows it constrains (those whose grammar is active); None when none is. It is filled in threads
        (xgrammar's batch fill, without the GIL) while the model computes the step's logits."""
        rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
        if not rows:
            return None
        matchers = [grammars[i].matcher for i in rows]
        return self._fill_executor.submit(self._fill, matchers, rows, len(grammars))

    def _fill(self, matchers: list, rows: list[int], num_rows: int):
        xgr = _xgr()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask, rows


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

    def next_token_bitmask(self, vocab_size: int):
        """This sequence's allowed next tokens alone ([1, ceil(vocab / 32)] int32), without the batch fill."""
        bitmask = _xgr().allocate_token_bitmask(1, vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask

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
