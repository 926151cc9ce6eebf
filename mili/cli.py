"""The `mili` command: serve, generate, embed, rerank, bench, selftest."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from mili import options
from mili.config import EngineConfig
from mili.server_options import ServerConfig, effort_budgets


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (generate and serve): one per EngineConfig field, made from its metadata."""
    options.add_arguments(p, EngineConfig)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments out of parsed engine flags."""
    return options.values_from(args, EngineConfig)


@contextlib.contextmanager
def _offline(kwargs: dict):
    """The offline engine of a one-shot command (generate, embed, rerank), its tensor-parallel ranks stopped when the
    command is done: under torchrun they would otherwise only see rank 0's group close under them."""
    from mili.llm import LLM

    llm = LLM(kwargs.pop("model"), **kwargs)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def cmd_generate(args: argparse.Namespace) -> int:
    from mili.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, stop=args.stop or None)
    prompts = args.prompt or ["Hello, my name is"]
    with _offline(engine_kwargs(args)) as llm:
        if args.chat:
            kw = {"enable_thinking": args.thinking}
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                            chat_template_kwargs=kw, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        if len(prompts) > 1:
            print(f"--- {prompt!r}")
        print(out.outputs[0].text)
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    """Embeddings of the texts, for a quick look: each one's size and first values, then their cosine similarities."""
    kwargs = engine_kwargs(args)
    kwargs["task"] = "embed" if kwargs.get("task", "auto") == "auto" else kwargs["task"]
    texts = args.text or ["Hello, my name is"]
    with _offline(kwargs) as llm:
        outs = llm.embed(texts, dimensions=args.dimensions, instruction=args.instruction, use_tqdm=False)
    vectors = [o.outputs.embedding for o in outs]
    for i, (text, v) in enumerate(zip(texts, vectors)):
        head = ", ".join(f"{x:+.4f}" for x in v[:6])
        print(f"[{i}] {len(v)} dims, {len(outs[i].prompt_token_ids)} tokens: [{head}, ...]  {text[:60]!r}")
    if len(vectors) > 1:
        print("cosine similarities:")
        for i, a in enumerate(vectors):
            print(f"[{i}] " + " ".join(f"{sum(x * y for x, y in zip(a, b)):+.4f}" for b in vectors))
    return 0


def cmd_rerank(args: argparse.Namespace) -> int:
    """The documents ranked by a reranker's relevance score for the query."""
    kwargs = engine_kwargs(args)
    kwargs["task"] = "rerank" if kwargs.get("task", "auto") == "auto" else kwargs["task"]
    documents = args.document or []
    with _offline(kwargs) as llm:
        outs = llm.score(args.query, documents, instruction=args.instruction, use_tqdm=False)
    for rank, i in enumerate(sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score), 1):
        print(f"{rank}. {outs[i].outputs.score:.4f}  [{i}] {documents[i][:80]!r}")
    return 0


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's settings out of parsed `mili serve` flags, checked (an InvalidRequest naming a wrong one)."""
    return ServerConfig(**options.values_from(args, ServerConfig))


def cmd_serve(args: argparse.Namespace) -> int:
    from mili.engine.async_llm import AsyncLLM
    from mili.engine.core_start import prefork

    prefork()  # the engine core's process, forked before this one starts a thread: it shares these imports
    if server_config(args).api_server_count > 1:  # one engine core, several API processes on one port
        from mili.server.api_servers import serve_api_servers

        return serve_api_servers(args, EngineConfig(**engine_kwargs(args)), _api_server_main)
    # the engine core loads the model in its own process (a checkpoint it cannot run fails here), while this one
    # imports the HTTP side
    engine = AsyncLLM(EngineConfig(**engine_kwargs(args)), while_loading=_import_http_side)
    return serve_http(args, engine)


def _import_http_side() -> None:
    """The server's modules (uvicorn, FastAPI and the routes: ~1 s), imported while the engine core loads the model
    rather than after it."""
    import uvicorn  # noqa: F401

    import mili.server.app  # noqa: F401


def _api_server_main(args, config, servers, sock, link) -> None:
    """One of --api-server-count processes: its AsyncLLM on the shared core, its app, uvicorn on the shared
    listening socket (mili.server.api_servers)."""
    import math

    from mili.server.api_servers import connect_api_server

    engine = connect_api_server(config, servers, link)
    # each process's share of the bound
    args.max_queued_requests = math.ceil(args.max_queued_requests / servers.count)
    sys.exit(serve_http(args, engine, sockets=[servers.listener(sock)], api_servers=servers))


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """--lora-modules: each ``name=path``, or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    import json

    from mili.errors import InvalidRequest

    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                modules.append((spec["name"], spec["path"]))
            except (ValueError, KeyError, TypeError) as e:
                raise InvalidRequest(f"--lora-modules {value!r}: JSON with 'name' and 'path' ({e})",
                                     param="lora_modules") from None
        elif "=" in value:
            name, path = value.split("=", 1)
            modules.append((name, path))
        else:
            raise InvalidRequest(f"--lora-modules {value!r}: name=path, or JSON with 'name' and 'path'",
                                 param="lora_modules")
    return modules


def serve_http(args: argparse.Namespace, engine, sockets=None, api_servers=None) -> int:
    """Serve the HTTP APIs on ``engine`` (an AsyncLLM) until SIGTERM/SIGINT or the core's death; the exit
    code. ``sockets``/``api_servers``: one of several API processes (mili.server.api_servers)."""
    import os
    import signal
    import threading

    import uvicorn

    server_options = server_config(args)
    # --log-level is MILI's too (the per-request lines are INFO), not only uvicorn's
    logging.getLogger("mili").setLevel(server_options.log_level.upper())

    from mili.server.app import build_app
    from mili.server.state import ReasoningBudgets

    name = server_options.served_model_name or args.model
    api_key = server_options.api_key or os.environ.get("MILI_API_KEY") or None
    runtime_updating = (server_options.allow_runtime_lora_updating
                        or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"))
    app = build_app(engine, name, api_key=api_key, max_queued_requests=server_options.max_queued_requests,
                    sampling_defaults=args.sampling_defaults, tool_call_parser=server_options.tool_call_parser,
                    api_servers=api_servers, lora_modules=parse_lora_modules(server_options.lora_modules or []),
                    runtime_lora_updating=runtime_updating, reasoning=ReasoningBudgets(
                        server_options.reasoning_budget, server_options.reasoning_budget_message,
                        effort_budgets(server_options.reasoning_effort_budgets)))
    host, port = server_options.host, server_options.port
    if api_servers is None or api_servers.index == 0:
        logging.getLogger("mili").info(
            "serving %s as %r on http://%s:%d (chat page: http://%s:%d/ui; tool calls: %s%s)", engine.model_path,
            name, host, port, host, port, app.state.mili.tool_call_parser,
            f"; {api_servers.count} API processes" if api_servers else "")
    from mili.server.step_stream import with_raw_send

    config = uvicorn.Config(with_raw_send(app), host=host, port=port, log_level=server_options.log_level,
                            timeout_graceful_shutdown=server_options.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)

    def engine_died() -> None:
        # every open stream has its error event; for a moment /health and new requests answer 503, then
        # the server stops and exits non-zero so a supervisor restarts it (open connections may not wait)
        for delay, action in ((_DEAD_GRACE_S, lambda: setattr(server, "should_exit", True)),
                              (_DEAD_EXIT_S, lambda: os._exit(1))):
            timer = threading.Timer(delay, action)
            timer.daemon = True
            timer.start()

    engine.on_dead = engine_died
    # uvicorn handles SIGTERM/SIGINT (stop accepting, let in-flight requests finish up to the timeout),
    # then re-raises the signal under the handlers it found: make those no-ops so the exit code is 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    from mili.process import freeze_heap

    freeze_heap()  # (the app, the tokenizer and torch's modules are loaded: the garbage collector skips them)
    try:
        server.run(sockets=sockets)
    finally:
        engine.shutdown()
    if engine.error is not None:
        print(f"error: {engine.error}", file=sys.stderr)
        return 1
    return 0


_DEAD_GRACE_S = 2.0  # after the engine core dies, /health and new requests answer 503 this long
_DEAD_EXIT_S = 8.0  # and the server is gone within this, whatever its open connections


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mili", description="MILI: inference for Qwen3 models")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts and print it")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                     help="with --chat: Qwen3 thinking on/off")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate for each prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the fewest tokens whose "
                     "probability adds up to this (1 = off)")
    gen.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1 = off)")
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    emb = sub.add_parser("embed", help="embed texts with an embedding model (Qwen3-Embedding) and print them")
    add_engine_args(emb)
    emb.add_argument("--text", action="append", help="a text to embed (repeat for several)")
    emb.add_argument("--dimensions", type=int, default=None, help="the first N dimensions, renormalised")
    emb.add_argument("--instruction", default=None, help="the texts are queries for this task")
    emb.set_defaults(func=cmd_embed)
    rr = sub.add_parser("rerank", help="rank documents for a query with a reranker (Qwen3-Reranker)")
    add_engine_args(rr)
    rr.add_argument("--query", required=True, help="the query")
    rr.add_argument("--document", action="append", required=True, help="a document (repeat for several)")
    rr.add_argument("--instruction", default=None, help="the reranker's task (default: web search)")
    rr.set_defaults(func=cmd_rerank)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP APIs")
    add_engine_args(srv)
    options.add_arguments(srv, ServerConfig)  # the server's own flags, one per ServerConfig field
    srv.set_defaults(func=cmd_serve, sampling_defaults={})
    parser.serve_parser = srv  # main() applies a --config file as this parser's defaults

    from mili.tools.bench import add_parser as add_bench_parser

    add_bench_parser(sub)
    st = sub.add_parser("selftest", help="check that MILI is right and fast on this machine (one table; attach it "
                                         "to a bug report); exits 1 if anything fails")
    st.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: CUDA when torch sees a GPU, else the CPU")
    st.add_argument("--quick", action="store_true", help="a tiny benchmark instead of the 0.6B-shaped one")
    st.set_defaults(func=cmd_selftest)
    return parser


def cmd_selftest(args: argparse.Namespace) -> int:
    from mili.tools.selftest import main as selftest

    logging.getLogger("mili").setLevel(logging.WARNING)  # the table is the output
    return selftest(args.device, args.quick)


def _torchrun(args: argparse.Namespace, rank: int) -> int:
    """Under torchrun every process runs the same command: rank 0 serves (or generates), the others hold
    their shard and run the steps rank 0 broadcasts (the group meets at MASTER_ADDR:MASTER_PORT)."""
    from mili.errors import InvalidRequest

    world = int(os.environ["WORLD_SIZE"])
    if args.tensor_parallel_size not in (1, world):
        raise InvalidRequest(f"--tensor-parallel-size {args.tensor_parallel_size} differs from torchrun's "
                             f"WORLD_SIZE {world}", param="tensor_parallel_size")
    args.tensor_parallel_size = world
    from mili.runtime.parallel import leave_group, worker_main

    if rank == 0:
        try:
            return args.func(args)
        finally:
            leave_group()
    from mili.engine.input_processor import InputProcessor
    from mili.runtime.model_runner import ModelRunner

    config = EngineConfig(**engine_kwargs(args))
    inputs = InputProcessor(config)  # the checkpoint's config, refused here as on rank 0 if MILI can't run it
    worker_main(ModelRunner, config, inputs.model_config, inputs.model_path, rank, "env://", os.getppid())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from mili.errors import MiliError

    try:
        if getattr(args, "config", None):  # the file's values become defaults: flags given still win
            from mili.config_file import read_config_file

            values, sampling = read_config_file(args.config, parser.serve_parser)
            parser.serve_parser.set_defaults(**values, sampling_defaults=sampling)
            args = parser.parse_args(argv)
        if getattr(args, "tensor_parallel_size", None) is not None:
            from mili.runtime.parallel import torchrun_rank

            rank = torchrun_rank()
            if rank is not None:
                return _torchrun(args, rank)
        return args.func(args)
    except MiliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
