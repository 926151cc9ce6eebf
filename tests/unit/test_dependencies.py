"""The committed lock (requirements/test.lock) is what CI installs: made by uv from pyproject.toml's test extra with
the documented command, current with pyproject (every requirement met by its pin), the README's and CI's command
install with it, and .ci/run checks the environment against it (tests/support/lock.py)."""

from __future__ import annotations

import tomllib

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.lock import LOCK, REFRESH, ROOT, drift, main, pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def test_pins_reads_markers_and_refuses_ranges():
    lock = ("a==1.0\n    # via b\nnumpy==2.4.6 ; python_full_version < '3.12'\n"
            "numpy==2.5.5 ; python_full_version >= '3.12'\n")
    assert pins(lock, default_environment() | {"python_full_version": "3.11.7"}) == {"a": "1.0", "numpy": "2.4.6"}
    assert pins(lock, default_environment() | {"python_full_version": "3.13.1"})["numpy"] == "2.5.5"
    for bad in ("a>=1.0\n", "a==1.0,<2\n", "a\n"):
        with pytest.raises(ValueError, match="not one exact pin"):
            pins(bad)


def test_drift_names_what_moved_and_ignores_what_is_not_installed():
    have = {"pytest": "9.2.0", "torch": "2.13.0", "nvidia-nccl-cu13": None}.get
    locked = {"pytest": "9.0.3", "torch": "2.13.0", "nvidia-nccl-cu13": "2.29.7"}
    assert drift(locked, have) == {"pytest": ("9.2.0", "9.0.3")}
    assert drift({"torch": "2.13.0"}, have) == {}


def test_the_drift_check_fails_only_when_asked(capsys):
    def old_pytest(name):
        return "0.0.1" if name == "pytest" else None

    assert main(["--fail-on-drift"], old_pytest) == 1
    assert "pytest 0.0.1 (lock: " in capsys.readouterr().out
    assert main([], old_pytest) == 0  # (MILI_DEPS=latest: printed, not failed)
    assert main(["--fail-on-drift"], lambda name: None) == 0


def test_the_lock_is_made_by_the_documented_command():
    """uv writes its command on the lock's second line; docs/architecture.md gives the same one to refresh it."""
    assert LOCK.read_text().splitlines()[1] == f"#    {REFRESH}"
    assert REFRESH in (ROOT / "docs" / "architecture.md").read_text()


def test_every_requirement_is_met_by_its_pin():
    """A requirement added or tightened in pyproject.toml without refreshing the lock fails here (pip would refuse
    the constraints): each one that applies on this Python has a pin, and the pin satisfies it."""
    locked = pins(LOCK.read_text())
    for req in project_requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in locked, f"{req} is not in {LOCK.name}: refresh it ({REFRESH})"
        assert req.specifier.contains(locked[name], prereleases=True), \
            f"{LOCK.name} pins {name}=={locked[name]}, pyproject asks {req}: refresh it ({REFRESH})"


def test_the_runtime_ranges_stop_before_the_majors_known_to_break():
    """Users get ranges, not pins; torch and transformers stop below their next major (a major release of either
    has changed what MILI's model code and loaders rely on)."""
    reqs = {canonicalize_name(r.name): r.specifier for r in project_requirements()}
    assert not reqs["torch"].contains("2.14.0") and reqs["torch"].contains("2.11.0")
    assert not reqs["transformers"].contains("6.0.0") and reqs["transformers"].contains("5.25.0")


def test_ci_installs_with_the_lock_or_the_latest_and_checks_which():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[test]" -c requirements/test.lock' in ci
    assert "python tests/support/lock.py --fail-on-drift" in ci  # locked: as pinned, or the run fails
    assert "--upgrade-strategy eager" in ci and "MILI_DEPS" in ci
