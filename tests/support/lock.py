"""The committed lock of the test dependencies (requirements/test.lock, made by uv from pyproject.toml) and how far
this environment is from it. `.ci/run` runs it after installing: with the lock (MILI_DEPS=locked, the default) any
drift fails the run before pytest; with MILI_DEPS=latest it prints what moved past the lock.

    python tests/support/lock.py [--fail-on-drift]
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "test.lock"
REFRESH = "uv pip compile pyproject.toml --extra test --universal --python-version 3.11 -o requirements/test.lock"


def pins(text: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """{canonical name: version} of a uv / pip-compile lock's lines whose markers hold in ``env`` (this Python's by
    default); comments and `# via` lines skipped. A line that is not one exact pin is refused (ValueError)."""
    env = env or default_environment()
    out = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise ValueError(f"not one exact pin: {line!r}")
        if req.marker is None or req.marker.evaluate(env):
            out[canonicalize_name(req.name)] = specs[0].version
    return out


def installed(name: str) -> str | None:
    """The installed version of ``name`` without its local label (torch's +cpu), or None."""
    try:
        return re.sub(r"\+.*", "", metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def drift(locked: dict[str, str], version_of=installed) -> dict[str, tuple[str, str]]:
    """{name: (installed, locked)} for each pinned package installed at another version. A pinned package that is
    not installed is no drift: the lock is universal (nvidia-* for CUDA's torch, tzdata for Windows, say)."""
    out = {}
    for name, version in sorted(locked.items()):
        have = version_of(name)
        if have is not None and have != version:
            out[name] = (have, version)
    return out


def main(argv: list[str] | None = None, version_of=installed) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fail-on-drift", action="store_true", help="exit 1 if anything differs from the lock")
    args = parser.parse_args(argv)
    moved = drift(pins(LOCK.read_text()), version_of)
    if not moved:
        print(f"dependencies: as {LOCK.relative_to(ROOT)} pins them")
        return 0
    print(f"dependencies: {len(moved)} not as {LOCK.relative_to(ROOT)} pins them (installed, locked):")
    for name, (have, want) in moved.items():
        print(f"  {name} {have} (lock: {want})")
    return 1 if args.fail_on_drift else 0


if __name__ == "__main__":
    sys.exit(main())
