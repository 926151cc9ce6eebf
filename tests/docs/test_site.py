"""The docs site builds with `mkdocs build --strict` (a broken link, a missing anchor or page, a stale snippet fails
it), its generated reference is what the code says, and the README stays a one-screen entry that agrees with CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
TEST_COMMAND = ('pip install torch==2.13.0 && pip install -e ".[test]" -c requirements/test.lock'
                ' && python -m pytest -q -n 2')
SERVE_COMMAND = "pip install torch==2.13.0 && pip install -e . && mili serve"


def test_mkdocs_build_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Qwen3 MoE: 30B-A3B" in home  # the support matrix, included from the README
    assert "max_batch_size" in (tmp_path / "site" / "serving" / "index.html").read_text()  # examples/mili.yaml


def test_the_generated_reference_is_current():
    """docs/reference/cli.md and options.md hold what the parsers and EngineConfig's fields make."""
    from mili.tools import reference

    assert reference.stale() == [], "the docs' generated reference is stale: run python -m mili.tools.reference"


def test_the_docs_requirements_are_in_the_test_extra():
    """CI installs the test extra only: it must pin what docs/requirements.txt pins, the same versions."""
    pins = [line.split("#")[0].strip() for line in (ROOT / "docs" / "requirements.txt").read_text().splitlines()]
    pins = [p for p in pins if p]
    assert pins and all("==" in p for p in pins), pins
    pyproject = (ROOT / "pyproject.toml").read_text()
    test_extra = re.search(r"^test = \[(.*?)\]$", pyproject, re.MULTILINE | re.DOTALL).group(1)
    assert all(f'"{p}"' in test_extra for p in pins), (pins, test_extra)


def test_the_readme_is_one_screen():
    assert len(README.read_text().splitlines()) <= 150


def test_the_readme_commands_are_ci_s():
    """The README's two set-up commands, as they are; .ci/run runs the test command (pip quieter, pytest with more
    report flags)."""
    text = README.read_text()
    assert TEST_COMMAND in text and SERVE_COMMAND in text
    ci = (ROOT / ".ci" / "run").read_text()
    install, _, pytest = TEST_COMMAND.rpartition(" && ")  # (CI checks the install against the lock in between)
    assert install.replace("pip install ", "pip install -q ") in ci
    assert ci.rstrip().splitlines()[-1].startswith(pytest + " "), "the pytest line is CI's last"


def test_the_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path = link.split("#")[0]
        assert (ROOT / path).exists(), f"README links to {link}, which is not in the repository"


def test_no_issue_numbers_or_history_in_user_facing_text():
    """The README and the docs speak to users: no issue numbers, no sessions, no "before this change"."""
    pattern = re.compile(r"\bissues? #?\d+|(?<![\w&])#\d+\b|\bsession\b|\bthis change\b", re.IGNORECASE)
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{page.relative_to(ROOT)}:{number}: {line}"
