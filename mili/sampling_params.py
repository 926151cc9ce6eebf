"""SamplingParams: how one request is decoded. Validated on construction (vLLM's names and defaults)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field, fields
from typing import Any

from mili.errors import InvalidRequest

GREEDY_EPS = 1e-5
SEED_RANGE = (-2**63, 2**63 - 1)  # a 64-bit seed; sequence i of a request draws from seed + 7919 * i


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's names): exactly one of ``json`` (a JSON
    schema, as an object or its text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of
    these strings) or ``grammar`` (EBNF in xgrammar's / llama.cpp's GBNF dialect); ``structural_tag``
    (an xgrammar structural tag, as JSON text) is what the server builds for forced tool calls.

    ``start_after_token_id``: the constraint applies only to tokens after this one appears in the
    output (the server sets it to ``</think>`` when Qwen3 thinks first); None: from the first token."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    start_after_token_id: int | None = None

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise InvalidRequest("structured outputs take exactly one of json, json_object, regex, choice, grammar "
                                 f"or structural_tag, got {kinds or 'none'}", param="structured_outputs")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise InvalidRequest("choice must be a non-empty list of strings", param="structured_outputs")

    def kinds(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "start_after_token_id"
                and getattr(self, f.name) not in (None, False)]

    def spec(self) -> tuple[str, str]:
        """(kind, text): what the grammar compiler takes, and the key compiled grammars are cached by."""
        kind = self.kinds()[0]
        value = getattr(self, kind)
        if kind == "json":
            return "json", value if isinstance(value, str) else _json.dumps(value, sort_keys=True)
        if kind == "json_object":
            return "json_object", ""
        if kind == "choice":  # one alternative per choice, each a JSON-quoted (so escaped) EBNF literal
            return "grammar", "root ::= " + " | ".join(_json.dumps(c) for c in self.choice)
        return kind, value


@dataclass
class PoolingParams:
    """A pooling request (``/v1/embeddings``, ``/v1/rerank``, ``/score``): its prompt is computed, nothing is
    generated, and the last token's final hidden state is turned into ``task``'s output.

    ``task``: ``embed`` (that hidden state, as float32; the API side truncates and normalises it) or ``score`` (a
    relevance score in [0, 1]: with ``score_token_ids`` (no, yes), a causal LM's P(yes) = softmax over the logits
    of those tokens, as Qwen3-Reranker's recipe computes it; without, the sigmoid of a sequence-classification
    head's logit)."""

    task: str = "embed"
    score_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.task not in ("embed", "score"):
            raise InvalidRequest(f"pooling task must be 'embed' or 'score', got {self.task!r}", param="task")


@dataclass(frozen=True)
class ThinkingTokens:
    """A thinking model's markers and what a budget forces when it runs out (filled by the engine from the
    tokenizer): ``start`` and ``end`` (``<think>``, ``</think>``), ``forced`` (the budget's message, then ``end``)."""

    start: int
    end: int
    forced: tuple[int, ...]


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length; 0: score the prompt only
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: plus the top N
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's logprob, plus the top N
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # a pooling request (embeddings, scores): the prompt only, its last token pooled (max_tokens 0); None: generate
    pooling: PoolingParams | None = None
    # a thinking model's reasoning, at most this many tokens after <think>: then the message (if any) and </think> are
    # forced, and the answer follows (vLLM's thinking_token_budget, llama.cpp's --reasoning-budget); None: no limit
    thinking_token_budget: int | None = None
    thinking_budget_message: str | None = None  # the text forced before </think> when the budget runs out
    # Filled by the engine from the checkpoint's generation config; not set by users.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)
    thinking_tokens: ThinkingTokens | None = field(default=None, repr=False)  # (with a thinking budget)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, what: str) -> None:
            raise InvalidRequest(f"{param} {what}, got {getattr(self, param)!r}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                bad(name, "must be an integer in [0, 20]")
        if self.pooling is not None:
            if self.max_tokens != 0 or self.n != 1 or self.prompt_logprobs is not None or self.structured_outputs:
                raise InvalidRequest("a pooling request generates nothing: max_tokens 0, n 1, no prompt logprobs and "
                                     "no structured outputs", param="pooling")
        least = 0 if self.prompt_logprobs is not None or self.pooling is not None else 1  # 0: generate nothing
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < least):
            bad("max_tokens", "must be an integer >= 1 (0, to score the prompt without generating, needs prompt "
                "logprobs: echo with logprobs, or prompt_logprobs)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not self.temperature >= 0:  # (NaN too)
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", "must be a 64-bit integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.thinking_token_budget is not None and (not isinstance(self.thinking_token_budget, int)
                                                       or isinstance(self.thinking_token_budget, bool)
                                                       or not 0 <= self.thinking_token_budget < 2**31):
            bad("thinking_token_budget", "must be an integer in [0, 2**31)")
        if self.thinking_budget_message is not None and not isinstance(self.thinking_budget_message, str):
            bad("thinking_budget_message", "must be a string")
        if self.structured_outputs is not None and self.min_tokens:
            bad("min_tokens", "cannot be combined with structured outputs (the grammar decides where the output "
                "ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def stop_ids(self) -> set[int]:
        """Token ids that end the sequence: stop_token_ids, plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids
