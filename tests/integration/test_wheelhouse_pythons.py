"""The hash-pinned wheelhouse on each Python it is for (issue 27 item 2): Ubuntu 22.04 and 24.04
install the agent from it into a venv of their python3 (3.10 and 3.12), Debian 12 and 13 could
too (3.11, 3.13). No Ubuntu tree can be had here (only Debian's archive is reachable), so this
uses a venv of each CPython pyenv has on this machine, with the start-up script's own install
commands: the lock (--require-hashes, no index) then the agent's wheel (--no-deps), then
``gce-watchdog check`` runs and says why there is no GPU (the wheelhouse's nvidia-ml-py is
imported; no NVML library here).

3.10 is refused (docs/packaging.md: the agent needs 3.11's tomllib, datetime.UTC, StrEnum and
typing.Self, more than a tomli backport): the lock names the Pythons it has wheels for, and
``bake-image.sh`` says so and changes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from kit.paths import REPO

PYENV = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions"
SUPPORTED = ("3.11", "3.12", "3.13")

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(600)]


def _python(minor: str) -> Path:
    found = sorted(PYENV.glob(f"{minor}.*/bin/python{minor}"))
    if not found:
        pytest.skip(f"no CPython {minor} under {PYENV}")
    return found[-1]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (REPO / ".venv/bin/python").exists():
        pytest.skip("make venv first")
    out = tmp_path_factory.mktemp("wh")
    p = subprocess.run(["bash", str(REPO / "packaging/wheelhouse.sh"), str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return out / "wheelhouse"


def test_the_lock_names_its_pythons(wheelhouse: Path) -> None:
    lock = (wheelhouse / "requirements.lock").read_text().splitlines()
    assert "# python: " + " ".join(SUPPORTED) in lock
    assert any(ln.startswith("nvidia-ml-py==") for ln in lock)


@pytest.mark.parametrize("minor", SUPPORTED)
def test_installs_and_check_runs(wheelhouse: Path, tmp_path: Path, minor: str) -> None:
    py = _python(minor)
    venv = tmp_path / "venv"
    subprocess.run([str(py), "-m", "venv", str(venv)], check=True, timeout=120)
    # The start-up script's install_wheelhouse, command for command.
    pip = [str(venv / "bin/python"), "-m", "pip", "--isolated", "install",
           "--disable-pip-version-check", "--no-input", "-q", "--no-index",
           "--find-links", str(wheelhouse)]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for extra in (["--require-hashes", "--only-binary=:all:", "-r",
                   str(wheelhouse / "requirements.lock")],
                  ["--no-deps", str(next(wheelhouse.glob("gce_watchdog-*.whl")))]):  # fmt: skip
        p = subprocess.run(pip + extra, capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr
    agent = str(venv / "bin/gce-watchdog")
    v = subprocess.run([agent, "--version"], capture_output=True, text=True, timeout=60, env=env)
    assert v.returncode == 0 and v.stdout.startswith("gce-watchdog "), v.stderr
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[agent]\nstate_dir = "{tmp_path / "state"}"\n')
    p = subprocess.run([agent, "check", "--json", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode in (0, 1, 2), p.stderr
    got = json.loads(p.stdout)
    assert got["gpu"]["present"] is False
    assert got["gpu"]["reason"].startswith("NVML init failed"), got["gpu"]


def test_python_3_10_is_refused_before_anything_changes(wheelhouse: Path) -> None:
    py = _python("3.10")
    prefix = Path("/opt/gce-watchdog")
    existed = prefix.exists()
    p = subprocess.run(["bash", str(REPO / "startup/bake-image.sh"), "--wheelhouse",
                        str(wheelhouse), "--python", str(py)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GCEWD_ROOT": ""})  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "refused, nothing in / was changed" in p.stderr
    assert "is Python 3.10; the wheelhouse is for CPython 3.11 3.12 3.13" in p.stderr
    assert prefix.exists() == existed


def test_a_venv_of_3_10_cannot_take_the_lock(wheelhouse: Path, tmp_path: Path) -> None:
    """Without the check above, pip itself refuses (no cp310 wheels, Requires-Python >= 3.11):
    nothing half-works on 3.10."""
    venv = tmp_path / "venv"
    subprocess.run([str(_python("3.10")), "-m", "venv", str(venv)], check=True, timeout=120)
    p = subprocess.run([str(venv / "bin/python"), "-m", "pip", "--isolated", "install", "-q",
                        "--no-index", "--find-links", str(wheelhouse), "--no-deps",
                        str(next(wheelhouse.glob("gce_watchdog-*.whl")))],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode != 0 and "requires a different Python" in p.stderr, p.stderr
    shutil.rmtree(venv)
