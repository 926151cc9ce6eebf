"""Request and Sequence: the state of one request and of each of its ``n`` output sequences.

A Sequence is WAITING (no KV pages, ``num_computed_tokens`` 0), RUNNING (pages for its computed
tokens) or FINISHED (pages released). With ``n`` > 1, sequences 1..n-1 are UNBORN until the first one
has prefilled the prompt; they are then forked from it, sharing its prompt pages.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch

from mili.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mili.lora import LoRARequest
    from mili.runtime.images import RequestImages
    from mili.engine.thinking import ThinkingBudget
    from mili.structured import SeqGrammar


PENDING_TOKEN = -2  # a token drawn on the device and not read yet (``Sequence.pending_at``); never a real id


class SeqStatus(enum.Enum):
    UNBORN = "unborn"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: "Request"
    index: int  # which of the request's n outputs
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    generator: torch.Generator | None
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    page_table: list[int] = field(default_factory=list)
    state_slot: int | None = None  # hybrid models: its recurrent-state slot (cache/state_pool.py)
    # hybrids with the prefix cache: a copy of its state at its latest page boundary while decoding
    # (cache/snapshot_pool.py), at position ``snapshot_pos``; given to the prefix cache when it ends
    snapshot: int | None = None
    snapshot_pos: int = 0
    branch_pos: int = 0  # hybrids: where its prompt parts from a cached one (a snapshot is taken there)
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | None = None  # the stop token id that ended it (stop strings: the output processor)
    grammar: "SeqGrammar | None" = None  # structured outputs: this sequence's matcher
    # MTP speculative decoding: (first position, [rows, hidden]) the main model's final-normed hidden states
    # it keeps for the MTP head's next pairs and drafts (mili/speculative/mtp.py)
    mtp_hidden: tuple | None = None
    # scheduling ahead of the device (engine/core.py): the index in ``token_ids`` of the token the step in flight
    # draws, a stand-in (``PENDING_TOKEN``) until its draw is read; the next step takes it on the device
    pending_at: int | None = None
    thinking: "ThinkingBudget | None" = None  # a thinking budget's count and forced tokens (engine/thinking.py)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def cache_key(self, end: int) -> list[int]:
        """Its first ``end`` tokens as the prefix cache keys them: an image's tokens by the image's content; under a
        LoRA adapter, the first token marked with the adapter's id (the same prompt under two adapters shares no
        KV)."""
        images = self.request.images
        key = (self.token_ids[:end] if images is None
               else images.cache_ids[:end] + self.token_ids[len(images.cache_ids):end])
        if self.request.lora is not None and key:
            key = [key[0] + (self.request.lora.lora_int_id << 40), *key[1:]]
        return key


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + generated may not exceed this (max_model_len or max_tokens)
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    # prompt logprobs: positions 0 .. num_scored - 1 have scored the prompt token after them (and were sent)
    num_scored: int = 0
    # M-RoPE models: the prompt's images (pixels, positions, the tower's output once computed), or None
    images: "RequestImages | None" = None
    lora: "LoRARequest | None" = None  # the LoRA adapter it runs with (None: the base model)
    # hybrids: positions where the prompt's chat turns end (the API side found them: tokenizer.turn_ends); the
    # prefix cache snapshots the recurrent state at their page boundaries while prefilling (engine/state_snapshots.py)
    turn_ends: list[int] = field(default_factory=list)

    @property
    def lora_id(self) -> int | None:
        return self.lora.lora_int_id if self.lora is not None else None

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def scoring_prompt(self) -> bool:
        """Whether prompt logprobs are still to come: the positions past ``num_scored`` must be computed
        (a prefix cache hit has no logits to score)."""
        return self.params.prompt_logprobs is not None and self.num_scored < len(self.prompt_token_ids) - 1

    def unscored(self, start: int, end: int) -> range:
        """The positions of [start, end) whose logits score a prompt token not scored yet (position p's
        logits give token p + 1's logprob; the last prompt position's predict the output instead)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, self.num_scored), min(end, len(self.prompt_token_ids) - 1))

    def unborn(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status == SeqStatus.UNBORN]
