"""The poller's systemd unit and container image definition: valid, hardened, and running the
real command line."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from kit.paths import REPO

UNIT = REPO / "systemd" / "gce-watchdog-poller.service"
TARGET_EXPOSURE = 2.5  # the agent's own unit meets this too (test_systemd_unit.py)

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (apt-get install systemd; `make test` does)",
)


def rendered(d: Path) -> Path:
    """The unit with ExecStart= pointing at this venv's console script, via a path the sandbox
    does not hide (a checkout under /tmp would be hidden by PrivateTmp=)."""
    agent = Path(sys.executable).with_name("gce-watchdog")
    if not agent.is_file():
        pytest.skip(f"no gce-watchdog console script beside {sys.executable}")
    (d / "gce-watchdog").symlink_to(agent)
    text = UNIT.read_text().replace("/opt/gce-watchdog/bin/gce-watchdog", str(d / "gce-watchdog"))
    p = d / "gce-watchdog-poller.service"
    p.write_text(text)
    return p


@needs_analyze
def test_the_poller_unit_verifies_and_is_hardened() -> None:
    try:
        d = Path(tempfile.mkdtemp(prefix="gcewd-poller-unit-", dir="/run"))
    except OSError as e:
        pytest.skip(f"/run is not writable: {e}")
    try:
        unit = rendered(d)
        v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                           text=True, timeout=60, check=False)  # fmt: skip
        problems = [x for x in v.stderr.splitlines() if "gce-watchdog-poller" in x]
        assert problems == [], v.stderr
        s = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)],
                           capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", s.stdout + s.stderr)
        assert m is not None, s.stdout + s.stderr
        assert float(m.group(1)) <= TARGET_EXPOSURE
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_unit_and_the_image_run_the_poller_with_a_real_command_line() -> None:
    exec_start = next(x for x in UNIT.read_text().splitlines() if x.startswith("ExecStart="))
    assert exec_start.split("=", 1)[1].split()[1:3] == ["poll", "--json"]
    docker = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["gce-watchdog", "poll", "--json"]' in docker
    # The parts the central side needs come pinned by hash from the poller's lock (issue 27).
    assert "--require-hashes" in docker and "-r packaging/requirements-poller.lock" in docker
    lock = (REPO / "packaging" / "requirements-poller.lock").read_text()
    for dist in ("psycopg==", "google-cloud-pubsub==", "matplotlib=="):
        assert re.search(rf"^{re.escape(dist)}\S+ --hash=sha256:[0-9a-f]{{64}}", lock, re.M), dist
    r = subprocess.run([sys.executable, "-m", "gce_watchdog", "poll", "--json", "--help"],
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode == 0 and "--label" in r.stdout and "--pubsub" in r.stdout
