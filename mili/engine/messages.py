"""What crosses between the API process and the engine core: msgspec structs, msgpack on ZMQ IPC.

The core sends one ``StepMessage`` per model step carrying every moved sequence's *new* tokens (deltas,
never whole histories) and the engine's counters; the API side sends ``AddRequest``/``Abort``/
``FinishSeqs``/``Shutdown``. Structs are encoded as arrays (``array_like``): no field names on the wire.
"""

from __future__ import annotations

import msgspec

from mili.sampling_params import SamplingParams


class ImageInput(msgspec.Struct, array_like=True):
    """A request's images as the image processor made them (engine/image_inputs.py): one float32 row per patch."""

    pixel_values: bytes  # float32 [patches, patch_dim], row-major
    patch_dim: int
    grid_thw: list[list[int]]  # each image's patch grid (t, h, w)
    hashes: list[int]  # each image's pixels hashed (the prefix cache keys its tokens by them)


class AddRequest(msgspec.Struct, array_like=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]  # with each image's tokens expanded (one per merged patch block)
    params: SamplingParams  # eos_token_ids filled in by the API side
    max_total_tokens: int  # prompt + generated may not exceed this
    arrival_time: float
    client: int = 0  # the API process that sent it (mili serve --api-server-count): its outputs go back there
    images: ImageInput | None = None
    lora: tuple[str, int, str] | None = None  # its LoRA adapter (name, id, path): mili.lora.LoRARequest's fields
    # hybrids: where the prompt's chat turns end (tokenizer.turn_ends): the prefix cache snapshots the recurrent
    # state there (page-aligned) while prefilling, for the next request sharing the system prompt or conversation
    turn_ends: list[int] = []


class Abort(msgspec.Struct, array_like=True, tag=True):
    request_ids: list[str]


class FinishSeqs(msgspec.Struct, array_like=True, tag=True):
    """Sequences the API side ended (a stop string matched): (request_id, index) pairs."""

    seqs: list[tuple[str, int]]


class Shutdown(msgspec.Struct, array_like=True, tag=True):
    pass


class ClientGone(msgspec.Struct, array_like=True, tag=True):
    """From ``mili serve`` (``--api-server-count``): API process ``client`` has exited; the core aborts its
    requests and sends it nothing more."""

    client: int


CoreInput = AddRequest | Abort | FinishSeqs | Shutdown | ClientGone


class SeqDelta(msgspec.Struct, array_like=True):
    """What one sequence did in one step."""

    request_id: str
    index: int
    token_ids: list[int]  # the new ones
    # per new token: (sampled logprob, its rank, [(token id, logprob), ...] the top N); None: not asked
    logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    finish_reason: str | None = None  # stop | length (from a stop token, EOS or the length limit)
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)
    num_cached_tokens: int = 0  # the request's prompt tokens found in the prefix cache
    first_scheduled_time: float | None = None
    # prompt logprobs (on sequence 0's delta): the prompt tokens scored in this step, in order from the
    # first not sent yet (the prompt's second token first), each as ``logprobs``' entries
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    # a pooling request's answer (with its finish): the last token's hidden state (embed) or [score]
    pooled: list[float] | None = None


class SpecDecodeCounts(msgspec.Struct, array_like=True):
    """Speculative decoding since the core started (vLLM's counters): drafts verified (one per sequence and
    step with a draft), draft tokens, accepted ones, and accepted ones by position in the draft."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]


class Stats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    num_pages: int
    num_pages_free: int
    num_pages_cached: int  # idle pages the prefix cache holds (reusable, evictable)
    num_generated_tokens: int  # tokens the core has sampled since it started
    spec: SpecDecodeCounts | None = None  # speculative decoding's counters (None: it is off)
    num_preemptions: int = 0  # since the core started
    # hybrid models: the recurrent-state slots (one a running sequence) and the prefix cache's state snapshots
    num_state_slots: int = 0
    num_state_slots_free: int = 0
    num_snapshots: int = 0
    num_snapshots_used: int = 0
    num_snapshots_taken: int = 0  # since the core started (more than num_snapshots: some were evicted)
    # since the core started: requests that resumed from a snapshot, and those of them from a turn end's
    num_snapshot_hits: int = 0
    num_turn_end_hits: int = 0

    @property
    def num_pages_held(self) -> int:
        """Pages running or waiting sequences hold (0 once every request has ended: none leaked)."""
        return self.num_pages - self.num_pages_free - self.num_pages_cached


class StepMessage(msgspec.Struct, array_like=True, tag=True):
    deltas: list[SeqDelta]
    num_preemptions: int  # since the core started
    stats: Stats | None = None  # the gauges, when they were refreshed (not every step: a tree walk)
    errors: list[tuple[str, str]] = []  # (request_id, message): requests the core refused when adding
    # (request_id, message): requests that failed while running (a sampling or grammar failure of their own);
    # the core ended them and goes on serving the others
    failures: list[tuple[str, str]] = []


class Ready(msgspec.Struct, array_like=True, tag=True):
    """Sent once the model is loaded: what the API side needs to validate requests and report health."""

    max_model_len: int  # the checkpoint's, or lower: what the KV pool holds
    device: str
    dtype: str
    stats: Stats
    quantization: str = "unquantized"  # what the weights compute as (the model runner's weight_format)
    kv_cache_dtype: str = ""  # the KV pages' dtype
    prefix_caching: bool = True  # whether the radix cache is on
    # hybrid models: recurrent-state slots, and the bytes they and the snapshots take from the KV budget
    state_slots: int = 0
    state_bytes: int = 0
    state_snapshots: int = 0  # hybrid models: recurrent-state snapshots the prefix cache may keep
    plan: dict[str, str] = {}  # the execution plan in words (``ExecutionPlan.describe``), a line each
    # the batch limits the core runs (auto: the plan sized them by the device; 0: not said), and for each whether
    # "user" (asked) or "device" (auto) set it: the API side validates requests by them
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    sized_by: dict[str, str] = {}


class Dead(msgspec.Struct, array_like=True, tag=True):
    """The core's last word: it failed (at load or in a step) and exits."""

    reason: str
    load_error: bool = False  # a ModelLoadError/InvalidRequest while loading: the user's to fix


CoreOutput = StepMessage | Ready | Dead

encode = msgspec.msgpack.Encoder().encode
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(CoreOutput)
