"""Issue 35, item 5: a stopped VM is judged by its own last boot.

GCE serves serial output only while the VM runs, so a reader with a fresh cursor of a stopped VM
reads nothing. The ledger may hold a decision of an *older* boot of the same instance; it is
the verdict only when GCE's ``lastStartTimestamp`` shows no start after it (the decision was
made in the boot that just ended). A VM started again after that decision ended a boot nobody
read: ``ended_unread`` (an alarm), never the older boot's decision.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer
from kit.poll import P, Z, outputs, poll_args

pytestmark = pytest.mark.process


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        a.add_instance("vm-1", project=P, zone=Z)
        yield a


def _args(api: FakeComputeAPI, tmp_path: Path, cursors: str) -> list[str]:
    """poll --once vm-1, the one ledger, a cursor dir of its own (``cursors``)."""
    args = poll_args(api, tmp_path, "--once", "vm-1")
    args[args.index("--cursor-dir") + 1] = str(tmp_path / cursors)
    return args


def _first_boot_decided(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> str:
    """Boot A powers itself off by the ladder; a poller reads it and fails it over."""
    w = Writer(boot="aaaa0001")
    w.ts_ms = int(time.time() * 1000) - 600_000
    api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
    api.append_serial("vm-1", w.line("shutdown", {"reason": "ladder", "rung": "10/10"}))
    assert main(_args(api, tmp_path, "c1")) == 0
    first = outputs(capsys)["vm-1"]
    assert first["verdict"] == "self_shutdown" and first["action"] == "failover", first
    return str(first["boot"])


def test_a_fresh_reader_of_a_vm_restarted_after_a_decision_reports_the_unread_boot(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _first_boot_decided(api, tmp_path, capsys)
    api.set_status("vm-1", "TERMINATED")
    # someone starts the VM again: boot B runs, writes, and stops before anyone reads it
    api.set_status("vm-1", "RUNNING")
    inst = api.instance("vm-1")
    assert inst.last_start is not None  # GCE's lastStartTimestamp moved with the start
    inst.last_start += 1.0  # a second after the decision, whatever the clock's resolution
    w = Writer(boot="bbbb0002")
    w.ts_ms = int(time.time() * 1000)
    api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
    api.set_status("vm-1", "TERMINATED")
    assert main(_args(api, tmp_path, "fresh")) == 0
    got = outputs(capsys)["vm-1"]
    assert got["verdict"] == "ended_unread", got  # the alarm for the boot that just ended
    assert got["boot"] != "aaaa0001" and got["action"] != "failover", got


def test_a_fresh_reader_of_a_vm_stopped_in_the_decided_boot_reports_that_decision(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    boot = _first_boot_decided(api, tmp_path, capsys)
    api.set_status("vm-1", "TERMINATED")  # no start since: the decided boot is the last one
    assert main(_args(api, tmp_path, "fresh")) == 0
    got = outputs(capsys)["vm-1"]
    assert got["verdict"] == "self_shutdown" and got["boot"] == boot, got
    assert got["action"] == "already_decided", got
