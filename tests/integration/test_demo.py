"""`make demo` is the first thing a new user runs: it must keep telling the right story."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kit.paths import REPO

pytestmark = pytest.mark.process


@pytest.mark.slow
def test_demo_shows_the_shutdown_and_the_recovery(tmp_path: Path) -> None:
    env = {**os.environ, "NO_COLOR": "1"}
    logs = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "gce_watchdog.testing.demo", "--dir", str(logs)], cwd=REPO,
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout
    for i in range(1, 11):
        # each line shown once: live, as the agent writes it (VM 2 climbs to 9/10 too)
        # (a dry-run decision latches nothing: VM 1 may tick 10/10 again before it is stopped)
        ticks = [ln for ln in out.splitlines() if " tick " in ln]
        got = sum(ln.endswith(f"FAILED ({i}/10)") for ln in ticks)
        assert got == 2 if i < 10 else got >= 1, i
    assert "=> SHUTDOWN decided (dry run: nothing powered off) at 10/10" in out
    assert "a dry-run decision is never a failover" in out
    assert "dry-run shutdown decision(s), no action taken" in out  # the poller's reason
    assert "=> no shutdown; recovered from 9/10" in out
    assert "healthy: no failover" in out
    assert out.count("0 rejected, 0 sequence gaps") == 2
    # one name per VM, in the heading, the agent's instance line and the chain's delete step
    assert "== VM 1 (sim-vm-1)" in out and "== VM 2 (sim-vm-2)" in out
    assert "instance   inst=4520031799277582145 name=sim-vm-1" in out
    # a dry run rehearses the default action's chain: poweroff, no API call
    assert "chain=linger+poweroff+force+kernel" in out and "step=delete" not in out
    assert "sim-vm-2" not in out.split("== VM 2")[0]
    # human units, not the wire's compact form
    # (the elapsed time is the machine's: 501 ms idle, more when loaded; only its form is fixed)
    assert re.search(r"md=fail timeout \d+ms", out) and "md=fail/timeout" not in out
    # the logs it names are there
    assert f"Logs kept in {logs}:" in out
    for vm in ("vm1", "vm2"):
        assert (logs / vm / "ttyS0").stat().st_size > 0
        assert str(logs / vm / "ttyS0") in out
