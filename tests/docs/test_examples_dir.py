"""The scripts in examples/ run as a user runs them (`python examples/NAME.py ...`, here through runpy in the test's
process): the offline one on the demo model, the client ones against the session's `mili serve` on the demo, which
conftest.docs_server starts with examples/mili.yaml."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# each script's arguments ("{url}": the docs server's /v1), and a line its output must hold
SCRIPTS = {
    "offline_generate.py": ([], "chat -> "),
    "chat_client.py": (["--base-url", "{url}", "Who are you?"], "prompt tokens served from the prefix cache:"),
    "streaming.py": (["--base-url", "{url}", "Hello"], " tokens]"),
}


def test_every_script_is_run_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_example_script(name, request, monkeypatch, capsys, tmp_path):
    args, expected = SCRIPTS[name]
    if any("{url}" in a for a in args):
        url = request.getfixturevalue("docs_server").url + "/v1"
        args = [a.replace("{url}", url) for a in args]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out
    assert expected in out, out


def test_the_example_config_file_reads():
    """examples/mili.yaml is what the docs show for `mili serve --config`: every key in it is one mili serve
    knows (the docs' server also starts with it)."""
    from mili.cli import build_parser
    from mili.config_file import read_config_file

    values, sampling = read_config_file(str(EXAMPLES / "mili.yaml"), build_parser().serve_parser)
    assert values["max_num_seqs"] == 64 and values["num_kv_pages"] == 2048 and values["port"] == 8000
    assert sampling == {"temperature": 0.7, "top_p": 0.95, "top_k": 50}
