"""Planned-stop notices reach the job run by ``gce-watchdog exec`` (issue 36, item 1): the agent's
notice file (job/notice.py) makes exec send the job ``[job] notice_signal`` once per new notice,
the job finds the notice through ``$GCE_WATCHDOG_NOTICE``, and the metadata watcher writes it when
the maintenance event or the preemption flag changes (every change, more than once)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.daemon.metawatch import MetadataWatcher, metadata_root
from gce_watchdog.job import notice as nt
from gce_watchdog.testing.simgce import FakeMetadataServer, SimInstance
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from kit.clocks import ManualClock
from kit.paths import REPO
from kit.wait import wait_for

EVENT_WAIT_S = 20.0


def _wait_for_file(path: Path, text: str = "") -> str:
    end = time.monotonic() + EVENT_WAIT_S
    while time.monotonic() < end:
        if path.exists() and text in (body := path.read_text()):
            return body
        time.sleep(0.02)  # polling the child's progress, bounded by the deadline above
    raise AssertionError(f"{path} never held {text!r}")


def _config(tmp: Path, extra: str = "") -> Path:
    (tmp / "serial.log").touch()
    cfg = tmp / "config.toml"
    cfg.write_text(
        f'[agent]\nstate_dir = "{tmp}/state"\nrun_dir = "{tmp}/run"\n'
        f'[serial]\ndevice = "{tmp}/serial.log"\nfallback_file = "{tmp}/fallback.log"\n' + extra
    )
    return cfg


JOB = textwrap.dedent("""
    import json, os, pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[1])
    got = []
    def put(path, text):  # whole or not at all: the test reads these files as they appear
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    def on_usr1(signum, frame):
        got.append(json.loads(pathlib.Path(os.environ["GCE_WATCHDOG_NOTICE"]).read_text()))
        put(out.with_suffix(".notices"), json.dumps(got))
    signal.signal(signal.SIGUSR1, on_usr1)
    put(out.with_suffix(".env"), os.environ["GCE_WATCHDOG_NOTICE"])
    stop = out.with_suffix(".stop")
    for _ in range(6000):  # bounded: at most 60 s
        if stop.exists():
            break
        time.sleep(0.01)
    sys.exit(len(got))
""")


def _exec(tmp: Path, extra: str = "") -> subprocess.Popen[bytes]:
    cfg = _config(tmp, extra)
    return subprocess.Popen(
        [sys.executable, "-m", "gce_watchdog", "exec", "--config", str(cfg), "--",
         sys.executable, "-c", JOB, str(tmp / "job")],
        cwd=REPO,
    )  # fmt: skip


def _finish(tmp: Path, p: subprocess.Popen[bytes]) -> int:
    (tmp / "job.stop").touch()
    try:
        return p.wait(timeout=EVENT_WAIT_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.process
def test_a_maintenance_notice_signals_the_job_once(tmp_path: Path) -> None:
    p = _exec(tmp_path)
    try:
        env_path = _wait_for_file(tmp_path / "job.env")
        assert env_path == str(tmp_path / "run" / "notice.json")
        nt.write_notice(
            str(tmp_path / "run"), nt.maintenance_notice("TERMINATE_ON_HOST_MAINTENANCE", 1e9)
        )
        body = _wait_for_file(tmp_path / "job.notices", "maintenance")
    finally:
        rc = _finish(tmp_path, p)
    got = json.loads(body)
    assert rc == 1 and len(got) == 1  # once, though exec kept watching for a second
    assert got[0]["event"] == "TERMINATE_ON_HOST_MAINTENANCE"
    assert got[0]["at"] == "2001-09-09T01:46:40Z" and got[0]["by"] == "2001-09-09T02:46:40Z"


@pytest.mark.process
def test_each_new_notice_is_a_new_signal_and_none_is_not(tmp_path: Path) -> None:
    p = _exec(tmp_path)
    run = str(tmp_path / "run")
    try:
        _wait_for_file(tmp_path / "job.env")
        nt.write_notice(run, nt.maintenance_notice("TERMINATE_ON_HOST_MAINTENANCE", 1e9))
        _wait_for_file(tmp_path / "job.notices", "maintenance")
        nt.write_notice(run, nt.preemption_notice(1e9 + 5))
        _wait_for_file(tmp_path / "job.notices", "preempted")
        nt.write_notice(run, nt.maintenance_notice("NONE", 1e9 + 6))
    finally:
        rc = _finish(tmp_path, p)
    assert rc == 2


@pytest.mark.process
def test_a_notice_from_before_the_job_is_not_news(tmp_path: Path) -> None:
    nt.write_notice(
        str(tmp_path / "run"), nt.maintenance_notice("TERMINATE_ON_HOST_MAINTENANCE", 1e9)
    )
    p = _exec(tmp_path)
    try:
        _wait_for_file(tmp_path / "job.env")
    finally:
        rc = _finish(tmp_path, p)
    assert rc == 0


class FakeChild:
    """Popen's wait/send_signal: times out ``rounds`` times, writing a notice before the second."""

    def __init__(self, run: str, rounds: int) -> None:
        self.run, self.rounds, self.waits, self.sent = run, rounds, [], []  # type: ignore[var-annotated]

    def wait(self, timeout: float | None = None) -> int:
        self.waits.append(timeout)
        if timeout is None or len(self.waits) > self.rounds:
            return 0
        if len(self.waits) == 2:
            nt.write_notice(self.run, nt.preemption_notice(1e9))
        raise subprocess.TimeoutExpired("job", timeout)

    def send_signal(self, signum: int) -> None:
        self.sent.append(signum)


@pytest.mark.pure
@pytest.mark.parametrize(("name", "sent"), [("SIGUSR1", [10]), ("SIGUSR2", [12]), ("off", [])])
def test_the_wait_signals_per_notice_signal(tmp_path: Path, name: str, sent: list[int]) -> None:
    from gce_watchdog.bootstrap.phases import NOTICE_POLL_S, _wait_with_notices

    run = str(tmp_path / "run")
    cfg = cfgmod.from_dict({"agent": {"run_dir": run}, "job": {"notice_signal": name}})
    child = FakeChild(run, rounds=4)
    assert _wait_with_notices(child, nt.NoticeFollower(nt.notice_path(run)), cfg) == 0
    assert child.sent == sent
    assert child.waits == ([None] if name == "off" else [NOTICE_POLL_S] * 5)


@pytest.mark.parametrize(
    ("value", "kind", "ahead"),
    [
        ("TERMINATE_ON_HOST_MAINTENANCE", "maintenance", 3600.0),
        ("MIGRATE_ON_HOST_MAINTENANCE", "maintenance", 60.0),
        ("NONE", "none", 0.0),
        ("SOMETHING_NEW", "maintenance", 3600.0),
    ],
)
@pytest.mark.pure
def test_maintenance_notice_table(value: str, kind: str, ahead: float) -> None:
    n = nt.maintenance_notice(value, 100.0)
    assert (n.kind, n.by - n.at) == (kind, ahead)
    assert n.event == (value if value in nt.MAINTENANCE_VALUES else "unknown")
    assert n.signals is (kind != "none")


@pytest.fixture
def md() -> Iterator[FakeMetadataServer]:
    with FakeMetadataServer(info=SimInstance(project="p", zone="z", name="vm", id="7")) as srv:
        yield srv


@pytest.mark.process
def test_the_watcher_writes_every_change_of_the_maintenance_event(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    cfg = cfgmod.from_dict(
        {"agent": {"state_dir": str(tmp_path), "run_dir": str(tmp_path / "run")},
         "metadata": {"url": md.url},
         "watch": {"poll_timeout": "2s", "refresh": "0.5s", "request_timeout": "0.4s"}}
    )  # fmt: skip
    em = Emitter(MemorySink(), SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=SYNTH_KEY)
    written: list[nt.Notice] = []

    def on_notice(n: nt.Notice) -> None:
        written.append(n)
        nt.write_notice(str(tmp_path / "run"), n)

    w = MetadataWatcher(
        cfg.watch, metadata_root(cfg), str(tmp_path), em, clock=ManualClock(),
        on_notice=on_notice, wall=lambda: 1e9,
    )  # fmt: skip
    w.start()
    try:
        for n, value in enumerate(
            ["TERMINATE_ON_HOST_MAINTENANCE", "NONE", "TERMINATE_ON_HOST_MAINTENANCE"], start=1
        ):
            md.set_maintenance(value)
            assert wait_for(lambda n=n: len(written) == n), value  # type: ignore[misc]
        md.set_preempted(True)
        assert wait_for(lambda: len(written) == 4)
    finally:
        w.stop()
    assert [x.kind for x in written] == ["maintenance", "none", "maintenance", "preempted"]
    on_disk = json.loads((tmp_path / "run" / "notice.json").read_text())
    assert on_disk["kind"] == "preempted" and on_disk["version"] == 1
