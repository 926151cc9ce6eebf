"""LLMEngine: the engine core in this process, behind the same input and output processors the
server uses. Requests in, one scheduled model step at a time, RequestOutputs out.

The offline ``LLM`` drives this class; the server drives the same core in its own process through
``mili.engine.async_llm.AsyncLLM``. It knows nothing of HTTP.
"""

from __future__ import annotations

import itertools
from typing import Callable, TypeVar

import torch

from mili.config import EngineConfig
from mili.engine.core import EngineCore
from mili.engine.input_processor import InputProcessor
from mili.engine.messages import Stats
from mili.engine.output_processor import OutputProcessor
from mili.engine.request import Request
from mili.errors import InvalidRequest
from mili.outputs import RequestOutput
from mili.process import freeze_heap
from mili.sampling_params import SamplingParams

T = TypeVar("T")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.inputs = InputProcessor(config)
        self.core = EngineCore(config, self.inputs.model_config, self.inputs.model_path)
        self.inputs.core_ready(self.core.ready())
        self.outputs = OutputProcessor(self.inputs.tokenizer)
        self._ids = itertools.count()
        if self.core.plan.device.type == "cuda":  # (as the server's core process: no full collections mid-run)
            freeze_heap()

    # what callers read: the config (the batch limits the core runs in auto's place), the checkpoint (API side), and
    # how the core runs it
    config = property(lambda self: self.inputs.config)
    model_path = property(lambda self: self.inputs.model_path)
    model_config = property(lambda self: self.inputs.model_config)
    tokenizer = property(lambda self: self.inputs.tokenizer)
    eos_token_ids = property(lambda self: self.inputs.eos_token_ids)
    generation_defaults = property(lambda self: self.inputs.generation_defaults)
    max_model_len = property(lambda self: self.core.max_model_len)
    plan = property(lambda self: self.core.plan, doc="the execution plan (mili/runtime/plan.py): how the model runs")
    info = property(lambda self: self.core.ready(), doc="what the loaded engine runs, as the server's /health reports "
                    "it (``messages.Ready``): the device and dtype, the weights' and the KV cache's formats, whether "
                    "prefix caching is on, a hybrid's state slots and snapshots, the batch limits and who sized them, "
                    "the plan in words and the stats now")

    def stats(self) -> Stats:
        """The engine's gauges and counters now: running and waiting sequences, KV pages (free, cached by the
        prefix cache, held), a hybrid's state slots and snapshots, preemptions, tokens generated."""
        return self.core.stats()

    def apply_model(self, func: Callable[[torch.nn.Module], T]) -> T:
        """``func(model)`` on the loaded model (rank 0's, with tensor parallelism), as vLLM's ``LLM.apply_model``:
        to look at its layers or weights."""
        return func(self.core.runner.parts.model)

    def reset_prefix_cache(self) -> int:
        """Evict every page and state snapshot the prefix cache holds idle (the next prompts miss); returns the
        number of pages freed."""
        return self.core.prefix_cache.evict(self.core.pages.num_pages)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, images: list | None = None, lora_request=None) -> Request:
        """Validate and queue one request; raises InvalidRequest / ContextLengthExceeded. ``images``: PIL images,
        one per image placeholder token in the prompt (M-RoPE models); ``lora_request``: a mili.lora.LoRARequest."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.requests or request_id in self.core.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        add = self.inputs.make_request(prompt, params, request_id, images, lora_request)
        self.outputs.add(add, prompt if isinstance(prompt, str) else None)
        try:
            return self.core.add_request(add)
        except BaseException:
            self.outputs.remove(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests([request_id])
        self.outputs.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return the outputs of every request that moved."""
        outputs, stopped, failed = self.outputs.process(self.core.step())
        if stopped:  # stop strings: the core stops computing those sequences now
            self.core.finish_seqs(stopped)
        self.core.abort_requests([request_id for request_id, _ in failed])  # (their output failed here)
        for request_id, message in self.core.take_failures() + failed:  # requests that failed while running
            out = self.outputs.fail(request_id, message)
            if out is not None:
                outputs.append(out)
        for request_id, message in self.core.take_failed():  # a grammar that failed to compile (rare:
            self.outputs.remove(request_id)                   # make_request checked it)
            raise InvalidRequest(message, param="structured_outputs")
        return outputs

    def spec_decode_stats(self) -> dict:
        """Speculative decoding since the engine started: {"num_drafts", "num_draft_tokens",
        "num_accepted_tokens", "accepted_per_pos"} (all 0 when it is off)."""
        return self.core.spec_stats.as_dict()

    def check_integrity(self) -> None:
        """Check the pools' and caches' invariants (every page, slot and snapshot held by one live holder or free);
        raises AssertionError naming the first broken one."""
        self.core.check_integrity()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this engine started (nothing else holds a process or a port)."""
        self.core.runner.close()
