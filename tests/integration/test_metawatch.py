"""Metadata watcher (daemon/metawatch.py) against the simulated metadata server (real HTTP)."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.daemon.metawatch import (
    InstanceInfo,
    MdResponse,
    MetadataClient,
    MetadataError,
    MetadataWatcher,
    SystemdFaultApplier,
    load_applied,
    load_instance_cache,
    metadata_root,
    parse_disarm_value,
)
from gce_watchdog.faults.request import FaultRequest, parse_request
from gce_watchdog.testing.simgce import FakeMetadataServer
from gce_watchdog.testing.simgce import SimInstance as SimInfo
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm import logs
from gce_watchdog.vm.console import Emitter, LogMirror, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol
from kit.clocks import ManualClock
from kit.events import sink_events
from kit.wait import wait_for


class RecordingClient(MetadataClient):
    """The real client, recording what it asked for (the fake server logs only paths)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.asked: list[tuple[str, dict[str, str], float]] = []

    def get(self, path: str, params: dict[str, str] | None, timeout: float) -> MdResponse:
        self.asked.append((path, dict(params or {}), timeout))
        return super().get(path, params, timeout)


@pytest.fixture
def md() -> Iterator[FakeMetadataServer]:
    info = SimInfo(project="sim-project", zone="europe-west4-b", name="vm-7", id="77")
    with FakeMetadataServer(info=info) as srv:
        yield srv


def make(
    tmp: Path,
    md: FakeMetadataServer,
    clock: ManualClock | None = None,
    log: LogMirror | None = None,
    **watch: object,
) -> tuple[MetadataWatcher, MemorySink, RecordingClient]:
    w = {"poll_timeout": "2s", "refresh": "0.5s", "request_timeout": "0.4s"}
    w.update({k: str(v) if not isinstance(v, bool) else v for k, v in watch.items()})  # type: ignore[misc]
    cfg = cfgmod.from_dict(
        {"agent": {"state_dir": str(tmp)}, "metadata": {"url": md.url}, "watch": w}
    )
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp, "0badc0de"), "0badc0de", log=log, key=SYNTH_KEY)
    client = RecordingClient(metadata_root(cfg))
    watcher = MetadataWatcher.from_config(cfg, em, clock=clock or ManualClock(), client=client)
    return watcher, sink, client


def events(sink: MemorySink) -> list[protocol.Event]:
    return sink_events(sink)


@pytest.mark.pure
def test_metadata_root_from_the_probe_url() -> None:
    cfg = cfgmod.Config()
    assert metadata_root(cfg) == "http://169.254.169.254/computeMetadata/v1/"
    c2 = cfgmod.from_dict({"metadata": {"url": "http://127.0.0.1:8080/other"}})
    assert metadata_root(c2) == "http://127.0.0.1:8080/computeMetadata/v1/"
    c3 = cfgmod.from_dict({"watch": {"metadata_root": "http://10.0.0.1/computeMetadata/v1"}})
    assert metadata_root(c3) == "http://10.0.0.1/computeMetadata/v1/"


@pytest.mark.pure
@pytest.mark.parametrize(
    ("value", "disarmed"),
    [("true", True), ("TRUE\n", True), ("1", True), ("yes", True), ("false", False), ("", False)],
)
def test_parse_disarm_value(value: str, disarmed: bool) -> None:
    assert parse_disarm_value(value) is disarmed


@pytest.mark.process
def test_identity_is_read_and_cached(tmp_path: Path, md: FakeMetadataServer) -> None:
    w, sink, _ = make(tmp_path, md)
    assert w.refresh_once()
    want = InstanceInfo("sim-project", "europe-west4-b", "vm-7", "77")
    assert w.instance == want
    assert load_instance_cache(tmp_path) == want
    # said once on the console when first learnt (the start line had no cache to name it from)
    assert w.refresh_once()
    [ev] = [e for e in events(sink) if e.event == "instance"]
    assert ev.fields_dict == {
        "inst": "77",
        "name": "vm-7",
        "zone": "europe-west4-b",
        "proj": "sim-project",
    }
    # a restart that finds the same identity in its cache says nothing new
    w2, sink2, _ = make(tmp_path, md)
    w2.start()
    try:
        assert w2.refresh_once()
    finally:
        w2.stop()
    assert not [e for e in events(sink2) if e.event == "instance"]


@pytest.mark.process
def test_cache_serves_a_restart_while_metadata_is_down(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    w, _, _ = make(tmp_path, md)
    assert w.refresh_once()
    md.set_mode("refuse")
    w2, _, _ = make(tmp_path, md)
    w2.start()
    try:
        assert w2.instance == InstanceInfo("sim-project", "europe-west4-b", "vm-7", "77")
        assert not w2.refresh_once()
        assert w2.instance is not None  # a failed refresh keeps what was known
    finally:
        w2.stop()


@pytest.mark.process
def test_a_server_without_the_flavor_header_is_not_believed(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    md.set_mode("bad_flavor")
    w, _, _ = make(tmp_path, md)
    assert not w.refresh_once()
    assert w.instance is None
    assert load_instance_cache(tmp_path) is None


@pytest.mark.process
def test_disarm_attribute_set_removed_and_aging_out(tmp_path: Path, md: FakeMetadataServer) -> None:
    clock = ManualClock()
    w, _, _ = make(tmp_path, md, clock=clock, disarm_hold="1h")
    assert w.refresh_once() and not w.disarm_requested
    md.set_attribute("gce-watchdog-disarm", "true")
    assert w.refresh_once() and w.disarm_requested
    md.set_attribute("gce-watchdog-disarm", None)
    assert w.refresh_once() and not w.disarm_requested
    md.set_attribute("gce-watchdog-disarm", "true")
    assert w.refresh_once() and w.disarm_requested
    # The metadata server goes away: the last answer holds for disarm_hold, then expires.
    md.set_mode("refuse")
    assert not w.refresh_once()
    clock.t += 3599
    assert w.disarm_requested
    clock.t += 2
    assert not w.disarm_requested


@pytest.mark.process
def test_preemption_notice_is_written_at_once_through_a_long_poll(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    w, sink, client = make(tmp_path, md, poll_timeout="30s")
    w.start()
    try:
        # Wait until a wait-for-change poll on instance/preempted is in flight.
        assert wait_for(
            lambda: any(
                p == "instance/preempted" and q.get("wait_for_change") == "true"
                for p, q, _ in client.asked
            )
        )
        t0 = time.monotonic()
        md.set_preempted(True)
        assert wait_for(lambda: any(e.event == "preempted" for e in events(sink)))
        latency = time.monotonic() - t0
    finally:
        w.stop()
    assert latency < 1.0, latency  # GCE gives ~30 s; the notice must not wait for a refresh
    pre = [e for e in events(sink) if e.event == "preempted"]
    assert len(pre) == 1
    assert pre[0].get("src") == "metadata"
    assert w.preempted
    poll = next(
        (q, t) for p, q, t in client.asked if p == "instance/preempted" and q.get("wait_for_change")
    )
    q, t = poll
    assert q["timeout_sec"] == "30" and q["last_etag"]
    assert t == pytest.approx(40.0)  # the client waits longer than the server


@pytest.mark.process
def test_maintenance_events_are_reported(tmp_path: Path, md: FakeMetadataServer) -> None:
    w, sink, client = make(tmp_path, md)
    w.start()
    try:
        assert wait_for(
            lambda: any(
                p == "instance/maintenance-event" and q.get("wait_for_change")
                for p, q, _ in client.asked
            )
        )
        md.set_maintenance("MIGRATE_ON_HOST_MAINTENANCE")
        assert wait_for(lambda: any(e.event == "maintenance" for e in events(sink)))
        md.set_maintenance("NONE")
        assert wait_for(lambda: len([e for e in events(sink) if e.event == "maintenance"]) == 2)
    finally:
        w.stop()
    m = [e for e in events(sink) if e.event == "maintenance"]
    assert [(e.get("event"), e.get("was")) for e in m] == [
        ("MIGRATE_ON_HOST_MAINTENANCE", "NONE"),
        ("NONE", "MIGRATE_ON_HOST_MAINTENANCE"),
    ]
    assert not any(e.event == "preempted" for e in events(sink))


@pytest.mark.process
def test_maintenance_changes_reach_the_journal_and_the_watcher_lives_on(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    """Issue 39: the line's `event` field collided with the mirror's own `event` argument, and
    the TypeError killed the watcher's thread at the first change."""
    out = io.StringIO()
    lg = logging.getLogger("gce-watchdog-test-maintenance")
    lg.addHandler(logs.EventHandler(out, None, False))
    lg.setLevel(logging.INFO)
    w, sink, client = make(tmp_path, md, log=logs.mirror(logs.EventLog(lg)))
    values = ["MIGRATE_ON_HOST_MAINTENANCE", "NONE", "TERMINATE_ON_HOST_MAINTENANCE", "NONE"]
    w.start()
    try:
        assert wait_for(
            lambda: any(
                p == "instance/maintenance-event" and q.get("wait_for_change")
                for p, q, _ in client.asked
            )
        )
        for n, value in enumerate(values, 1):
            md.set_maintenance(value)
            assert wait_for(
                lambda n=n: len([e for e in events(sink) if e.event == "maintenance"]) == n  # type: ignore[misc]
            ), f"change {n} ({value}) not reported: the watcher died?"
        assert all(t.is_alive() for t in w._threads), "every watcher thread lives on"
    finally:
        w.stop()
    got = [e.get("event") for e in events(sink) if e.event == "maintenance"]
    assert got == values
    journal = [ln for ln in out.getvalue().splitlines() if "event='maintenance'" in ln]
    assert [ln.split("event_='")[1].split("'")[0] for ln in journal] == values
    assert all("level='warning'" in ln for ln in journal)


@pytest.mark.process
def test_a_hanging_metadata_server_never_blocks_the_reader(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    w, _, _ = make(tmp_path, md, request_timeout="0.4s", poll_timeout="30s")
    assert w.refresh_once()
    md.set_mode("hang")
    w.start()
    try:
        assert wait_for(lambda: md.count("/instance/id") >= 2)  # the refresh thread is stuck
        # A read that waited on the network would cost at least request_timeout (0.4 s): 1000
        # of them at least 400 s. The bound is that contrast, not this machine's speed.
        t0 = time.monotonic()
        for _ in range(1000):
            _ = (w.instance, w.disarm_requested, w.preempted)
        assert time.monotonic() - t0 < 40  # what the tick reads never waits on the network
    finally:
        w.stop(timeout=5.0)
        md.set_mode("ok")
    assert w.instance is not None


@pytest.mark.process
def test_stop_cuts_long_polls_in_flight(tmp_path: Path, md: FakeMetadataServer) -> None:
    w, _, client = make(tmp_path, md, poll_timeout="30s")
    w.start()
    try:
        assert wait_for(lambda: sum(1 for _, q, _ in client.asked if q.get("wait_for_change")) >= 2)
    finally:
        t1 = time.monotonic()
        w.stop(timeout=10.0)
        stopped_in = time.monotonic() - t1
    # Both 30 s long polls are cut (socket shutdown), not waited out.
    assert stopped_in < 1.5, stopped_in
    assert not w._threads


class SameEtagClient:
    """A server that ignores wait_for_change and answers at once with the same ETag."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def get(self, path: str, params: dict[str, str] | None, timeout: float) -> MdResponse:
        with self.lock:
            self.calls += 1
        if path.startswith("instance/preempted"):
            return MdResponse(200, "FALSE", "e1")
        raise MetadataError("not served here")

    def abort(self) -> None:
        pass


@pytest.mark.process
def test_a_server_ignoring_wait_for_change_is_not_hammered(tmp_path: Path) -> None:
    cfg = cfgmod.from_dict({"agent": {"state_dir": str(tmp_path)}})
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=SYNTH_KEY)
    client = SameEtagClient()
    w = MetadataWatcher.from_config(cfg, em, client=client)
    t = threading.Thread(target=w._watch, args=("instance/preempted", w._on_pre), daemon=True)
    t.start()
    stop_at = time.monotonic() + 1.5
    wait_for(lambda: time.monotonic() >= stop_at, timeout=2.0)
    w._stop.set()
    t.join(3)
    assert not t.is_alive()
    assert client.calls <= 3  # one read + at most one poll per MIN_POLL_GAP_S (1 s)


# -- faults requested through metadata ---------------------------------------------------------


class RecordingApplier:
    """Stands in for SystemdFaultApplier: records the requests it was asked to apply."""

    def __init__(self, fail: str | None = None) -> None:
        self.applied: list[FaultRequest] = []
        self.fail = fail

    def __call__(self, req: FaultRequest) -> str | None:
        self.applied.append(req)
        return self.fail


FAULT = '{"id": "wedge-1", "cut": "metadata+egress443", "ttl": "15m"}'


@pytest.mark.process
def test_fault_requests_are_ignored_unless_enabled(tmp_path: Path, md: FakeMetadataServer) -> None:
    md.set_attribute("gce-watchdog-fault", FAULT)
    w, sink, client = make(tmp_path, md)
    rec = RecordingApplier()
    w.apply_fault = rec
    w.start()
    try:
        assert wait_for(lambda: w.refreshes >= 1)
        w.on_fault_value(FAULT)  # even handed the value, a disabled watcher applies nothing
    finally:
        w.stop()
    assert rec.applied == []
    assert not any(p.endswith("gce-watchdog-fault") for p, _, _ in client.asked)  # never read
    refused = [e for e in events(sink) if e.event == "fault"]
    assert [(e.get("op"), e.get("why"), e.get("req")) for e in refused] == [
        ("refused", "disabled", "wedge-1")
    ]


@pytest.mark.process
def test_a_fault_set_later_is_applied_once_through_the_long_poll(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    w, sink, _ = make(tmp_path, md, faults_from_metadata=True)
    rec = RecordingApplier()
    w.apply_fault = rec
    w.start()
    try:
        assert wait_for(lambda: md.count("instance/attributes/") >= 1)
        md.set_attribute("gce-watchdog-fault", FAULT)  # added while the watcher waits
        assert wait_for(lambda: len(rec.applied) == 1)
        req = rec.applied[0]
        assert (req.id, req.cut.label, req.ttl) == ("wedge-1", "metadata+egress443", 900.0)
        # The key stays set, an unrelated attribute changes: nothing is applied again.
        md.set_attribute("other", "x")
        md.set_attribute("gce-watchdog-fault", FAULT.replace("15m", "16m"))  # same id
        assert wait_for(lambda: md.count("gce-watchdog-fault") >= 3)
        md.set_attribute("gce-watchdog-fault", FAULT.replace("wedge-1", "flap-1"))
        assert wait_for(lambda: len(rec.applied) == 2)
    finally:
        w.stop()
    assert [r.id for r in rec.applied] == ["wedge-1", "flap-1"]
    assert [e for e in events(sink) if e.event == "fault"] == []  # fault inject writes those


@pytest.mark.process
def test_an_applied_request_survives_a_restart_and_is_not_reapplied(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    w, _, _ = make(tmp_path, md, faults_from_metadata=True)
    assert w.refresh_once() and w.trust.trusted  # the sim's account cannot write metadata
    rec = RecordingApplier()
    w.apply_fault = rec
    w.on_fault_value(FAULT)
    assert len(rec.applied) == 1
    w2, _, _ = make(tmp_path, md, faults_from_metadata=True)  # the agent restarted (same state)
    assert w2.refresh_once()
    rec2 = RecordingApplier()
    w2.apply_fault = rec2
    w2.on_fault_value(FAULT)
    assert rec2.applied == []
    assert load_applied(tmp_path) == ["wedge-1"]


@pytest.mark.process
def test_a_failed_or_invalid_request_is_said_on_the_console(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    w, sink, _ = make(tmp_path, md, faults_from_metadata=True)
    assert w.refresh_once() and w.trust.trusted
    w.apply_fault = RecordingApplier(fail="rc=1: iptables: not found")
    w.on_fault_value(FAULT)
    w.on_fault_value('{"id": "x", "cut": "ssh", "ttl": "1m"}')
    got = [(e.get("op"), e.get("req"), e.get("why")) for e in events(sink) if e.event == "fault"]
    assert got == [("refused", "wedge-1", "apply_failed"), ("refused", "x", "invalid")]


@pytest.mark.pure
def test_the_applier_runs_fault_inject_in_a_transient_unit_under_systemd() -> None:
    ran: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str]:
        ran.append(argv)
        return 0, ""

    req = parse_request(FAULT)
    a = SystemdFaultApplier("/etc/gce-watchdog/config.toml", ["gcewd"], run, lambda: True)
    assert a(req) is None
    argv = ran[0]
    assert argv[0] == "systemd-run" and "--unit=gcewd-fault-md-wedge-1" in argv
    inner = argv[argv.index("--") + 1 :]
    assert inner == [
        "gcewd", "fault", "inject", "--metadata", "--egress443", "--ttl", "900s",
        "--config", "/etc/gce-watchdog/config.toml",
    ]  # fmt: skip
    direct = SystemdFaultApplier(None, ["gcewd"], run, lambda: False)
    assert direct.argv(req) == ["gcewd", "fault", "inject", "--metadata", "--egress443",
                                "--ttl", "900s"]  # fmt: skip
    failing = SystemdFaultApplier(None, ["gcewd"], lambda argv: (1, "boom\n"), lambda: False)
    assert failing(req) == "rc=1: boom"
