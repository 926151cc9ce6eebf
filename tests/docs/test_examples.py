"""Every Python and bash example in the README and the docs runs, against the built-in demo model, so an example
that rots fails the suite. Sybil finds and runs them: ```python blocks in one namespace per page (a page's examples
build on each other, in order), ```bash blocks in bash with `set -euo pipefail`, both in a fresh folder.

- Examples that talk to a server (`127.0.0.1:8000`, `localhost:8000`) reach the session's `mili serve` on the demo
  (conftest.docs_server): the address is put in their place before the page is parsed.
- curl fails on an HTTP error status here (`--fail-with-body`), so a request the server refuses fails the example.
- A block that cannot run in the suite (it installs MILI, starts a server that never returns, needs a GPU, Docker,
  a cluster or a hub checkpoint) carries Sybil's `<!-- skip: next "why" -->` just before it, with its reason;
  `test_every_skip_says_why` holds each to one.

One test per page rather than one per block, so that a page's blocks run in order in one process (pytest-xdist
would scatter single blocks between workers)."""

from __future__ import annotations

import os
import re
import subprocess
import unittest
from pathlib import Path

import pytest
from sybil import Document, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SERVED_AT = ("127.0.0.1:8000", "localhost:8000")  # where the docs say `mili serve` listens
RUN = {"python", "bash"}  # the blocks that run; the others show text (output, YAML, JSON), never commands
SHOWN = {"text", "yaml", "json"}
# a bash prelude: an HTTP error status fails curl, as it fails the openai client
BASH_PRELUDE = 'curl() { command curl --fail-with-body "$@"; }\n'


def run_bash(example) -> str | None:
    """Sybil's evaluator for ```bash blocks: None when the block exits 0, else what it printed."""
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", BASH_PRELUDE + example.parsed], capture_output=True,
                          text=True, timeout=300, cwd=os.getcwd(),
                          env={**os.environ, "MILI_NO_PROGRESS": "1"})
    if done.returncode != 0:
        return f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    return None


def page_document(address: str | None) -> type[Document]:
    """A Sybil Document whose text has the docs' server address replaced by ``address`` (None: as written)."""

    class Served(Document):
        def __init__(self, text: str, path: str) -> None:
            for written in SERVED_AT if address else ():
                text = text.replace(written, address)
            super().__init__(text, path)

    return Served


def sybil_for(address: str | None) -> Sybil:
    return Sybil(parsers=[PythonCodeBlockParser(), CodeBlockParser("bash", evaluator=run_bash), SkipParser()],
                 document_types={".md": page_document(address)})


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_page_examples(page, request, tmp_path, monkeypatch):
    text = page.read_text()
    address = None
    if any(written in text for written in SERVED_AT):
        address = request.getfixturevalue("docs_server").url.removeprefix("http://")
    document = sybil_for(address).parse(page)
    monkeypatch.chdir(tmp_path)
    skipped = []
    for example in document:  # in the page's order, each block in the namespace the earlier ones left
        try:
            example.evaluate()
        except unittest.SkipTest as why:
            skipped.append(f"line {example.line}: {why}")
    print(f"{_id(page)}: {len(skipped)} blocks skipped", *skipped, sep="\n  ")


def _fences(page: Path):
    document = Document(page.read_text(), str(page))
    lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE))
    for region in lexer(document):
        yield document.line_column(region.start), region.lexemes["info"].strip()


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_block_names_its_language(page):
    """A command shown as ```sh, ```shell, ```console or with no language would not run here: every fence is
    python or bash (run), or text, yaml or json (shown)."""
    for where, info in _fences(page):
        assert info in RUN | SHOWN, f"{_id(page)}, {where}: a ```{info} block (run python or bash; show text, yaml or json)"


def test_every_skip_says_why():
    found = 0
    for page in PAGES:
        document = Document(page.read_text(), str(page))
        for region in SkipParser()(document):
            action, reason = region.parsed
            found += 1
            assert action == "next" and reason and len(reason.strip('"')) > 10, (
                f"{_id(page)}, {document.line_column(region.start)}: a skip without its reason: "
                f"<!-- skip: next \"why\" -->")
    assert found, "no skipped block found: has the skip marker changed?"
