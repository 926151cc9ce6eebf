"""Request bodies of the HTTP APIs (pydantic), and their translation to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from mili.errors import InvalidRequest
from mili.sampling_params import SamplingParams, StructuredOutputsParams
from mili.structured import MAX_WHITESPACE
from mili.structured import check as check_structured
from mili.tokenizer.tool_calls import forced_tool_call_tag


class Strict(BaseModel):
    """A request body whose unknown fields are a 400 naming them: nothing is silently ignored."""

    model_config = ConfigDict(extra="forbid")


def only_types(*types: str, default: str | None = None) -> BeforeValidator:
    """For a field holding a list of typed items (a union): the first item whose ``type`` is not one of
    ``types`` (``default``: the type of an item without one) is an error naming it, not lost in the
    errors of every branch of the union."""
    def check(items: Any) -> Any:
        for item in items if isinstance(items, list) else []:
            kind = item.get("type", default) if isinstance(item, dict) else None
            if kind not in types:
                raise ValueError(f"items of type {kind!r} are not supported (MILI takes {', '.join(types)})")
        return items

    return BeforeValidator(check)


class StreamOptions(Strict):
    include_usage: bool = False


class _Sampling(Strict):
    """Parameters shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # each prompt token's logprob, plus the top N (not with stream)
    response_format: dict[str, Any] | None = None
    # vLLM's structured outputs: its newer object, and its older guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI fields MILI accepts only with the value that asks for nothing (see check_unsupported)
    logit_bias: dict[str, float] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None  # labels for stored completions: no effect on the output
    service_tier: str | None = None

    def check_unsupported(self) -> None:
        """A field MILI does not implement, set to ask for something, is a 400 naming it."""
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise InvalidRequest(f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: MILI's "
                                 "is xgrammar", param="guided_decoding_backend")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", param="logit_bias")
        if self.store:
            raise InvalidRequest("store: true is not supported (MILI stores no completions)", param="store")
        if self.service_tier not in (None, "auto", "default"):
            raise InvalidRequest(f"service_tier {self.service_tier!r} is not supported (auto or default)",
                                 param="service_tier")

    def prompt_logprobs_n(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any]) -> SamplingParams:
        """``defaults`` are the model's generation defaults (temperature, top_p, top_k) for unset fields."""
        self.check_unsupported()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream and self.prompt_logprobs is not None:  # (as vLLM: they would come all at once anyway)
            raise InvalidRequest("prompt_logprobs is not available when stream is true", param="prompt_logprobs")

        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        structured = self.structured()
        if structured is not None:
            check_structured(structured[0], structured[1])
        return SamplingParams(
            structured_outputs=structured[0] if structured else None, n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", -1),
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs_n(), skip_special_tokens=self.skip_special_tokens)


    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
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
        if name == "structured_outputs":
            allowed = {"json", "json_object", "regex", "choice", "grammar"}
            unknown = sorted(set(value) - allowed - {"disable_any_whitespace", "backend"})
            if unknown:
                raise InvalidRequest(f"structured_outputs does not take {', '.join(unknown)} (it takes "
                                     f"{', '.join(sorted(allowed))})", param=name)
            spec = {k: v for k, v in value.items() if k in allowed}
        else:
            spec = {name.removeprefix("guided_"): value}
        try:
            return StructuredOutputsParams(**spec), name
        except InvalidRequest as e:
            raise InvalidRequest(str(e), param=name) from None


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format of type json_schema needs json_schema.schema (an object)",
                                 param="response_format")
        return StructuredOutputsParams(json=schema)
    raise InvalidRequest(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                         param="response_format")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_logprobs_n(self) -> int | None:
        """vLLM's rule: ``prompt_logprobs`` if given, else with ``echo`` the prompt is scored like the output
        (``logprobs``), as the legacy OpenAI API returns it."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids, "
                             "or a list of lists of token ids", param="prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"content part of type {part.get('type')!r} is not supported "
                                         "(text only)", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        message = {**(self.model_extra or {}), "role": "system" if self.role == "developer" else self.role,
                   "content": content if content is not None else ""}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function): what ``tools``/``tool_choice`` ask."""
        names = []
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not fn["name"]:
                raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                     "'parameters': ...}}}}", param="tools")
            if not isinstance(fn.get("parameters", {}), (dict, type(None))):
                raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
            names.append(fn["name"])
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise InvalidRequest("tool_choice must be none, auto, required or {'type': 'function', 'function': "
                                     "{'name': ...}}", param="tool_choice")
            if name not in names:
                raise InvalidRequest(f"tool_choice names the function {name!r}, which is not in tools",
                                     param="tool_choice")
            return "named", name
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(f"tool_choice {choice!r} is not one of none, auto, required or a named function",
                                 param="tool_choice")
        if choice == "required" and not names:
            raise InvalidRequest("tool_choice required needs tools", param="tool_choice")
        return (choice if names else "none"), None

    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        """A forced tool call (tool_choice required or named) is a grammar over the tool-call format."""
        mode, name = self.tool_mode()
        asked = super().structured()
        if mode not in ("required", "named"):
            return asked
        if asked is not None:
            raise InvalidRequest(f"{asked[1]} cannot be combined with tool_choice {mode}", param="tool_choice")
        tag = forced_tool_call_tag(self.tools, name, self.parallel_tool_calls is not False, MAX_WHITESPACE)
        return StructuredOutputsParams(structural_tag=tag), "tools"

    def logprobs_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# The original design's /generate defaults (its GenerationRequest and DEFAULT_CONFIG); a config file's
# sampling section replaces temperature, top_p and top_k.
GENERATE_DEFAULTS = {"temperature": 1.0, "top_p": 0.95, "top_k": 50}


class GenerateRequest(Strict):
    """The native API of the original design: its fields and defaults, plus MILI's seed and stop."""

    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=50, ge=1, le=4096)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    stream: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """``defaults``: the server's sampling defaults for the fields the request leaves unset."""
        picked = {k: getattr(self, k) if getattr(self, k) is not None else defaults.get(k, GENERATE_DEFAULTS[k])
                  for k in GENERATE_DEFAULTS}
        return SamplingParams(max_tokens=self.max_tokens, seed=self.seed, stop=self.stop, **picked)


class TokenizeRequest(Strict):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Strict):
    tokens: list[int]
