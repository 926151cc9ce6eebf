"""The docs' tests share one `mili serve` per test process: the built-in demo model, started with the example
config file (examples/mili.yaml), on a free port. Only the pages and scripts that talk to a server start it."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.server import Server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def docs_server(tmp_path_factory):
    """`mili serve --config examples/mili.yaml` on the demo, as the docs tell users to run it; the command line sets
    the port, float32 and a 1,024-token context (support.server.Server's defaults), and the model's name back to
    `demo`, the name the docs' examples send."""
    s = Server("demo", "--config", str(ROOT / "examples" / "mili.yaml"), "--served-model-name", "demo",
               log_dir=tmp_path_factory.mktemp("docs-server"))
    yield s
    assert s.stop() == 0, s.output()
