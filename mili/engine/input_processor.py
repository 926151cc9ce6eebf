"""InputProcessor: the API side of adding a request: load the checkpoint's config and tokenizer, encode
and validate a prompt, and make the ``AddRequest`` the engine core takes (no model code and no weights:
``model/checkpoint.py`` reads the folder; torch is imported only for the configs' dtypes)."""

from __future__ import annotations

import dataclasses
import time

from mili.config import EngineConfig, ModelConfig
from mili.engine.image_inputs import ImageInputs
from mili.engine.media import check_count
from mili.engine.messages import AddRequest, Ready
from mili.engine.pooling import resolve_task
from mili.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError
from mili.model.checkpoint import (
    load_generation_defaults,
    load_hf_config,
    resolve_model_path,
)
from mili.sampling_params import SamplingParams
from mili.structured import check as check_structured
from mili.tokenizer.reasoning import thinking_tokens
from mili.tokenizer.tokenizer import encode_prompt, load_eos_token_ids, load_tokenizer, turn_end_tokens, turn_ends


class InputProcessor:
    def __init__(self, config: EngineConfig):
        """Resolve the model (a download if need be), read its config (refusing what MILI cannot run)
        and load its tokenizer: all before the engine core loads a weight."""
        self.config = config
        self.model_path = resolve_model_path(config.model)
        hf_config = load_hf_config(self.model_path)
        self.model_config = ModelConfig.from_hf(hf_config)
        config.resolve_max_model_len(self.model_config)  # an impossible max_model_len fails here, early
        from mili.model.gguf import (
            tokenizer_error,  # (a GGUF model's folder: checkpoint.py made it)
        )

        why = None if config.tokenizer else tokenizer_error(self.model_path)
        if why is not None:
            raise ModelLoadError(f"{why} (the GGUF file's metadata made no tokenizer: pass --tokenizer with an HF "
                                 "tokenizer's folder or hub id)", param="tokenizer")
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.eos_token_ids = load_eos_token_ids(self.model_path, self.tokenizer, hf_config)
        self.generation_defaults = load_generation_defaults(self.model_path)  # used by the server
        self.turn_end_tokens = turn_end_tokens(self.tokenizer)  # (<|im_end|>, "\n"): where chat turns end
        self.core_info: Ready | None = None  # the loaded core's limits (max_model_len after the KV pool)
        self.images = ImageInputs(self.model_path, self.model_config, config.takes_images(self.model_config))
        # generate, embed or rerank (engine/pooling.py): what the requests may ask for
        self.task = resolve_task(config.task, self.model_path, self.model_config, self.tokenizer)
        if self.task.name == "embed":  # no logits: no head to load
            self.model_config = self.model_config.without_head()

    @property
    def max_model_len(self) -> int:
        return self.core_info.max_model_len

    def core_ready(self, ready: Ready) -> None:
        """The loaded core's limits: its max_model_len, and the batch limits it runs (auto: its plan sized them by
        its device), which take auto's place in this side's config."""
        self.core_info = ready
        if ready.max_num_seqs:  # (0: a core that does not say them)
            self.config = self.config.with_batch_limits(ready.max_num_seqs, ready.max_num_batched_tokens)

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     images: list | None = None, lora=None) -> AddRequest:
        """Encode and validate one request; raises InvalidRequest / ContextLengthExceeded. ``images``: PIL images,
        one per image placeholder in the prompt (engine/image_inputs.py); ``lora``: its LoRA adapter
        (mili.lora.LoRARequest), which the engine core loads and checks."""
        if lora is not None and not self.config.enable_lora:
            raise InvalidRequest("this engine was started without --enable-lora: it serves no LoRA adapters",
                                 param="lora_request")
        self.check_task("generate" if params.pooling is None else "embed" if params.pooling.task == "embed"
                        else "rerank")
        token_ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model_config.vocab_size
        # (types, then bounds, each in one C pass: this runs per request, over every prompt token)
        if token_ids and (set(map(type, token_ids)) != {int} or min(token_ids) < 0 or max(token_ids) >= vocab):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if not token_ids:
            raise InvalidRequest("the prompt must not be empty", param="prompt")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):  # (xgrammar's matcher fails on others)
            raise InvalidRequest(f"stop token ids must be integers in [0, {vocab})", param="stop_token_ids")
        max_num_seqs = self.config.max_num_seqs  # (the core's, once its Ready came: auto sized by its device)
        if max_num_seqs is not None and params.n > max_num_seqs:
            raise InvalidRequest(f"n ({params.n}) exceeds max_num_seqs ({max_num_seqs})", param="n")
        slots = self.core_info.state_slots if self.core_info is not None else 0
        if slots and params.n > slots:  # hybrids: the n sequences decode at once, each in its own slot
            raise InvalidRequest(f"n ({params.n}) exceeds the {slots} recurrent-state slots of this hybrid model "
                                 f"(raise num_state_slots)", param="n")
        if params.structured_outputs is not None:
            check_structured(params.structured_outputs, "structured_outputs")
        image_input = None
        if images:
            if self.images.takes_images:  # (else prepare says the model takes none)
                check_count(len(images), self.config.limit_mm_per_prompt["image"], "multi_modal_data")
            token_ids, image_input = self.images.prepare(token_ids, images)
        max_total = self._check_length(len(token_ids), params.max_tokens)
        params = dataclasses.replace(params, eos_token_ids=list(self.eos_token_ids))
        if params.thinking_token_budget is not None:
            params.thinking_tokens = thinking_tokens(self.tokenizer, params.thinking_budget_message)
            if params.thinking_tokens is None:
                raise InvalidRequest("thinking_token_budget needs a model that thinks: this tokenizer has no <think> "
                                     "and </think> tokens", param="thinking_token_budget")
        return AddRequest(request_id, token_ids, params, max_total, time.monotonic(), images=image_input,
                          lora=(lora.lora_name, lora.lora_int_id, lora.lora_path) if lora is not None else None,
                          turn_ends=self._turn_ends(token_ids))

    def _turn_ends(self, token_ids: list[int]) -> list[int]:
        """Where the prompt's chat turns end, for a hybrid's prefix cache (it snapshots the recurrent state there);
        none for other cores (a dense model's cache shares any page without them)."""
        info = self.core_info
        if self.turn_end_tokens is None or info is not None and not (info.prefix_caching and info.state_snapshots):
            return []
        return turn_ends(token_ids, self.turn_end_tokens)

    @property
    def thinks(self) -> bool:
        """The model thinks: its vocabulary has ``<think>`` and ``</think>`` (a thinking budget can apply)."""
        return thinking_tokens(self.tokenizer, None) is not None

    def check_task(self, asked: str) -> None:
        """A request the task serves: text generation on a generate engine, embeddings on an embed one, scores on a
        rerank one; any other is an InvalidRequest naming the task and how to start the one it needs."""
        task = self.task.name
        if asked == task:
            return
        serves = {"generate": "text generation (completions, chat, messages, responses, /generate)",
                  "embed": "embeddings (/v1/embeddings)", "rerank": "scores (/v1/rerank, /rerank, /v2/rerank, /score)"}
        start = {"generate": "--task generate on a chat model",
                 "embed": "--task embed on an embedding model (such as Qwen3-Embedding)",
                 "rerank": "--task rerank on a reranker (a Qwen3-Reranker is a Qwen3ForCausalLM, which MILI cannot "
                           "tell from a chat model: pass --task rerank)"}
        raise InvalidRequest(f"this model runs the {task} task: it serves {serves[task]}, not {serves[asked]}; for "
                             f"those, start MILI with {start[asked]}", param="model")

    def _check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.max_model_len
        asked = max_tokens if max_tokens is not None else max(limit - prompt_len, 1)
        if prompt_len + asked > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens, the request has {prompt_len} "
                f"prompt tokens and asks for {asked} completion tokens ({prompt_len + asked} in all).",
                param="prompt" if prompt_len >= limit else "max_tokens")
        return prompt_len + asked
