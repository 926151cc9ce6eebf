"""OpenAI's Responses API, stateless: POST /v1/responses (streamed or not).

A request is translated into the chat path the chat completions endpoint uses (``mili.server.chat``):
``instructions`` and ``input`` (a string, or message, function_call, function_call_output and reasoning
items) become the chat template's messages, function ``tools`` its tools, ``reasoning`` Qwen3's thinking,
``text.format`` a structured-output constraint. The reply's blocks (reasoning, text, tool calls) become
``reasoning``, ``message`` and ``function_call`` output items. Nothing is stored: ``store: true`` and
``previous_response_id`` are 400s.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema

from mili.engine.media import content_parts, image_url_part
from mili.errors import InvalidRequest
from mili.outputs import RequestOutput
from mili.server.state import ServerState, final_output, new_id, state_of, until_disconnect
from mili.server.chat import Block, ChatPrompt, ReplyBlocks, render_chat, start_chat
from mili.server.errors import error_responses, streamed, to_api_error
from mili.server.sse import sse
from mili.server.fields import MaxTokens, ModelName, Strict, Text, TypeNeeds, only_types, requires
from mili.server.protocol import ChatCompletionRequest
from mili.tokenizer.reasoning import think_end_token_id

router = APIRouter()


class TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text sent back: no effect
    logprobs: list[Any] | None = None


class ImagePart(Strict):
    type: Literal["input_image"]
    image_url: str = Field(description="a data:image/...;base64 URL; http(s):// or file:// where the server "
                                       "allows them (file_id is not supported: MILI stores no files)")
    detail: Literal["low", "high", "auto"] | None = None  # accepted; the image processor decides the size


MessagePart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | list[MessagePart], only_types("input_text", "output_text", "input_image")]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[str | list[TextPart], only_types("input_text", "output_text")]
    id: str | None = None
    status: str | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    status: str | None = None


def _item_type(item: Any) -> str:
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


def _not_only_reasoning(items: str | list) -> str | list:
    if isinstance(items, list) and all(item.type == "reasoning" for item in items):
        raise ValueError("needs a message, function_call or function_call_output item (a reasoning item goes "
                         "with the assistant turn after it)")
    return items


# a conversation: at least one item that is not a reasoning item
InputItems = Annotated[list[InputItem], Field(json_schema_extra={
    "contains": {"not": {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]}}})]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Text
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced when tool_choice forces a call, whatever this says


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries: the reasoning itself comes back


class TextFormat(TypeNeeds):
    needs = ("json_schema", "schema", {"type": "object"})

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class ResponsesRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"allOf": [requires(  # (as on chat)
        "tool_choice", {"const": "required"}, {"properties": {"tools": {"type": "array", "minItems": 1}},
                                               "required": ["tools"]})]})

    model: ModelName | None = None
    input: Annotated[str | InputItems, only_types("message", "function_call", "function_call_output", "reasoning",
                                                  default="message"), AfterValidator(_not_only_reasoning)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None  # returned as sent
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    store: Annotated[bool, Field(description="MILI stores no responses: only false or null",
                                 json_schema_extra={"const": False})] | None = None
    previous_response_id: Annotated[str | None, WithJsonSchema(
        {"type": "null", "description": "MILI stores no responses: send the whole conversation as input"})] = None

    @property
    def thinking(self) -> bool:
        """Qwen3 thinks when ``reasoning`` is given, unless its effort is "none" or "minimal"."""
        return self.reasoning is not None and self.reasoning.effort not in ("none", "minimal")

    def chat(self) -> ChatCompletionRequest:
        if self.previous_response_id is not None:
            raise InvalidRequest("previous_response_id is not supported: MILI stores no responses; send the whole "
                                 "conversation as input", param="previous_response_id")
        if self.store:
            raise InvalidRequest("store: true is not supported: MILI stores no responses; send store: false",
                                 param="store")
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        tools = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                               exclude_none=True)} for t in self.tools or []]
        return ChatCompletionRequest(
            messages=self._messages(), max_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, chat_template_kwargs={"enable_thinking": self.thinking}, tools=tools or None,
            tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls, response_format=self._response_format(),
            reasoning_effort=self.reasoning.effort if self.thinking else None)

    def _response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}

    def _messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        reasoning = None  # a reasoning item's text, for the assistant turn that follows it
        for i, item in enumerate(items):
            if item.type == "reasoning":
                reasoning = "".join(p.text for p in item.content or item.summary)
                continue
            if item.type == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
                continue
            if item.type == "message":
                out.append({"role": item.role, "content": self._content(item.content, i)})
            else:  # a function_call: one more call of the assistant turn it follows, or a turn of its own
                if not out or out[-1]["role"] != "assistant":
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                    "name": item.name, "arguments": item.arguments}})
            if out[-1]["role"] == "assistant" and reasoning is not None:
                out[-1]["reasoning_content"], reasoning = reasoning, None
        return out

    @staticmethod
    def _content(content: str | list[TextPart | ImagePart], index: int) -> str | list[dict]:
        """A message item's content as OpenAI chat content: its text, or its parts when it holds images."""
        if isinstance(content, str):
            return content
        return content_parts([image_url_part(p.image_url, f"input[{index}].content[{j}]") if p.type == "input_image"
                              else p.text for j, p in enumerate(content)], "")


# the chat path names OpenAI chat fields: these are their Responses API names
_PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
           "max_tokens": "max_output_tokens"}


@contextlib.contextmanager
def _named_as_responses():
    try:
        yield
    except InvalidRequest as e:
        e.param = _PARAMS.get(e.param, e.param)
        raise


_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def _item(block: Block, rid: str, status: str, text: str | None = None) -> dict:
    """The output item of a block (``text``: instead of the block's own, as an item starts empty)."""
    text = block.text if text is None else text
    head = {"id": f"{_PREFIXES[block.kind]}_{rid.removeprefix('resp_')}_{block.index}", "status": status}
    if block.kind == "reasoning":
        return {"type": "reasoning", **head, "summary": [], "content": [_part(block, text)]}
    if block.kind == "text":
        return {"type": "message", **head, "role": "assistant", "content": [_part(block, text)]}
    return {"type": "function_call", **head, "call_id": block.call_id, "name": block.name, "arguments": text}


def _part(block: Block, text: str) -> dict:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_status(block: Block, blocks: ReplyBlocks, out: RequestOutput) -> str:
    """A reply cut by max_output_tokens leaves its last item incomplete."""
    cut = out.outputs[0].finish_reason == "length" and block is blocks.blocks[-1]
    return "incomplete" if cut else "completed"


class _Reply:
    """One response's object, as it stands (``snapshot``) and as it ends (``final``)."""

    def __init__(self, st: ServerState, body: ResponsesRequest, prompt: ChatPrompt, rid: str):
        self.st, self.body, self.prompt, self.rid = st, body, prompt, rid
        self.created = int(time.time())
        self.blocks = ReplyBlocks(prompt)

    def snapshot(self, status: str, output: list | None = None, **extra) -> dict:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": None, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "model": self.st.model_name, "output": output or [], "parallel_tool_calls": b.parallel_tool_calls
                is not False, "previous_response_id": None, "reasoning": b.reasoning.model_dump() if b.reasoning
                else None, "store": False, "temperature": b.temperature, "top_p": b.top_p,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedFunction) else
                b.tool_choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
                "truncation": "disabled", "user": b.user, "metadata": b.metadata or {}, **extra}

    def final(self, out: RequestOutput) -> dict:
        o = out.outputs[0]
        cut = o.finish_reason == "length"
        end_id = think_end_token_id(self.st.tokenizer) if self.prompt.thinking else None
        reasoning = (o.token_ids.index(end_id) + 1 if end_id in o.token_ids else
                     len(o.token_ids) if any(b.kind == "reasoning" for b in self.blocks.blocks) else 0)
        usage = {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(o.token_ids),
                 "total_tokens": len(out.prompt_token_ids) + len(o.token_ids),
                 "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": reasoning}}
        output = [_item(b, self.rid, _item_status(b, self.blocks, out)) for b in self.blocks.blocks]
        return self.snapshot("incomplete" if cut else "completed", output, usage=usage,
                             incomplete_details={"reason": "max_output_tokens"} if cut else None)


STREAM = ("the Responses API's named events, each with its `type` and `sequence_number`: `response.created`, "
          "... `response.completed`, `response.incomplete` or `response.failed`")


@router.post("/v1/responses", responses={**error_responses(400, 404, 500, 503), **streamed(STREAM)})
async def responses(body: ResponsesRequest, http: Request):
    st = state_of(http)
    lora = st.check_model(body.model)
    rid = new_id("resp", "_")
    if not body.stream:
        with _named_as_responses():
            prompt, stream = await start_chat(st, body.chat(), rid, lora)
        reply = _Reply(st, body, prompt, rid)
        out = await until_disconnect(http, final_output(stream))
        reply.blocks.feed(out.outputs[0].text, final=True)
        return reply.final(out)

    with _named_as_responses():
        prompt, params = render_chat(st, body.chat())
        events = _ResponseEvents(_Reply(st, body, prompt, rid))
        return await st.start_stream([prompt.token_ids], [params], rid, events, [prompt.images],
                                     first=events.opening(), lora=lora)


class _ResponseEvents:
    """A streamed response's events after ``response.created`` and ``response.in_progress`` (``opening``;
    server/step_stream.py's Events): each output item's as the reply's text makes it, then
    ``response.completed`` or ``response.incomplete``; ``response.failed`` in their place if the request fails."""

    def __init__(self, reply: _Reply):
        self.reply = reply
        self.sequence = itertools.count()
        self.last: RequestOutput | None = None

    def event(self, kind: str, **fields) -> bytes:
        return sse({"type": kind, "sequence_number": next(self.sequence), **fields}, kind)

    def opening(self) -> bytes:
        return (self.event("response.created", response=self.reply.snapshot("in_progress"))
                + self.event("response.in_progress", response=self.reply.snapshot("in_progress")))

    def feed(self, _: int, out: RequestOutput) -> bytes:
        self.last = out
        o = out.outputs[0]
        return b"".join(line for block_event in self.reply.blocks.feed(o.delta, final=o.finished)
                        for line in self._block_events(*block_event, out))

    def end(self) -> bytes:
        final = self.reply.final(self.last)
        return self.event(f"response.{final['status']}", response=final)

    def fail(self, error: BaseException) -> bytes:  # after the stream has started: the response failed
        err = to_api_error(error)
        detail = {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}
        return self.event("response.failed", response=self.reply.snapshot("failed", error=detail))

    def _block_events(self, kind: str, block: Block, text: str, out: RequestOutput):
        rid, event = self.reply.rid, self.event
        where = {"item_id": _item(block, rid, "")["id"], "output_index": block.index}
        parts = {"content_index": 0} if block.kind != "tool_call" else {}
        name = {"reasoning": "response.reasoning_text", "text": "response.output_text",
                "tool_call": "response.function_call_arguments"}[block.kind]
        logprobs = {"logprobs": []} if block.kind == "text" else {}
        if kind == "start":
            yield event("response.output_item.added", output_index=block.index,
                        item=_item(block, rid, "in_progress", ""))
            if parts:
                yield event("response.content_part.added", **where, **parts, part=_part(block, ""))
        elif kind == "delta":
            yield event(f"{name}.delta", **where, **parts, delta=text, **logprobs)
        else:
            done = {"arguments": block.text, "name": block.name} if block.kind == "tool_call" else {"text": block.text}
            yield event(f"{name}.done", **where, **parts, **done, **logprobs)
            if parts:
                yield event("response.content_part.done", **where, **parts, part=_part(block, block.text))
            yield event("response.output_item.done", output_index=block.index,
                        item=_item(block, rid, _item_status(block, self.reply.blocks, out)))

