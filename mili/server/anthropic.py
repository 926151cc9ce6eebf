"""Anthropic's Messages API: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens.

A request is translated into the chat path the OpenAI API uses (``mili.server.chat``): system, user and
assistant turns with ``tool_use``/``tool_result`` blocks become the chat template's messages, ``tools``
its tools, ``tool_choice`` ``any``/``tool`` the same grammar-enforced tool calls as OpenAI's
``required``/named choice, ``thinking`` Qwen3's enable_thinking; a final assistant turn is continued
(prefill: chat's ``continue_final_message``), the reply holding only what follows it. The reply's blocks
(thinking, text, tool_use) come from the shared reasoning and tool-call parsers. Errors on these paths
are in Anthropic's shape (``mili.server.errors``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from mili.engine.media import content_parts, image_url_part
from mili.errors import InvalidRequest
from mili.outputs import CompletionOutput, RequestOutput
from mili.server.state import final_output, new_id, state_of, until_disconnect
from mili.server.chat import Block, ChatPrompt, ReplyBlocks, render_chat, start_chat
from mili.server.errors import AnthropicError, anthropic_error, error_responses, streamed, to_api_error
from mili.server.sse import sse
from mili.server.fields import MaxTokens, ModelName, Strict, Text, TypeNeeds, integer, only_types, requires
from mili.server.protocol import ChatCompletionRequest

router = APIRouter()
SIGNATURE = "mili"  # thinking blocks' signature: MILI signs nothing, and ignores the signatures sent back


class _Block(Strict):
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: MILI's prefix cache needs none


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str | list[TextBlock], only_types("text")] = ""
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


class Base64Source(Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]

    def part(self, param: str) -> dict:
        """The OpenAI image part it is: a data: URL, or the URL (fetched under the server's remote-media rules)."""
        src = self.source
        return image_url_part(src.url if src.type == "url" else f"data:{src.media_type};base64,{src.data}", param)


UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
                           Field(discriminator="type")]


class UserMessage(Strict):
    role: Literal["user"]
    content: Annotated[str | Annotated[list[UserBlock], Field(min_length=1)],
                       only_types("text", "image", "tool_result")]


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Annotated[str | Annotated[list[AssistantBlock], Field(min_length=1)],
                       only_types("text", "tool_use", "thinking", "redacted_thinking")]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class Tool(Strict):
    type: Literal["custom"] | None = None
    name: Text
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(TypeNeeds):
    needs = ("tool", "name", {"type": "string"})

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: JsonOutputFormat | None = None  # structured outputs: the reply's text follows the schema


BudgetTokens = integer(ge=1, lt=2**63, description="below max_tokens")


class Thinking(TypeNeeds):
    needs = ("enabled", "budget_tokens", {"type": "integer"})

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: BudgetTokens | None = None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


_FORCED = {"type": "object", "properties": {"type": {"enum": ["any", "tool"]}}, "required": ["type"]}
# tool_choice any or tool needs tools, and is the one constraint on the output (no output_config.format)
_FORCED_TOOLS = requires("tool_choice", _FORCED, {"properties": {"tools": {"type": "array", "minItems": 1}},
                                                  "required": ["tools"]})
_ONE_CONSTRAINT = requires("tool_choice", _FORCED, {"properties": {"output_config": {"anyOf": [
    {"type": "null"}, {"properties": {"format": {"type": "null"}}}]}}})


def thinking_on(body) -> bool:
    """Qwen3 thinks unless ``thinking`` says disabled (enabled: within its budget_tokens, enforced)."""
    return body.thinking is not None and body.thinking.type != "disabled"


class CountTokensRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"allOf": [_FORCED_TOOLS]})

    model: ModelName
    messages: list[Message] = Field(min_length=1)
    system: Annotated[str | list[TextBlock], only_types("text")] | None = None
    thinking: Thinking | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def chat(self, **sampling) -> ChatCompletionRequest:
        """The equivalent OpenAI chat request (``sampling``: its sampling fields)."""
        choice, tool_choice = self.tool_choice, None
        if choice is not None:
            if choice.type in ("any", "tool") and not self.tools:
                raise InvalidRequest(f"tool_choice {choice.type} needs tools", param="tool_choice")
            tool_choice = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool" else
                           {"any": "required"}.get(choice.type, choice.type))
        tools = [{"type": "function", "function": {**t.model_dump(include={"name", "description"}, exclude_none=True),
                                                   "parameters": t.input_schema}} for t in self.tools or []]
        thinking = thinking_on(self)
        prefill = self.messages[-1].role == "assistant"  # the reply continues it, as Anthropic's API does
        return ChatCompletionRequest(
            messages=self._messages(), tools=tools or None, tool_choice=tool_choice,
            parallel_tool_calls=None if choice is None else not choice.disable_parallel_tool_use,
            chat_template_kwargs={"enable_thinking": thinking}, add_generation_prompt=not prefill,
            continue_final_message=prefill, **sampling)

    def _messages(self) -> list[dict]:
        out = [{"role": "system", "content": _text(self.system)}] if self.system else []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts, message = [], {"role": "assistant", "content": ""}  # texts: text pieces and image parts
            for j, b in enumerate(m.content):
                if b.type == "text":
                    texts.append(b.text)
                elif b.type == "image":  # (user turns only)
                    texts.append(b.part(f"messages[{i}].content[{j}]"))
                elif b.type == "tool_result":  # (user turns only, as their type says)
                    if texts:  # text before a result: its own user turn
                        out.append({"role": "user", "content": content_parts(texts, "\n")})
                        texts = []
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
                elif b.type == "tool_use":  # (this and thinking: assistant turns only)
                    message.setdefault("tool_calls", []).append(
                        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
                elif b.type == "thinking":
                    message["reasoning_content"] = b.thinking  # the template shows it where Qwen3 would
                # (redacted thinking is dropped: Qwen3 cannot read it)
            if m.role == "user":
                out += [{"role": "user", "content": content_parts(texts, "\n")}] if texts else []
            else:
                out.append({**message, "content": "\n".join(texts)})
        final = out[-1]
        if final["role"] == "assistant":  # a prefill: Anthropic's rules
            if final.get("tool_calls"):
                raise InvalidRequest("a final assistant turn (prefill) cannot hold tool_use blocks", param="messages")
            if final["content"] != final["content"].rstrip():
                raise InvalidRequest("final assistant content cannot end with trailing whitespace", param="messages")
        return out


TopK = integer(ge=0, lt=2**63, description="0: off")


class MessagesRequest(CountTokensRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [_FORCED_TOOLS, _ONE_CONSTRAINT]})

    max_tokens: MaxTokens
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: MILI's prefix cache needs none
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: changes nothing
    stream: bool = False

    def chat(self, **sampling) -> ChatCompletionRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise InvalidRequest("thinking.budget_tokens must be less than max_tokens", param="thinking")
        fmt = self.output_config.format if self.output_config is not None else None
        forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
        if fmt is not None and forced:
            raise InvalidRequest(f"output_config.format cannot be combined with tool_choice {self.tool_choice.type}",
                                 param="output_config")
        return super().chat(max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, thinking_token_budget=budget if thinking_on(self)
                            else None, response_format=None if fmt is None else {
                                "type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}})


@router.post("/v1/messages/count_tokens", responses=error_responses(400, 404, model=AnthropicError))
async def count_tokens(body: CountTokensRequest, http: Request):
    st = state_of(http)
    st.check_model(body.model)
    prompt = ChatPrompt.render(st.tokenizer, body.chat(), st.tool_call_parser, st.reasoning)
    return {"input_tokens": len(await st.with_images(prompt.token_ids, prompt.images))}


def _tool_id(block: Block) -> str:
    return "toolu_" + block.call_id.removeprefix("call_")


def _content(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": SIGNATURE}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": _tool_id(block), "name": block.name, "input": json.loads(block.text)}


def _stop_reason(o: CompletionOutput, blocks: ReplyBlocks) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if o.finish_reason == "length":
        return "max_tokens", None
    if isinstance(o.stop_reason, str):  # a stop string (a stop token id is the end of the turn)
        return "stop_sequence", o.stop_reason
    return ("tool_use" if blocks.num_calls else "end_turn"), None


_STARTS = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
_DELTAS = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
           "tool_call": ("input_json_delta", "partial_json")}


def _events(kind: str, block: Block, text: str) -> list[str]:
    """One block event as Anthropic's stream events."""
    if kind == "start":
        start = _STARTS.get(block.kind) or {"type": "tool_use", "id": _tool_id(block), "name": block.name, "input": {}}
        return [sse({"type": "content_block_start", "index": block.index, "content_block": start},
                    "content_block_start")]
    if kind == "delta":
        delta_type, field = _DELTAS[block.kind]
        return [sse({"type": "content_block_delta", "index": block.index, "delta": {"type": delta_type, field: text}},
                    "content_block_delta")]
    stop = [sse({"type": "content_block_stop", "index": block.index}, "content_block_stop")]
    if block.kind != "reasoning":
        return stop
    return [sse({"type": "content_block_delta", "index": block.index, "delta": {
        "type": "signature_delta", "signature": SIGNATURE}}, "content_block_delta"), *stop]


STREAM = ("Anthropic's named events: `event: message_start`, `content_block_start`, `content_block_delta`, "
          "`content_block_stop`, `message_delta`, `message_stop`; `event: error` after the start")


@router.post("/v1/messages", responses={**error_responses(400, 404, 500, 529, model=AnthropicError),
                                        **streamed(STREAM)})
async def messages(body: MessagesRequest, http: Request):
    st = state_of(http)
    lora = st.check_model(body.model)
    mid = new_id("msg", "_")
    head = {"id": mid, "type": "message", "role": "assistant", "model": lora.lora_name if lora else st.model_name}

    if not body.stream:
        prompt, stream = await start_chat(st, body.chat(), mid, lora)
        blocks = ReplyBlocks(prompt)
        out = await until_disconnect(http, final_output(stream))
        o = out.outputs[0]
        blocks.feed(o.text, final=True)
        reason, sequence = _stop_reason(o, blocks)
        return {**head, "content": [_content(b) for b in blocks.blocks], "stop_reason": reason,
                "stop_sequence": sequence, "usage": {"input_tokens": len(out.prompt_token_ids),
                                                     "output_tokens": len(o.token_ids)}}

    prompt, params = render_chat(st, body.chat())
    opening = sse({"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(prompt.token_ids), "output_tokens": 0}}}, "message_start")
    return await st.start_stream([prompt.token_ids], [params], mid, _MessageEvents(prompt), [prompt.images],
                                 first=opening + sse({"type": "ping"}, "ping"), lora=lora)


class _MessageEvents:
    """A streamed message's events after ``message_start`` and ``ping`` (server/step_stream.py's Events): the
    content blocks as the reply's text makes them, then ``message_delta`` and ``message_stop``; an ``error``
    event in their place if the request fails."""

    def __init__(self, prompt: ChatPrompt):
        self.blocks = ReplyBlocks(prompt)
        self.last: CompletionOutput | None = None

    def feed(self, _: int, out: RequestOutput) -> bytes:
        o = self.last = out.outputs[0]
        return b"".join(line for event in self.blocks.feed(o.delta, final=o.finished) for line in _events(*event))

    def end(self) -> bytes:
        reason, sequence = _stop_reason(self.last, self.blocks)
        return (sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": {"output_tokens": len(self.last.token_ids)}}, "message_delta")
                + sse({"type": "message_stop"}, "message_stop"))

    def fail(self, error: BaseException) -> bytes:  # after the stream has started: Anthropic's error event
        return sse(anthropic_error(to_api_error(error))[1], "error")

