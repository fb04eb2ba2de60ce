"""The dev toolchain is pinned (packaging/constraints-dev.txt) and agrees with what users install.

`make venv` installs ``.[dev,report]`` under the constraints file, so a clean clone runs
``make test`` with the versions this tree last passed with. These checks fail when a dependency
is added to pyproject.toml without a pin, when a pin is not exact, when a run-time dependency's
pin drifts from packaging/requirements.lock (the tests would then exercise another version than
the .deb and the start-up script install), or when the venv running the tests is not the pinned
one (a stale venv: `make venv` reinstalls it).
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

import pytest
from kit.locks import canonical, hash_pinned
from kit.paths import REPO

pytestmark = pytest.mark.pure

CONSTRAINTS = REPO / "packaging" / "constraints-dev.txt"
LOCK = REPO / "packaging" / "requirements.lock"
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _pins(text: str) -> dict[str, str]:
    """name -> version of each ``name==version`` line (comments and blanks skipped); a line of
    another shape is an error."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _PIN.fullmatch(line)
        assert m is not None, f"not an exact pin: {raw!r}"
        name = canonical(m.group(1))
        assert name not in out, f"pinned twice: {name}"
        out[name] = m.group(2)
    return out


def _named() -> set[str]:
    """Every distribution pyproject.toml names for the dev venv: run-time, dev and report."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("dev", "report"):
        reqs += project["optional-dependencies"][extra]
    names = set()
    for r in reqs:
        m = _NAME.match(r)
        assert m is not None, r
        names.add(canonical(m.group(0)))
    return names


def test_every_named_dependency_has_an_exact_pin() -> None:
    pins = _pins(CONSTRAINTS.read_text())
    missing = sorted(_named() - set(pins))
    assert not missing, f"add to {CONSTRAINTS.name} (make dev-lock): {missing}"


def test_run_time_pins_equal_the_lock_users_install() -> None:
    pins = _pins(CONSTRAINTS.read_text())
    lock = hash_pinned(LOCK)
    assert lock, "no pins read from requirements.lock"
    drift = {n: (pins.get(n), v) for n, v in lock.items() if pins.get(n) != v}
    assert not drift, f"constraints-dev vs requirements.lock (dev, lock): {drift}"


def test_the_venv_running_the_tests_is_the_pinned_one() -> None:
    pins = _pins(CONSTRAINTS.read_text())
    stale = {}
    for name, version in pins.items():
        try:
            got = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # pinned for an extra this environment does not install
        if got != version:
            stale[name] = (got, version)
    assert not stale, f"installed vs pinned (run make venv): {stale}"


def test_a_loose_or_doubled_pin_is_refused() -> None:
    """The parser the checks above rest on refuses what pip would accept but is no pin."""
    with pytest.raises(AssertionError, match="not an exact pin"):
        _pins("ruff>=0.4\n")
    with pytest.raises(AssertionError, match="pinned twice"):
        _pins("PyNaCl==1.6.2\npynacl==1.6.2\n")
    assert _pins("# c\n\nFoo_Bar==1.0\n") == {"foo-bar": "1.0"}
