"""Issue 15, item 3: numbering never goes backwards within a boot, also with a full or read-only
state dir (a small tmpfs in a private mount namespace), and never falls back to 0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol
from kit.paths import REPO

pytestmark = pytest.mark.netns

needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"),
    reason="needs root and unshare (a private mount namespace for the small tmpfs)",
)

SCRIPT = r"""
set -u
D=$1; PY=$2
mount -t tmpfs -o size=64k,mode=0755 tmpfs "$D/state"
mount -t tmpfs -o size=64k,mode=0755 tmpfs "$D/run"
gw() { "$PY" -m gce_watchdog "$@" --config "$D/config.toml"; echo "rc=$? $1" >> "$D/rcs"; }
gw phase bootstrap                                   # creates the key and the counter
dd if=/dev/zero of="$D/state/fill" bs=4k 2>/dev/null # the state dir is full now (ENOSPC)
gw setup-failed --step install --reason "disk full during bootstrap"
gw phase workload
mount -o remount,ro "$D/state"                       # and read-only (EROFS)
gw phase done
gw phase workload
dd if=/dev/zero of="$D/run/fill" bs=4k 2>/dev/null   # the run dir full too: in place, still fine
gw phase done
df -k "$D/state" "$D/run" >> "$D/df"
"""


def _run_in_mount_ns(
    tmp_path: Path, boot8: str, script: str
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """An agent config under ``tmp_path`` (state, run, boot id ``boot8``..., the serial log),
    then ``script`` as root in a private mount namespace (its tmpfs mounts die with it)."""
    for sub in ("state", "run"):
        (tmp_path / sub).mkdir()
    boot = tmp_path / "boot_id"
    boot.write_text(f"{boot8}-0000-4000-8000-000000000001\n")
    serial = tmp_path / "serial.log"
    serial.touch()
    (tmp_path / "config.toml").write_text(
        f'[agent]\nstate_dir = "{tmp_path}/state"\nrun_dir = "{tmp_path}/run"\n'
        f'boot_id_path = "{boot}"\n[serial]\ndevice = "{serial}"\n'
        f'fallback_file = "{tmp_path}/fallback.log"\n'
    )
    p = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", script, "x",
         str(tmp_path), sys.executable],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return serial, p


@needs_unshare
def test_full_then_read_only_state_dir_and_a_full_run_dir_keep_numbering(tmp_path: Path) -> None:
    serial, p = _run_in_mount_ns(tmp_path, "7a7a7a7a", SCRIPT)
    # the namespace is gone with the process: the mounts went with it
    assert not os.path.ismount(tmp_path / "state")
    df = (tmp_path / "df").read_text()
    assert " 100% " in df  # both tmpfs really were full
    assert "No space left" in p.stderr or "Read-only" in p.stderr  # the phase file could not be
    events, stats = protocol.decode_all(serial.read_bytes())
    assert stats.rejected == 0 and stats.forged == 0 and stats.duplicates == 0
    assert [e.seq for e in events] == list(range(len(events)))  # 0..n, nothing reused or lost
    assert [e.event for e in events] == ["key", "key", "phase", "setup_failed"] + ["phase"] * 4
    rcs = (tmp_path / "rcs").read_text().split()
    assert rcs.count("rc=0") == 6, rcs  # every command wrote its line
    assert events[3].get("step") == "install"


def test_an_unusable_run_dir_never_numbers_from_zero(tmp_path: Path) -> None:
    good = SeqAllocator(tmp_path / "run", "aaaa0001")
    first = [good.next() for _ in range(5)]
    assert first == [0, 1, 2, 3, 4]
    (tmp_path / "blocker").write_text("a file where the run dir should be\n")
    bad = SeqAllocator(tmp_path / "blocker" / "run", "aaaa0001")  # ENOTDIR: cannot be created
    later = [bad.next() for _ in range(5)]
    assert bad.fallbacks == 5
    assert later == sorted(later) and len(set(later)) == 5
    # seq 0 and 1 from memory (the emitter fills them with the key announcement: issue 35.4),
    # every other line above every seq the counter handed out, never back at 2
    assert later[:2] == [0, 1]
    later = later[2:]
    assert min(later) > max(first)
    boottime_us = time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1000
    assert min(later) <= boottime_us


RUN_SCRIPT = r"""
set -u
D=$1; PY=$2
mount -t tmpfs -o size=4k,mode=0755 tmpfs "$D/run"
dd if=/dev/zero of="$D/run/fill" bs=4k 2>/dev/null  # full before the boot's first line
gw() { "$PY" -m gce_watchdog "$@" --config "$D/config.toml"; echo "rc=$? $1" >> "$D/rcs"; }
gw phase bootstrap
mount -o remount,ro "$D/run"                         # then read-only (EROFS)
gw phase workload
df -k "$D/run" >> "$D/df"
"""


@needs_unshare
def test_a_full_then_read_only_run_dir_still_announces_at_seq_0_and_1(tmp_path: Path) -> None:
    """Issue 35, item 4: the boot stays pinnable (its first line is the announcement)."""
    from gce_watchdog.poller.timeline import parse_bytes

    serial, _ = _run_in_mount_ns(tmp_path, "7b7b7b7b", RUN_SCRIPT)
    assert " 100% " in (tmp_path / "df").read_text()
    assert (tmp_path / "rcs").read_text().split().count("rc=0") == 2
    events, stats = protocol.decode_all(serial.read_bytes())
    assert stats.forged == 0 and stats.rejected == 0
    assert [(e.event, e.seq) for e in events[:2]] == [("key", 0), ("key", 1)]
    phases = [e for e in events if e.event == "phase"]
    assert [e.get("ph") for e in phases] == ["bootstrap", "workload"]
    assert phases[0].seq < phases[1].seq and phases[0].seq > 1  # from the floor, increasing
    tl = parse_bytes(serial.read_bytes(), rx=1.0)
    assert tl.pinned_here and tl.key_alarm == ""
