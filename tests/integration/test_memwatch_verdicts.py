"""memwatch: a workload ended by a signal is FAIL with the signal named; `--out` is checked before
the run (issue 16, item 7). Real commands, real signals (the workload kills itself the way the
kernel's OOM killer would: SIGKILL from outside memwatch)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gce_watchdog.lib.cli import EX_USAGE
from kit.cli import gcewd
from kit.nobody import Nobody

pytestmark = pytest.mark.process

FAST = ["--interval", "50ms", "--warmup", "2", "--min-samples", "30", "--band", "64MiB", "--no-gpu"]
# Steady memory for 2 s (enough samples for a PASS on the gauges), then death by a signal.
_DIE = (
    "import os, signal, time\nkeep = bytearray(32 << 20)\ntime.sleep(2.2)\n"
    "os.kill(os.getpid(), signal.{})\n"
)


def _memwatch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return gcewd("memwatch", *args, timeout=timeout)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV", "SIGTERM"])
def test_a_workload_killed_by_a_signal_is_fail_with_the_signal_named(
    tmp_path: Path, sig: str
) -> None:
    out = tmp_path / "m.json"
    r = _memwatch(*FAST, "--out", str(out), "--", sys.executable, "-c", _DIE.format(sig))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"killed by {sig}" in r.stdout
    assert r.stdout.strip().endswith("FAIL")
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "FAIL"
    assert doc["target"]["signal"] == sig and doc["target"]["killed_by"] == sig
    assert doc["gauges"]["tree_rss"]["status"] == "pass"  # the gauges alone would have passed


def test_the_same_workload_exiting_normally_passes(tmp_path: Path) -> None:
    """The counterpart: without the signal the verdict is PASS (the FAIL above is the signal's)."""
    code = "import time\nkeep = bytearray(32 << 20)\ntime.sleep(2.2)\n"
    r = _memwatch(*FAST, "--", sys.executable, "-c", code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "killed by" not in r.stdout


def test_a_duration_stop_by_memwatch_itself_is_not_a_signal_fail(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    code = "import time\nkeep = bytearray(32 << 20)\ntime.sleep(60)\n"
    r = _memwatch(*FAST, "--duration", "2.2s", "--out", str(out), "--", sys.executable, "-c", code)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["target"]["signal"] == "SIGTERM" and doc["target"]["killed_by"] is None


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("missing/dir/m.json", "does not exist"),
        (".", "is a directory"),
    ],
)
def test_a_bad_out_path_is_refused_before_the_run(tmp_path: Path, where: str, why: str) -> None:
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()"
    t0 = time.monotonic()
    r = _memwatch(*FAST, "--out", str(tmp_path / where), "--", sys.executable, "-c", code)
    assert r.returncode == EX_USAGE, r.stdout + r.stderr
    assert why in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()  # the workload never started
    assert time.monotonic() - t0 < 30


def test_an_unwritable_out_dir_is_refused_before_the_run_as_an_unprivileged_user(
    nobody: Nobody, nobody_dir: Path
) -> None:
    """As uid nobody (setpriv, the agent from a world-readable copy: kit/nobody.py), a root-owned
    0755 directory cannot take the file."""
    target = nobody_dir / "ro"
    target.mkdir(mode=0o755)
    r = nobody.run(
        ["-m", "gce_watchdog", "memwatch", *FAST, "--out", str(target / "m.json"), "--", "true"]
    )
    assert "gce-watchdog memwatch" in r.stderr, r.stdout + r.stderr
    assert r.returncode == EX_USAGE, r.stdout + r.stderr
    assert "cannot write in" in r.stderr and "Permission denied" in r.stderr
