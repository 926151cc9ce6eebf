"""Request bodies of the HTTP APIs (pydantic), and their translation to SamplingParams.

The models are the API's schema as well as its validation: what a field's type and constraints say is
exactly what the server accepts, so the OpenAPI document (/openapi.json) tells a generated client the
truth. What a schema cannot say (one field bounded by another, a regex or a grammar that must compile, a
prompt that must fit the context) is checked in code, a 400 naming the field. Limits that depend on the
running server (vocabulary, context, batch) are marked with ``runtime_maximum`` and filled in when the
app builds its document. The field types are in fields.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, WithJsonSchema

from mili.engine.media import ImageRef, template_content
from mili.errors import InvalidRequest
from mili.sampling_params import SamplingParams, StructuredOutputsParams
from mili.server.fields import (AsSent, Count, Logprobs, MaxTokens, ModelName, OnField, OnlyFalse, Open, Seed,
                                Strict, TemplateKwargs, Text, TopK, branch, integer, requires, runtime_maximum,
                                token_ids)
from mili.structured import MAX_WHITESPACE
from mili.structured import check as check_structured
from mili.tokenizer.tool_parsers import forced_tag


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaSpec(Open):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextFormat(Open):
    type: Literal["text"]


class JsonObjectFormat(Open):
    type: Literal["json_object"]


class JsonSchemaFormat(Open):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: exactly one of json, json_object, regex, choice, grammar."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    disable_any_whitespace: bool | None = None  # accepted; MILI bounds JSON whitespace instead
    backend: str | None = None  # accepted; MILI's is xgrammar


THINKING_MAX = 2**31 - 1  # a thinking budget's largest (any longer reply is past every context)


class _Sampling(Strict):
    """Parameters shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: ModelName | None = None
    max_tokens: MaxTokens | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: integer(ge=1, json_schema_extra=runtime_maximum("n")) = 1
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    stop: Annotated[Text | list[Text], OnField] | None = None
    seed: Seed | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: Count = Field(0, description="at most max_tokens; not with a structured output")
    ignore_eos: bool = False
    stop_token_ids: Annotated[token_ids(), OnField] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: Logprobs | None = Field(None, description="each prompt token's logprob and the top N; "
                                                 "not with stream")
    response_format: Annotated[ResponseFormat, AsSent] | None = None
    # vLLM's structured outputs: its newer object, and its older guided_* fields (at most one of them all)
    structured_outputs: Annotated[StructuredOutputs, AsSent] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "xgrammar"] | None = None
    # OpenAI fields MILI accepts only with the value that asks for nothing
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not supported: only {} or null")
    store: OnlyFalse | None = Field(None, description="MILI stores no completions: only false or null")
    metadata: dict[str, str] | None = None  # labels for stored completions: no effect on the output
    service_tier: Literal["auto", "default"] | None = None

    def prompt_logprobs_n(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any], tool_parser: str = "hermes") -> SamplingParams:
        """``defaults`` are the model's generation defaults (temperature, top_p, top_k) for unset fields;
        ``tool_parser`` (chat): the form a forced tool call is written in (tool_parsers.py)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream and self.prompt_logprobs is not None:  # (as vLLM: they would come all at once anyway)
            raise InvalidRequest("prompt_logprobs is not available when stream is true", param="prompt_logprobs")

        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        structured = self.structured(tool_parser)
        if structured is not None:
            check_structured(structured[0], structured[1])
        return SamplingParams(
            structured_outputs=structured[0] if structured else None, n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", -1),
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs_n(), skip_special_tokens=self.skip_special_tokens)


    def structured(self, tool_parser: str = "hermes") -> tuple[StructuredOutputsParams, str] | None:
        """The request's output constraint and the field that asked for it; at most one field may."""
        asked = [(name, value) for name, value in (
            ("response_format", self.response_format), ("structured_outputs", self.structured_outputs),
            ("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
            ("guided_choice", self.guided_choice), ("guided_grammar", self.guided_grammar))
            if value is not None and not (name == "response_format" and value.get("type", "text") == "text")]
        if not asked:
            return None
        if len(asked) > 1:
            raise InvalidRequest(f"only one of {', '.join(n for n, _ in asked)} may be given", param=asked[1][0])
        name, value = asked[0]
        if name == "response_format":
            return _response_format(value), name
        if name == "structured_outputs":  # its other fields (backend, disable_any_whitespace) change nothing
            spec = {k: v for k, v in value.items() if k in ("json", "json_object", "regex", "choice", "grammar")}
        else:
            spec = {name.removeprefix("guided_"): value}
        try:
            return StructuredOutputsParams(**spec), name
        except InvalidRequest as e:
            raise InvalidRequest(str(e), param=name) from None


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    """A json_object or json_schema ``response_format`` (its shape checked by ``ResponseFormat``)."""
    if fmt["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=fmt["json_schema"]["schema"])


PromptIds = token_ids(min_length=1)


# rules between fields the schema can state (the code checks them too, with their own messages)
_STREAM_OPTIONS = requires("stream_options", {"type": "object"},
                            {"properties": {"stream": {"const": True}}, "required": ["stream"]})
_PROMPT_LOGPROBS = requires("prompt_logprobs", {"type": "integer"}, {"properties": {"stream": {"const": False}}})
# max_tokens 0 scores the prompt without generating: it needs prompt logprobs (echo with logprobs, or
# prompt_logprobs)
_SCORE_ONLY = requires("max_tokens", {"const": 0}, {"anyOf": [
    {"properties": {"prompt_logprobs": {"type": "integer"}}, "required": ["prompt_logprobs"]},
    {"properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}}, "required": ["echo", "logprobs"]}]})


# completions' max_tokens: 0 scores the prompt without generating
ScoreMaxTokens = integer(ge=0, json_schema_extra=runtime_maximum("max_tokens"),
                         description="0: score the prompt only (needs echo with logprobs, or prompt_logprobs)")


class CompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS, _PROMPT_LOGPROBS, _SCORE_ONLY]})

    prompt: Annotated[Text | Annotated[list[Text], Field(min_length=1)] | PromptIds
                      | Annotated[list[PromptIds], Field(min_length=1)], OnField]
    max_tokens: ScoreMaxTokens | None = 16
    logprobs: Logprobs | None = None
    echo: bool = Field(False, description="the prompt before the output; with logprobs, its tokens' logprobs too")
    suffix: str | None = Field(None, max_length=0, description="not supported: only an empty string or null")
    best_of: integer() | None = Field(None, description="only equal to n")

    def prompt_logprobs_n(self) -> int | None:
        """vLLM's rule: ``prompt_logprobs`` if given, else with ``echo`` the prompt is scored like the output
        (``logprobs``), as the legacy OpenAI API returns it."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """One prompt per engine request: a string or token ids (the shapes ``prompt`` allows)."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)


# Content parts MILI takes: text, and images as URLs (checked in mili/engine/media.py, whose errors name the part)
_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
_IMAGE_PART = {"type": "object", "properties": {
    "type": {"const": "image_url"},
    "image_url": {"type": "object", "required": ["url"], "properties": {
        "url": {"type": "string", "description": "a data:image/...;base64 URL; http(s):// or file:// where the "
                                                 "server allows them"},
        "detail": {"type": "string", "description": "ignored"}}}},
    "required": ["type", "image_url"]}
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
                             {"type": "null"}]}


class ChatMessage(Open):
    """A message; its other fields (tool_calls, tool_call_id, name...) go to the chat template as sent."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    reasoning_content: str | None = None

    def for_template(self, param: str, images: list[ImageRef]) -> dict[str, Any]:
        """The message as the chat template reads it; its image parts are appended to ``images``, each named by
        ``param`` (``messages[i]``) and its place."""
        content = template_content(self.content, f"{param}.content", images)
        message = {**(self.model_extra or {}), "role": "system" if self.role == "developer" else self.role,
                   "content": content if content is not None else ""}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """The messages as the chat template reads them, and their image parts in order."""
    images: list[ImageRef] = []
    return [m.for_template(f"messages[{i}]", images) for i, m in enumerate(messages)], images


class FunctionDef(Open):
    name: Text
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema for the arguments")


class Tool(Open):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Open):
    name: str


class NamedToolChoice(Open):
    type: Literal["function"]
    function: FunctionName


# vLLM's continue_final_message: the final (assistant) message left open, with add_generation_prompt false
_CONTINUE = requires("continue_final_message", {"const": True}, {
    "properties": {"add_generation_prompt": {"const": False}}, "required": ["add_generation_prompt"]})
_CONTINUE_DOC = "the model continues the final message, an assistant's (needs add_generation_prompt: false)"


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS, _PROMPT_LOGPROBS,
        requires("top_logprobs", {"type": "integer"}, {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}),
        requires("tool_choice", {"const": "required"}, {"properties": {"tools": {"type": "array", "minItems": 1}},
                                                         "required": ["tools"]}),
        _CONTINUE]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(None, description="only with logprobs: true")
    chat_template_kwargs: TemplateKwargs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description=_CONTINUE_DOC)
    tools: Annotated[list[Tool], AsSent] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice, AsSent] | None = Field(
        None, description="required needs tools; a named function must be one of tools")
    parallel_tool_calls: bool | None = None
    thinking_token_budget: integer(ge=0, le=THINKING_MAX, description=(
        "a thinking model reasons at most this many tokens, then </think> is forced and the answer follows (vLLM's; "
        "0: no thinking)")) | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="OpenAI's: a thinking budget of the server's --reasoning-effort-budgets (none, minimal: "
                          "no thinking); thinking_token_budget, when given, wins")

    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function): what ``tools``/``tool_choice`` ask."""
        names = [tool["function"]["name"] for tool in self.tools or []]
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            if name not in names:
                raise InvalidRequest(f"tool_choice names the function {name!r}, which is not in tools",
                                     param="tool_choice")
            return "named", name
        if choice == "required" and not names:
            raise InvalidRequest("tool_choice required needs tools", param="tool_choice")
        return (choice if names else "none"), None

    def structured(self, tool_parser: str = "hermes") -> tuple[StructuredOutputsParams, str] | None:
        """A forced tool call (tool_choice required or named) is a grammar over the tool-call format
        ``tool_parser`` reads (hermes JSON or Qwen3.5's XML)."""
        mode, name = self.tool_mode()
        asked = super().structured()
        if mode not in ("required", "named"):
            return asked
        if asked is not None:
            raise InvalidRequest(f"{asked[1]} cannot be combined with tool_choice {mode}", param="tool_choice")
        tag = forced_tag(tool_parser, self.tools, name, self.parallel_tool_calls is not False, MAX_WHITESPACE)
        return StructuredOutputsParams(structural_tag=tag), "tools"

    def logprobs_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# The original design's /generate defaults (its GenerationRequest and DEFAULT_CONFIG); a config file's
# sampling section replaces temperature, top_p and top_k.
GENERATE_DEFAULTS = {"temperature": 1.0, "top_p": 0.95, "top_k": 50}


class GenerateRequest(Strict):
    """The native API of the original design: its fields and defaults, plus MILI's seed, stop and model (a LoRA
    adapter's name; unset: the base model)."""

    prompt: Text
    max_tokens: integer(ge=1, le=4096) = 50
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: TopK | None = None  # the original design's default: 50
    stream: bool = False
    seed: Seed | None = None
    stop: Annotated[Text | list[Text], OnField] | None = None
    model: ModelName | None = None
    thinking_token_budget: integer(ge=0, le=THINKING_MAX, description=(
        "a thinking model reasons at most this many tokens after the <think> it writes, then </think> is forced "
        "(default: the server's --reasoning-budget)")) | None = None

    def sampling_params(self, defaults: dict[str, Any], budget: int | None = None,
                        budget_message: str | None = None) -> SamplingParams:
        """``defaults``: the server's sampling defaults for the fields the request leaves unset; ``budget``: the
        thinking budget (the request's, else the server's)."""
        picked = {k: getattr(self, k) if getattr(self, k) is not None else defaults.get(k, GENERATE_DEFAULTS[k])
                  for k in GENERATE_DEFAULTS}
        return SamplingParams(max_tokens=self.max_tokens, seed=self.seed, stop=self.stop, thinking_token_budget=budget,
                              thinking_budget_message=budget_message, **picked)


class TokenizeCompletionRequest(Strict):
    """vLLM's ``/tokenize`` for a prompt."""

    model: ModelName | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = Field(False, description="also each token's text (the tokenizer's pieces)")


class TokenizeChatRequest(Strict):
    """vLLM's ``/tokenize`` for a conversation, rendered as ``/v1/chat/completions`` renders it (``tools`` too)."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_CONTINUE]})

    model: ModelName | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description=_CONTINUE_DOC)
    add_special_tokens: bool = Field(False, description="the tokenizer's own specials around the rendered text (the "
                                                        "template writes the chat's)")
    chat_template_kwargs: TemplateKwargs | None = None
    tools: Annotated[list[Tool], AsSent] | None = None
    return_token_strs: bool = Field(False, description="also each token's text (the tokenizer's pieces)")


def _tokenize_form(body: Any) -> str:
    return "tokenize-chat" if isinstance(body, dict) and "messages" in body else "tokenize-prompt"


# Either form, told apart by ``messages`` (a body with both has a field the other forbids: a 400 naming it)
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, branch("tokenize-prompt")] |
                            Annotated[TokenizeChatRequest, branch("tokenize-chat")], Discriminator(_tokenize_form)]


class DetokenizeRequest(Strict):
    model: ModelName | None = None
    tokens: Annotated[token_ids(), OnField]


# -- pooling: embeddings, rerank, score (mili/server/pooling.py) -------------------------------------------------
_TRUNCATE = integer(ge=-1, description="an input longer than N tokens is cut to N (embeddings: its last N tokens; a "
                                       "rerank or score pair: its document); -1: to the context length; default: "
                                       "a longer input is a 400")
_INSTRUCTION = Field(None, min_length=1, description="the task, in words: embeddings: the inputs are queries, each "
                                                     "sent as 'Instruct: {instruction}\\nQuery:{input}'; rerank and "
                                                     "score: the reranker's <Instruct> (default: web search)")


class EmbeddingRequest(Strict):
    """OpenAI's ``/v1/embeddings``, with vLLM's ``truncate_prompt_tokens`` and MILI's query ``instruction``."""

    model: ModelName | None = None
    input: Annotated[Text | Annotated[list[Text], Field(min_length=1)] | PromptIds
                     | Annotated[list[PromptIds], Field(min_length=1)], OnField]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: integer(ge=1) | None = Field(None, description="the first N dimensions, renormalised "
                                                               "(Matryoshka); at most the model's hidden size")
    user: str | None = None
    instruction: str | None = _INSTRUCTION
    truncate_prompt_tokens: _TRUNCATE | None = None

    def inputs(self) -> list[str | list[int]]:
        p = self.input
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)


class RerankDocument(Strict):
    text: str


class RerankRequest(Strict):
    """Jina's and Cohere's rerank (``/v1/rerank``, ``/rerank``, ``/v2/rerank``), as vLLM serves them."""

    model: ModelName | None = None
    query: Text
    documents: Annotated[list[str | RerankDocument], Field(min_length=1), OnField]
    top_n: integer(ge=0) | None = Field(None, description="the best N results; 0 or unset: all")
    return_documents: bool = True
    instruction: str | None = _INSTRUCTION
    truncate_prompt_tokens: _TRUNCATE | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(Strict):
    """vLLM's ``/score``: ``text_1`` against ``text_2``, one to one, one to many, or pair by pair."""

    model: ModelName | None = None
    text_1: Annotated[Text | Annotated[list[Text], Field(min_length=1)], OnField]
    text_2: Annotated[Text | Annotated[list[Text], Field(min_length=1)], OnField]
    instruction: str | None = _INSTRUCTION
    truncate_prompt_tokens: _TRUNCATE | None = None

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise InvalidRequest(f"text_1 has {len(first)} texts and text_2 {len(second)}: text_1 is one text, or "
                                 "as many as text_2", param="text_1")
        return list(zip(first, second))


# -- LoRA adapters at run time (mili/server/adapters.py) -----------------------------------------------------------
class LoadLoRARequest(Strict):
    lora_name: Text
    lora_path: Text


class UnloadLoRARequest(Strict):
    lora_name: Text
    lora_int_id: integer(ge=0) | None = None  # (vLLM's; the name decides)
