"""`make demo` is the first thing a new user runs: it must keep telling the right story."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_shows_the_shutdown_and_the_recovery() -> None:
    env = {**os.environ, "NO_COLOR": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "gce_watchdog.testing.demo"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout
    for i in range(1, 11):
        assert f"BOTH reachability probes FAILED ({i}/10)" in out
    assert "=> SHUTDOWN decided at 10/10" in out
    assert "self_shutdown: FAIL OVER" in out
    assert "=> no shutdown; recovered from 9/10" in out
    assert "healthy: no failover" in out
    assert out.count("0 rejected, 0 sequence gaps") == 2
