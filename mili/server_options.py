"""`mili serve`'s own options (beside the engine's, EngineConfig's), each written once as a ``ServerConfig`` field
whose ``option(...)`` metadata (mili/options.py) makes its flag, its config-file key (the flag's name at the top
level of the file), its checks and its row in the docs' `mili serve` table (mili/tools/reference.py).
Torch-free, as mili/options.py."""

from __future__ import annotations

from dataclasses import dataclass

from mili.errors import InvalidRequest
from mili.options import check, option


EFFORT_BUDGETS = "low=1024,medium=4096,high=16384"  # --reasoning-effort-budgets' default


@dataclass(frozen=True)
class ServerConfig:
    """How `mili serve` serves the engine: its address, its API processes, its limits and its logging."""

    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port to listen on", minimum=0, maximum=65535)
    served_model_name: str | None = option(None, "the model name clients send (default: the MODEL argument)")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics (default: env "
              "MILI_API_KEY; none = open)")
    max_queued_requests: int = option(
        1024, "waiting requests beyond this are refused with 503 and Retry-After", minimum=1)
    shutdown_timeout: float = option(10.0, "seconds in-flight requests get to finish on SIGTERM/SIGINT")
    tool_call_parser: str = option(
        "auto", "the form of the model's tool calls: hermes (Qwen3, Qwen3-Next: JSON in <tool_call>), qwen3_xml "
                "(Qwen3.5/3.6: <function=NAME><parameter=ARG>); auto (default): the XML form when the chat template "
                "renders <function=, else hermes", choices=("auto", "hermes", "qwen3_xml"))
    api_server_count: int = option(
        1, "API server processes on the one port (its listening socket shared), all feeding one engine core: one "
           "scheduler, one batch, one prefix cache. For when one process's CPU (tokenizing, detokenizing, JSON, SSE) "
           "limits throughput. /metrics and /health answer for the whole server. If the engine core dies, every API "
           "process fails its streams and the server exits non-zero; if an API process dies, the others drain as on "
           "SIGTERM and the server exits non-zero (a supervisor restarts it). Default 1: one process",
        metavar="N", minimum=1)
    lora_modules: list[str] | None = option(
        None, "LoRA adapters (PEFT folders) served by name, with --enable-lora: name=path, or vLLM's JSON form "
              "'{\"name\": ..., \"path\": ...}'; a request names one in its model field", metavar="NAME=PATH",
        nargs="+")
    allow_runtime_lora_updating: bool = option(
        False, "with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's env "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True works too)")
    reasoning_budget: int | None = option(
        None, "a thinking model's reasoning, at most N tokens a request: then --reasoning-budget-message and </think> "
              "are forced and the answer follows (llama.cpp's flag). A request's own budget wins (thinking_token_budget, "
              "reasoning_effort, reasoning.effort, Anthropic's thinking.budget_tokens); 0: no thinking (the template's "
              "enable_thinking false); default: no limit", minimum=0, metavar="N")
    reasoning_budget_message: str | None = option(
        None, "text forced before </think> when a thinking budget runs out, as written (Qwen's recipe: '\\n\\n"
              "Considering the limited time by the user, I have to give the solution based on the thinking directly "
              "now.\\n'); default: none, </think> alone", metavar="TEXT")
    reasoning_effort_budgets: str = option(
        EFFORT_BUDGETS, "the thinking budgets of OpenAI's reasoning_effort (chat) and "
        "reasoning.effort (Responses): EFFORT=N pairs, comma-separated (none and minimal: 0, no thinking; an effort "
        "not listed: no limit)", metavar="EFFORT=N,...", example="low=256,high=8192")
    log_level: str = option("info", "the server's logging (MILI's and uvicorn's): warning silences the line per "
                                    "request", choices=("debug", "info", "warning", "error"))
    config: str | None = option(
        None, "a JSON or YAML file of settings: inference.{device, dtype, max_batch_size}, kv_cache.{page_size, "
              "num_pages, dtype}, sampling.{temperature, top_p, top_k} (request defaults), and any flag of this "
              "command by its name; flags given here override it", metavar="FILE", in_file=False)

    def __post_init__(self) -> None:
        check(self, InvalidRequest)
        effort_budgets(self.reasoning_effort_budgets)


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def effort_budgets(text: str) -> dict[str, int | None]:
    """--reasoning-effort-budgets' pairs as {effort: budget} over every effort (none and minimal 0, others unlisted
    None: no limit); a bad pair is refused by name."""
    budgets: dict[str, int | None] = {effort: None for effort in EFFORTS} | {"none": 0, "minimal": 0}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        effort, _, value = pair.partition("=")
        if effort.strip() not in EFFORTS or not value.strip().isdigit():
            raise InvalidRequest(f"reasoning_effort_budgets: {pair!r} is not EFFORT=N with EFFORT one of "
                                 f"{', '.join(EFFORTS)} and N an integer >= 0", param="reasoning_effort_budgets")
        budgets[effort.strip()] = int(value)
    return budgets
