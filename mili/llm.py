"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` over the engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from mili import options
from mili.config import EngineConfig
from mili.engine.llm_engine import LLMEngine
from mili.engine.media import ImageRef, MediaPolicy, check_images, template_content
from mili.engine.pooling import PoolingInputs, check_dimensions, embedding
from mili.errors import InvalidRequest
from mili.outputs import (EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                          ScoringRequestOutput)
from mili.sampling_params import SamplingParams
from mili.tokenizer.reasoning import constraint_start
from mili.tokenizer.tokenizer import encode_chat

PromptType = str | dict


class LLM:
    """Runs a Qwen3 checkpoint in this process.

    ``model`` is a local folder, a hub id (e.g. ``Qwen/Qwen3-0.6B``), ``"demo"``, ``"demo-hybrid"`` or
    ``"demo-random"``; other keyword arguments are ``EngineConfig`` fields (page_size, kv_cache_memory,
    max_num_seqs, ...): an unknown one is a TypeError naming it, a bad value an InvalidRequest naming it.
    """

    def __init__(self, model: str, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, seed: int = 0, **engine_kwargs):
        options.check_names(EngineConfig, engine_kwargs, "LLM()")
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device,
                                             max_model_len=max_model_len, seed=seed, **engine_kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def apply_model(self, func):
        """``func(model)`` on the loaded model, as vLLM's: to look at its layers or weights."""
        return self.engine.apply_model(func)

    def reset_prefix_cache(self) -> int:
        """Drop what the prefix cache holds idle (the next prompts miss); returns the pages freed."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in input order.

        A prompt is a string or ``{"prompt_token_ids": [...]}`` (or ``{"prompt": "..."}``), with images for a
        Qwen3-VL / Qwen3.5 model as vLLM's: ``"multi_modal_data": {"image": a PIL image or a list of them}``, one
        per image placeholder (one ``<|image_pad|>`` token each) in the prompt.

        ``lora_request``: a ``mili.lora.LoRARequest`` (or one per prompt, None for the base model) on an engine
        started with ``enable_lora=True``: those prompts run with that adapter, batched with the others.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidRequest(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts",
                                 param="sampling_params")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequest(f"{len(loras)} lora_requests for {len(prompts)} prompts", param="lora_request")
        return self._run([_prompt_input(p) for p in prompts], list(sampling_params), use_tqdm, loras)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True, tools: list[dict] | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or a list of them. ``tools`` (OpenAI's
        function shape) go to the chat template. With thinking on, a structured output constraint starts
        after ``</think>``. ``continue_final_message`` (with ``add_generation_prompt=False``, as vLLM's):
        the reply continues the final message, an assistant's. Image parts are OpenAI's ``image_url`` (a data: URL;
        http(s) and file URLs where the engine's config allows them, as the server's) or vLLM's
        ``{"type": "image_pil", "image_pil": a PIL image}``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        with_images = [self._template_messages(conv) for conv in conversations]
        encoded = [encode_chat(tok, conv, add_generation_prompt, kwargs, continue_final_message)
                   for conv, _ in with_images]
        # (one template and one set of kwargs: every prompt ends alike; a continued turn is past its thinking)
        thinking = kwargs.get("enable_thinking", True) is not False and not continue_final_message
        start = constraint_start(tok, encoded[0][0], thinking) if encoded else None
        if start is not None:
            many = isinstance(sampling_params, (list, tuple))
            sampling_params = [_after(p, start) for p in (sampling_params if many else [sampling_params])]
            sampling_params = sampling_params if many else sampling_params[0]
        prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": self._load_images(ids, refs)}}
                   if refs else {"prompt_token_ids": ids} for (_, ids), (_, refs) in zip(encoded, with_images)]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _template_messages(conversation: list[dict]) -> tuple[list[dict], list[ImageRef]]:
        """The conversation as the chat template reads it (engine/media.py), and its image parts in order."""
        refs: list[ImageRef] = []
        messages = [{**m, "content": template_content(m.get("content"), f"messages[{i}].content", refs)}
                    if isinstance(m, dict) and isinstance(m.get("content"), list) else m
                    for i, m in enumerate(conversation)]
        return messages, refs

    def _load_images(self, token_ids: list[int], refs: list[ImageRef]) -> list:
        """The PIL images of one conversation, checked and loaded as the server's (``ServerState.load_images``)."""
        engine = self.engine
        check_images(refs, token_ids, engine.inputs.images, engine.config.limit_mm_per_prompt["image"])
        policy = MediaPolicy.from_config(engine.config)
        return [policy.load(ref) for ref in refs]

    def embed(self, texts: str | list[str] | list[int] | list[list[int]], dimensions: int | None = None,
              instruction: str | None = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings of one text or a list (or token ids), in input order (vLLM's ``LLM.embed``: each
        ``.outputs.embedding``), on a model run with ``task="embed"`` (Qwen3-Embedding: chosen by itself).
        ``dimensions``: the first N (Matryoshka), renormalised; ``instruction``: the texts are queries, each sent as
        ``Instruct: {instruction}\nQuery:{text}``; ``truncate_prompt_tokens``: a longer input keeps its last N
        tokens (-1: the context length), else it is an InvalidRequest."""
        engine = self.engine
        inputs = [texts] if isinstance(texts, str) or (texts and isinstance(texts[0], int)) else list(texts)
        engine.inputs.check_task("embed")
        check_dimensions(dimensions, engine.model_config.hidden_size)
        ids = self._pooling_inputs().embed(inputs, instruction, truncate_prompt_tokens, "texts")
        outs = self._run([(p, None) for p in ids], [self._pooling_params()] * len(ids), use_tqdm)
        normalize = engine.inputs.task.normalize
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(embedding(o.pooled, dimensions, normalize)),
                                       o.prompt_token_ids, o.num_cached_tokens) for o in outs]

    def score(self, query: str | list[str], documents: str | list[str], instruction: str | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Relevance scores in [0, 1] of each document for the query (one query and many documents, or as many
        queries as documents, pair by pair; vLLM's ``LLM.score``: each ``.outputs.score``), on a model run with
        ``task="rerank"``. MILI builds the reranker's prompt (Qwen3-Reranker's; ``instruction``: its task, default
        web search); ``truncate_prompt_tokens``: a longer prompt has its document cut to fit N tokens (-1: the
        context length), else it is an InvalidRequest."""
        self.engine.inputs.check_task("rerank")
        documents = [documents] if isinstance(documents, str) else list(documents)
        queries = [query] * len(documents) if isinstance(query, str) else list(query)
        if len(queries) != len(documents):
            raise InvalidRequest(f"{len(queries)} queries for {len(documents)} documents: one query, or one each",
                                 param="query")
        ids = self._pooling_inputs().score(list(zip(queries, documents)), instruction, truncate_prompt_tokens)
        outs = self._run([(p, None) for p in ids], [self._pooling_params()] * len(ids), use_tqdm)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.pooled[0]), o.prompt_token_ids,
                                     o.num_cached_tokens) for o in outs]

    def _pooling_inputs(self) -> PoolingInputs:
        inputs = self.engine.inputs
        return PoolingInputs(inputs.tokenizer, inputs.task, self.engine.max_model_len)

    def _pooling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=0, pooling=self.engine.inputs.task.pooling)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool,
             loras: list | None = None) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for (prompt, images), sp, lora in zip(prompts, params, loras or [None] * len(prompts)):
                ids.append(engine.add_request(prompt, sp, images=images, lora_request=lora).request_id)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        desc = "Generating" if params and params[0].pooling is None else "Pooling"
        with tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm) as bar:
            try:
                while len(results) < len(ids):
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
            except BaseException:  # e.g. KeyboardInterrupt: leave the engine clean for the next call
                for rid in ids:
                    engine.abort_request(rid)
                raise
        return [results[rid] for rid in ids]


def _after(params: SamplingParams | None, token_id: int | None) -> SamplingParams | None:
    """``params`` whose structured output constraint (if any, and not placed already) starts after ``token_id``."""
    so = params.structured_outputs if params is not None else None
    if so is None or so.start_after_token_id is not None:
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(so, start_after_token_id=token_id))


def _prompt_input(prompt: PromptType) -> tuple[str | list[int], list | None]:
    """(the prompt, its images or None)."""
    if isinstance(prompt, str):
        return prompt, None
    images = None
    if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidRequest("multi_modal_data takes images only: {'image': an image or a list of them}",
                                 param="multi_modal_data")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images] if images is not None else None
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"]), images
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"], images
    raise InvalidRequest("a prompt is a string or a dict with 'prompt_token_ids' or 'prompt'", param="prompts")
