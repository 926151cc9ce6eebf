"""Tests go through the public surface (issue 59): ``LLM``, ``LLMEngine`` (``stats()``, ``info``, ``plan``,
``apply_model``, ``check_integrity()``), the HTTP APIs, the plan, and the kernels' own entry points. A test that
reaches inside breaks on every refactor while describing no behaviour, so the suite holds at most ``LIMIT`` such
reach-ins, each one saying why on its line or the line above (``# reach-in: why``).

A reach-in, read from each file's syntax tree (``ast``):

- a private name (one leading underscore, not a dunder) read from another module: ``from m import _x``, or
  ``obj._x`` where ``_x`` is not the file's own (a function, class, method or ``self._x`` attribute it defines);
- the engine's internals: any ``.core`` attribute (``llm.engine.core``, ``engine.core``: the engine core, its
  scheduler, pools and runner) and any ``.runner`` attribute (the model runner and its parts).

A helper in tests/support/ that reaches in once for many tests counts once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LIMIT = 10
INTERNALS = {"core", "runner"}  # the attributes that lead into the engine's internals
MARK = re.compile(r"#\s*reach-in:\s*\S")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def own_names(tree: ast.AST) -> set[str]:
    """The private names a file defines itself: its functions, classes and methods, and the attributes it sets on
    ``self`` (its own classes' state), and the names it assigns at any level."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls")):
            own.add(node.attr)
    return {name for name in own if _private(name)}


def reach_ins(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each reach-in of one file's source, in line order."""
    tree = ast.parse(source)
    own, found = own_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and (_private(node.attr) and node.attr not in own
                                                  or node.attr in INTERNALS):
            found.append((node.lineno, f".{node.attr}"))
    return sorted(set(found))


def counted() -> dict[str, list[tuple[int, str]]]:
    """Every test and support file's counted reach-ins, by path relative to tests/."""
    out = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel.startswith(("data/", "docs/")):
            continue
        found = reach_ins(path.read_text())
        if found:
            out[rel] = found
    return out


def test_at_most_ten_reach_ins_each_with_its_reason():
    found = counted()
    lines = {(rel, line) for rel, hits in found.items() for line, _ in hits}
    listing = "\n".join(f"  tests/{rel}:{line}: {what}" for rel, hits in found.items() for line, what in hits)
    assert len(lines) <= LIMIT, f"{len(lines)} lines reach into private names or the engine's internals " \
                                f"(at most {LIMIT}): go through LLM, LLMEngine, the HTTP API or a kernel's entry " \
                                f"point, or through one helper in tests/support/\n{listing}"
    unexplained = []
    for rel, hits in found.items():
        text = (TESTS / rel).read_text().splitlines()
        for line, what in hits:
            if not any(MARK.search(text[i - 1]) for i in (line, line - 1) if i >= 1):
                unexplained.append(f"  tests/{rel}:{line}: {what}")
    assert not unexplained, "a reach-in without its reason (# reach-in: why, on its line or the line above):\n" + \
        "\n".join(unexplained)


def test_the_scan_counts_what_it_should():
    """The scan's rules on a file of each kind: another module's private names and the engine's internals count,
    the file's own private helpers do not."""
    source = '''
from mili.x import _hidden, visible
import mili.sampler as sampler

def _helper(llm):
    return llm.engine.core.scheduler

class Recorder:
    def __init__(self):
        self._calls = []

    def _record(self, x):
        self._calls.append(x)

def test_it(llm):
    _helper(llm)
    Recorder()._record(1)
    sampler.Sampler._process_logits(1)
    runner = llm.engine.core.runner
    obj._private_state = 1
    print(llm.engine.plan, llm.engine.info)
'''
    assert own_names(ast.parse(source)) >= {"_helper", "_record", "_calls"}
    assert sorted({line for line, _ in reach_ins(source)}) == [2, 6, 18, 19, 20], reach_ins(source)
