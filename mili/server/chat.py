"""The chat path every dialect shares (OpenAI's chat completions, Anthropic's messages, OpenAI's responses).

A dialect translates its request into a ``ChatCompletionRequest``; ``ChatPrompt.render`` makes the chat
template's prompt from it (tools, Qwen3 thinking), ``ChatPrompt.params`` the engine request's sampling
parameters (a structured-output or forced-tool constraint placed after ``</think>``). On the way back,
``ReplyBlocks`` turns the reply's text, whole or as it streams, into blocks in the order the model wrote
them: reasoning, text, tool calls (Anthropic's content blocks, the Responses API's output items), through
the one reasoning parser and the tool-call parser of the form the checkpoint writes (the server picks
hermes or qwen3_xml from its template: tool_parsers.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mili.engine.media import ImageRef
from mili.outputs import RequestOutput
from mili.sampling_params import SamplingParams
from mili.server.state import ReasoningBudgets, ServerState
from mili.server.protocol import ChatCompletionRequest, template_messages
from mili.tokenizer.reasoning import THINK_END, THINK_START, ReasoningStream, constraint_start
from mili.tokenizer.tokenizer import encode_chat
from mili.tokenizer.tool_parsers import extract_calls, tool_call_stream


TURN_START = "<|im_start|>"  # where each turn of Qwen's chat format starts


@dataclass
class ChatPrompt:
    text: str  # the chat template's rendering
    token_ids: list[int]
    thinking: bool  # Qwen3 thinks first (the template's enable_thinking, on unless set false)
    opened: bool  # the template wrote <think> itself: the reply starts inside the reasoning
    tools: bool  # tool calls are parsed out of the reply (tools given, tool_choice not none)
    tool_parser: str = "hermes"  # the form the model writes calls in (tool_parsers.py)
    tool_defs: list[dict] | None = None  # the request's tools (their schemas type XML arguments)
    images: list[ImageRef] = field(default_factory=list)  # its image parts, in order (loaded by ServerState.start)
    budget: int | None = None  # the reply's thinking budget (None: none)
    budget_message: str | None = None

    @classmethod
    def render(cls, tokenizer, body: ChatCompletionRequest, tool_parser: str = "hermes",
               reasoning: ReasoningBudgets | None = None) -> ChatPrompt:
        """``reasoning``: the server's budgets (a budget of 0 renders the template with thinking off, unless the
        request's chat_template_kwargs set enable_thinking themselves)."""
        budget = (reasoning or ReasoningBudgets()).budget(body.thinking_token_budget, body.reasoning_effort)
        kwargs = body.chat_template_kwargs or {}
        if budget == 0 and "enable_thinking" not in kwargs:
            kwargs = {**kwargs, "enable_thinking": False}
        tool_mode, _ = body.tool_mode()
        template_kwargs = {**kwargs, "tools": body.tools} if body.tools else kwargs
        messages, images = template_messages(body.messages)
        text, token_ids = encode_chat(tokenizer, messages, body.add_generation_prompt, template_kwargs,
                                      body.continue_final_message)
        thinking = kwargs.get("enable_thinking", True) is not False  # as Qwen3's template decides
        opened = thinking and text.rstrip().endswith(THINK_START)  # templates that open <think> themselves
        if body.continue_final_message:  # the reply continues the final turn: inside its thinking if left open
            turn = text[text.rfind(TURN_START):]
            thinking = opened = thinking and turn.rfind(THINK_START) > turn.rfind(THINK_END)
        return cls(text, token_ids, thinking, opened, tool_mode != "none", tool_parser, body.tools, images,
                   budget if thinking else None, reasoning.message if reasoning is not None else None)

    def params(self, tokenizer, body: ChatCompletionRequest, max_tokens: int | None, logprobs: int | None,
               defaults: dict[str, Any]) -> SamplingParams:
        params = body.sampling_params(max_tokens, logprobs, defaults, self.tool_parser)
        params.thinking_token_budget, params.thinking_budget_message = self.budget, self.budget_message
        if params.structured_outputs is not None:
            params.structured_outputs.start_after_token_id = constraint_start(tokenizer, self.text, self.thinking)
        return params

    def tool_stream(self):
        """A streaming tool-call parser for one reply, or None when calls are not parsed."""
        return tool_call_stream(self.tool_parser, self.tool_defs) if self.tools else None

    def tool_calls(self, content: str) -> tuple[str | None, list[tuple[str, str]]]:
        """A whole reply's content (after its reasoning) split into content and [(name, arguments)]."""
        return extract_calls(self.tool_parser, content, self.tool_defs) if self.tools else (content, [])


def render_chat(st: ServerState, body: ChatCompletionRequest) -> tuple[ChatPrompt, SamplingParams]:
    """``body`` rendered, and its one engine request's sampling parameters (no logprobs)."""
    prompt = ChatPrompt.render(st.tokenizer, body, st.tool_call_parser, st.reasoning)
    return prompt, prompt.params(st.tokenizer, body, body.max_tokens, None, st.openai_defaults)


async def start_chat(st: ServerState, body: ChatCompletionRequest, request_id: str, lora=None,
                     ) -> tuple[ChatPrompt, AsyncIterator[RequestOutput]]:
    """Render ``body`` and start its one engine request (no logprobs), under ``lora`` if given: its prompt and
    output stream."""
    prompt, params = render_chat(st, body)
    (stream,) = await st.start([prompt.token_ids], [params], request_id, [prompt.images], lora=lora)
    return prompt, stream


@dataclass
class Block:
    kind: str  # "reasoning" | "text" | "tool_call"
    index: int  # its place in the reply
    text: str = ""  # the reasoning, the text, or the call's arguments (the JSON text the model wrote)
    name: str | None = None  # a tool call's function
    call_id: str | None = None  # a tool call's id ("call_...")


class ReplyBlocks:
    """One reply's growing text → its blocks, each started, extended and stopped, in order.

    ``feed`` returns events ``("start", block, "")``, ``("delta", block, text)`` and ``("stop", block, "")``.
    Fed the whole text at once it ends with the same ``blocks`` a stream builds piece by piece. The text
    after ``</think>`` is kept as written, its leading whitespace included (vLLM's rule, the one chat
    completions follows: reasoning.py); whitespace is sent only once more text follows it (or the reply
    ends on it), so the whitespace around a tool call is in no block either way."""

    def __init__(self, prompt: ChatPrompt):
        self.reasoning = ReasoningStream(prompt.thinking, prompt.opened)
        self.tools = prompt.tool_stream()
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._space = ""  # whitespace at the end of the text so far, not sent yet

    @property
    def num_calls(self) -> int:
        return sum(b.kind == "tool_call" for b in self.blocks)

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, Block, str]]:
        events: list[tuple[str, Block, str]] = []
        reasoning, content = self.reasoning.feed(delta, final)
        if reasoning:
            self._extend("reasoning", reasoning, events)
        for part in self.tools.feed_parts(content, final) if self.tools is not None else [content]:
            if isinstance(part, str):
                text = self._space + part
                body = text.rstrip()
                self._space = text[len(body):]
                if body:  # text right after a tool call starts at its first non-whitespace character
                    self._extend("text", body.lstrip() if self._after_call() else body, events)
                continue
            fn = part["function"]
            if "id" in part:  # a new call: its name (and, if it came whole, its arguments)
                self._space = ""
                self._start(Block("tool_call", len(self.blocks), name=fn["name"], call_id=part["id"]), events)
            if fn["arguments"]:
                self._extend("tool_call", fn["arguments"], events)
        if final:
            if self._space and not self._after_call():
                self._extend("text", self._space, events)
            self._stop(events)
        return events

    def _after_call(self) -> bool:
        """The last block is a tool call: the whitespace that follows it is in no block."""
        return bool(self.blocks) and self.blocks[-1].kind == "tool_call"

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open.kind == kind

    def _extend(self, kind: str, text: str, events: list) -> None:
        if not self._is_open(kind):
            self._start(Block(kind, len(self.blocks)), events)
        self._open.text += text
        events.append(("delta", self._open, text))

    def _start(self, block: Block, events: list) -> None:
        self._stop(events)
        self.blocks.append(block)
        self._open = block
        events.append(("start", block, ""))

    def _stop(self, events: list) -> None:
        if self._open is not None:
            events.append(("stop", self._open, ""))
            self._open = None
