"""A house without circles: MILI's imports (top-level and inside functions alike) form no cycle, and each
points down the layers: kernels, then the model (and the caches), then the runtime, the engine, the server,
and the entry points (the CLI, the offline LLM, mili bench and selftest) above them all. The other top-level
modules (errors, distributed, process, sampling_params...) sit below every layer."""

from __future__ import annotations

import ast
from pathlib import Path

import mili

ROOT = Path(mili.__file__).parent
LAYERS = ["mili.kernels", "mili.model", "mili.runtime", "mili.engine", "mili.server"]  # bottom to top
# beside the model: the page, state and radix caches; the engine's and the model's configs (which check a
# checkpoint's config with model/checks.py) and the config file (its sections are EngineConfig's metadata);
# speculative decoding's drafters and verification, beside the runner; LoRA adapters' layers, beside the model's
SAME_LEVEL = {"mili.cache": "mili.model", "mili.config": "mili.model", "mili.config_file": "mili.model",
              "mili.speculative": "mili.runtime", "mili.lora": "mili.model"}


def _module(path: Path) -> str:
    return ".".join(("mili",) + path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


# the entry points, above every layer: the package's own names, the offline LLM, the CLI, mili/tools (bench, selftest,
# the Triton compile checks) and
# the demo's training script (python -m mili.demo.train)
ENTRY_POINTS = ("mili.cli", "mili.llm", "mili.tools", "mili.demo.train")


def _level(module: str) -> int:
    if module == "mili" or any(module == e or module.startswith(e + ".") for e in ENTRY_POINTS):
        return len(LAYERS)
    for prefix, same in SAME_LEVEL.items():
        if module == prefix or module.startswith(prefix + "."):
            module = same
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return -1  # the base: config, errors, distributed, process, sampling_params, outputs, ...


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_import_points_down():
    upward = [(m, t) for m, targets in import_graph().items() for t in targets if _level(t) > _level(m)]
    assert upward == []


# inside the server, bottom to top: the shared pieces (state.py: the server's state and the stream helpers;
# errors, fields, protocol, metrics, openapi), the chat path the dialects share, the routers, and the app
ROUTERS = {f"mili.server.{name}" for name in ("openai", "anthropic", "responses", "native", "utility",
                                                       "pooling", "adapters")}


def _server_level(module: str) -> int:
    return 3 if module == "mili.server.app" else 2 if module in ROUTERS else 1 if module == "mili.server.chat" else 0


def test_the_server_app_only_assembles():
    """server/ without its circle (issue 30, item 3): the routers import down (the shared state and helpers,
    the chat path), never the app nor each other; the app imports them all and nothing imports it but
    ``mili serve``."""
    graph = import_graph()
    assert ROUTERS <= set(graph)
    server = {m: {t for t in targets if t.startswith("mili.server")} for m, targets in graph.items()
              if m.startswith("mili.server.")}
    wrong = [(m, t) for m, targets in server.items() for t in targets
             if _server_level(t) > _server_level(m) or (_server_level(t) == _server_level(m) > 0)]
    assert wrong == []
    assert ROUTERS <= graph["mili.server.app"]
    assert sorted(m for m, targets in graph.items() if "mili.server.app" in targets) == ["mili.cli"]


def test_the_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_api_side_loads_no_model_code():
    """The API processes' InputProcessor reads a checkpoint's folder through model/checkpoint.py: importing it brings
    in no model code, no weight loader and no runtime (their imports are the engine core's)."""
    import subprocess
    import sys

    code = ("import sys, mili.engine.input_processor, mili.model.checkpoint; "
            "print(sorted(m for m in sys.modules if m.startswith(('mili.runtime', 'mili.model.', 'mili.kernels'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(loaded) == ["mili.model.checkpoint", "mili.model.checks", "mili.model.demo"]
