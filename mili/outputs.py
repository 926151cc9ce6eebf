"""What the engine returns: RequestOutput with one CompletionOutput per sampled sequence (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


class CompletionOutput:
    """One sequence's output so far (vLLM's shape).

    ``token_ids`` and ``logprobs`` are the sequence's own lists, shared and growing while it runs (so
    an output costs O(1), not a copy of the history): copy them to keep a snapshot. ``text`` is the
    whole text so far, joined when read; ``delta`` is the text that became final in this step.
    """

    __slots__ = ("index", "_text", "_stream", "token_ids", "finish_reason", "stop_reason", "logprobs",
                 "cumulative_logprob", "delta")

    def __init__(self, index: int, text: str | None = None, token_ids: list[int] | None = None,
                 finish_reason: str | None = None, stop_reason: int | str | None = None,
                 logprobs: list[dict[int, Logprob]] | None = None, cumulative_logprob: float | None = None,
                 delta: str = "", stream=None):
        self.index = index
        self._text, self._stream = text, stream  # the text, or the TextStream that holds it
        self.token_ids = token_ids if token_ids is not None else []
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | "error" | None while running
        self.stop_reason = stop_reason  # the stop token id / stop string, None for EOS or length
        self.logprobs = logprobs  # per generated token: sampled + top-N
        self.cumulative_logprob = cumulative_logprob
        self.delta = delta  # text that became final since the previous output (for streaming)

    @property
    def text(self) -> str:
        return self._text if self._text is not None else (self._stream.text if self._stream is not None else "")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids!r}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})")


@dataclass(slots=True)  # (slots: one is made per request per step)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {token id: Logprob} with
    # the prompt token and the top N (vLLM's shape); None when not asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # why the request failed while running (every sequence then ends with finish_reason "error"); None if not
    error: str | None = None
    # a pooling request's answer (SamplingParams.pooling): the last token's final hidden state (embed), or [score]
    pooled: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # L2-normalised where the model normalises (Qwen3-Embedding does)


@dataclass
class ScoringOutput:
    score: float  # the relevance score in [0, 1] (a reranker's P(yes))


@dataclass
class PoolingRequestOutput:
    """One input's pooled answer (vLLM's shape): ``.outputs.embedding`` from ``LLM.embed``, ``.outputs.score`` from
    ``LLM.score``."""

    request_id: str
    outputs: EmbeddingOutput | ScoringOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


EmbeddingRequestOutput = ScoringRequestOutput = PoolingRequestOutput  # (vLLM's names for the two kinds)
