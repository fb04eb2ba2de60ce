"""The incremental reader and the poller against the fake Compute API (a real HTTP server)."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.lib.compute import AuthError, ComputeClient, ComputeRetry, GaveUpError
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.poller import Poller
from gce_watchdog.poller.reader import CursorStore, SerialReader
from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.poller.verdict import Policy, VerdictKind
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault
from gce_watchdog.testing.synth import KERNEL_MSG, Writer
from google.oauth2.credentials import Credentials

P, Z = "test-project", "us-central1-a"


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", hang_s=5.0) as a:
        a.add_instance("vm-1", project=P, zone=Z)
        yield a


class Sleeps:
    """Records retry waits instead of sleeping (tests never wait)."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, s: float) -> None:
        self.waits.append(s)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


# The wall clock the client sees: 50 s into a minute (a rate limit without Retry-After waits 10 s).
WALL = 1_800_000_050.0


def make_client(
    api: FakeComputeAPI, sleeps: Sleeps, token: str = "tok", attempts: int = 3
) -> ComputeClient:
    return ComputeClient.create(
        Credentials(token),
        api.base_url,
        timeout=(2.0, 0.5),
        retry=ComputeRetry(attempts=attempts, sleep=sleeps, wall=lambda: WALL),
    )


def console_bytes(rng: random.Random, w: Writer, n_lines: int) -> bytes:
    out = bytearray()
    for i in range(n_lines):
        if rng.random() < 0.2:
            out += w.line("heartbeat", {"rung": "0/10", "ph": "workload", "ticks": i})
        else:
            out += b"[%8.6f] kernel: something happened %d\r\n" % (rng.random() * 100, i)
    return bytes(out)


@pytest.mark.process
def test_steady_state_fetches_every_byte_exactly_once(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    rng = random.Random(1)
    w = Writer()
    reader = SerialReader(make_client(api, sleeps), CursorStore(tmp_path))
    everything = bytearray()
    fetched = new = 0
    for _ in range(60):
        blob = console_bytes(rng, w, rng.randrange(0, 30))
        cut = rng.randrange(len(blob) + 1)  # writes land mid-line too
        for part in (blob[:cut], blob[cut:]):
            api.append_serial("vm-1", part)
            everything += part
            r = reader.read(P, Z, "vm-1")
            assert r.fetched == r.new == len(part)  # nothing fetched twice
            fetched += r.fetched
            new += r.new
    idle = reader.read(P, Z, "vm-1")
    assert (idle.fetched, idle.new) == (0, 0)
    assert fetched == new == len(everything)
    cur = reader.cursor(P, Z, "vm-1")
    assert cur.fetched_bytes == cur.new_bytes == len(everything)
    assert cur.offset == len(everything)
    assert cur.timeline.events[-64:] == parse_bytes(bytes(everything)).events[-64:]
    assert cur.timeline.lost_lines == 0 and cur.timeline.rejected == 0


@pytest.mark.process
def test_line_split_across_reads_and_a_restart_is_decoded_once(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    w = Writer()
    line = w.line("phase", {"ph": "workload"})
    api.append_serial("vm-1", b"boot noise\n" + line[:30])
    r1 = SerialReader(make_client(api, sleeps), CursorStore(tmp_path))
    assert r1.read(P, Z, "vm-1").new_events == 0
    saved = json.loads((tmp_path / f"{P}.{Z}.vm-1.json").read_text())
    assert saved["offset"] == 11 + 30 and saved["pending"]  # the partial line is persisted
    # a new process: new store, new client
    api.append_serial("vm-1", line[30:] + line)  # and a duplicate of the same line
    r2 = SerialReader(make_client(api, sleeps), CursorStore(tmp_path))
    res = r2.read(P, Z, "vm-1")
    assert res.new_events == 3  # the boot's two key announcements and the phase line
    assert res.fetched == len(line) - 30 + len(line)
    tl = r2.cursor(P, Z, "vm-1").timeline
    assert [e.event for e in tl.events] == ["key", "key", "phase"]
    assert tl.duplicates == 3


@pytest.mark.process
def test_restart_resumes_from_next_with_the_same_accounting(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    w = Writer()
    api.append_serial("vm-1", w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"}))
    w.event("tick", {"rung": "1/10"})  # seq 2 never reaches the console
    api.append_serial("vm-1", w.line("tick", {"rung": "2/10"}))
    SerialReader(make_client(api, sleeps), CursorStore(tmp_path)).read(P, Z, "vm-1")
    last = w.line("tick", {"rung": "3/10"})
    api.append_serial("vm-1", last)
    r = SerialReader(make_client(api, sleeps), CursorStore(tmp_path))
    res = r.read(P, Z, "vm-1")
    assert res.fetched == res.new == len(last)  # resumed at `next`: only the new line
    tl = r.cursor(P, Z, "vm-1").timeline
    assert [e.seq for e in tl.events] == [0, 1, 2, 3, 5, 6]  # 0, 1: the key announcement
    assert tl.lost_lines == 1 and tl.boots["3f2a9c1e"].count == 6


@pytest.mark.process
def test_a_read_that_brings_nothing_does_not_rewrite_the_cursor_file(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    w = Writer()
    api.append_serial("vm-1", w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"}))
    path = tmp_path / f"{P}.{Z}.vm-1.json"
    SerialReader(make_client(api, sleeps), CursorStore(tmp_path)).read(P, Z, "vm-1")
    written = path.stat().st_ino  # every write is a rename onto the name: a new inode
    for _ in range(2):  # a restarted reader too: the file as read is what it compares with
        r = SerialReader(make_client(api, sleeps), CursorStore(tmp_path))
        assert r.read(P, Z, "vm-1").fetched == 0
        assert path.stat().st_ino == written
        assert json.loads(path.read_text())["reads"] == 1
    api.append_serial("vm-1", w.line("tick", {"rung": "1/10"}))
    r.read(P, Z, "vm-1")
    assert path.stat().st_ino != written
    saved = json.loads(path.read_text())
    assert saved["reads"] == 3  # 1, the last reader's empty read (not the other's), this one
    assert saved["offset"] == r.cursor(P, Z, "vm-1").offset


@pytest.mark.process
def test_byte_gap_is_counted_and_a_cut_line_is_rejected_not_misread(
    sleeps: Sleeps, tmp_path: Path
) -> None:
    with FakeComputeAPI(token="tok", window=1000) as api:
        api.add_instance("vm-1", project=P, zone=Z)
        w = Writer()
        first = w.line("start", {"v": "1"})  # with the boot's key announcement before it
        line = w.line("phase", {"ph": "workload"})
        api.append_serial("vm-1", first + b"x" * 100 + b"\n" + line[:20])
        at = len(first) + 121
        reader = SerialReader(make_client(api, sleeps), CursorStore(tmp_path))
        reader.read(P, Z, "vm-1")
        tick = w.line("tick", {"rung": "1/10"})
        api.append_serial("vm-1", line[20:] + b"y" * 2999 + b"\n" + tick)
        res = reader.read(P, Z, "vm-1")
        total = api.instance("vm-1").total
        assert res.lost == total - 1000 - at  # everything between our offset and the window
        assert res.fetched == 1000 and res.new == total - at
        tl = reader.cursor(P, Z, "vm-1").timeline
        assert tl.lost_bytes == res.lost and len(tl.byte_gaps) == 1
        assert [e.event for e in tl.events] == ["key", "key", "start", "tick"]
        assert tl.rejected == 1  # the held half line, decoded alone


@pytest.mark.process
def test_buffer_reset_and_new_instance_under_the_same_name(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    w = Writer()
    api.append_serial("vm-1", w.line("start", {"v": "1"}) * 3)
    reader = SerialReader(make_client(api, sleeps), CursorStore(tmp_path))
    first_id = api.instance("vm-1").id
    reader.read(P, Z, "vm-1", first_id)
    api.reset_serial("vm-1")
    api.append_serial("vm-1", b"short\n")
    res = reader.read(P, Z, "vm-1", first_id)
    assert res.reset and res.fetched == 6
    assert reader.cursor(P, Z, "vm-1").timeline.resets == 1
    # recreated under the same name: a new id means a fresh cursor
    api.add_instance("vm-1", project=P, zone=Z)
    api.append_serial("vm-1", b"new instance\n")
    res = reader.read(P, Z, "vm-1", api.instance("vm-1").id)
    cur = reader.cursor(P, Z, "vm-1")
    assert cur.instance_id != first_id and cur.offset == 13 and cur.timeline.events == []


@pytest.mark.process
def test_rate_limit_backs_off_then_succeeds(api: FakeComputeAPI, sleeps: Sleeps) -> None:
    api.append_serial("vm-1", b"hello\n")
    api.set_fault("serial", Fault.RATE_LIMIT, count=2)
    client = make_client(api, sleeps, attempts=5)
    chunk = client.serial_port_output(P, Z, "vm-1", 0)
    assert chunk.contents == b"hello\n"
    assert [c.status for c in api.calls_to("serial")] == [403, 403, 200]  # GCE's rate limit
    assert len(sleeps.waits) == 2 and all(0 <= s <= 30 for s in sleeps.waits)


# No header: the start of the next minute, when GCE refills the quota (WALL is 50 s into one).
@pytest.mark.process
@pytest.mark.parametrize(("header", "want"), [("7", 7.0), ("600", 30.0), (None, 10.0)])
def test_rate_limit_honours_retry_after_capped_at_one_poll(
    api: FakeComputeAPI, sleeps: Sleeps, header: str | None, want: float
) -> None:
    api.append_serial("vm-1", b"hello\n")
    api.retry_after = header
    api.set_fault("serial", Fault.RATE_LIMIT, count=2)
    chunk = make_client(api, sleeps, attempts=5).serial_port_output(P, Z, "vm-1", 0)
    assert chunk.contents == b"hello\n" and len(sleeps.waits) == 2
    # at least what the server asked (or the next minute), never more than one poll interval
    assert sleeps.waits == [want, want]


@pytest.mark.process
def test_gives_up_after_n_attempts_with_the_last_error(api: FakeComputeAPI, sleeps: Sleeps) -> None:
    api.set_fault("serial", Fault.RATE_LIMIT)
    client = make_client(api, sleeps, attempts=3)
    with pytest.raises(GaveUpError) as ei:
        client.serial_port_output(P, Z, "vm-1", 0)
    msg = str(ei.value)
    assert "gave up after 3 attempts, last error:" in msg
    assert "HTTP 403 rateLimitExceeded" in msg
    assert len(api.calls_to("serial")) == 3


@pytest.mark.process
def test_hanging_api_times_out_within_bounds(api: FakeComputeAPI, sleeps: Sleeps) -> None:
    api.set_fault("get", Fault.HANG)
    client = make_client(api, sleeps, attempts=2)
    t0 = time.monotonic()
    with pytest.raises(GaveUpError, match="timed out"):
        client.get_instance(P, Z, "vm-1")
    assert time.monotonic() - t0 < 4  # 2 attempts x 0.5 s read timeout, no real sleeps


@pytest.mark.process
def test_bad_token_and_refusal_are_auth_errors_not_retried(
    api: FakeComputeAPI, sleeps: Sleeps
) -> None:
    with pytest.raises(AuthError):
        make_client(api, sleeps, token="wrong").get_instance(P, Z, "vm-1")
    api.set_fault("get", Fault.REFUSE, count=1)
    with pytest.raises(AuthError, match="403 forbidden"):
        make_client(api, sleeps).get_instance(P, Z, "vm-1")
    assert sleeps.waits == []
    assert make_client(api, sleeps).get_instance(P, Z, "nope") is None


@pytest.mark.process
def test_corrupt_cursor_starts_fresh_and_is_reported(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    (tmp_path / f"{P}.{Z}.vm-1.json").write_text("{not json")
    api.append_serial("vm-1", b"abc\n")
    store = CursorStore(tmp_path)
    SerialReader(make_client(api, sleeps), store).read(P, Z, "vm-1")
    assert store.corrupt == [f"{P}/{Z}/vm-1"]
    assert json.loads((tmp_path / f"{P}.{Z}.vm-1.json").read_text())["offset"] == 4


# -- the poller: verdicts, exactly-once, reaping ----------------------------------------------


def make_poller(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path, now: float, **kw: object
) -> Poller:
    ledger = open_ledger(tmp_path / "ledger.sqlite")
    return Poller(
        make_client(api, sleeps),
        CursorStore(tmp_path / "cursors"),
        P,
        Z,
        ledger,
        Policy(),
        clock=lambda: now,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.process
def test_failover_once_then_already_decided_and_reaped_once(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    w = Writer()
    api.append_serial("vm-1", w.line("phase", {"ph": "workload"}) + b"[  9.1] eth0: link down\n")
    now = w.ts_ms / 1000
    p1 = make_poller(api, sleeps, tmp_path, now, reap=True)
    # a first read with no record: the line's age is not known (docs/poller.md, "Freshness")
    assert p1.poll("vm-1").verdict.kind is VerdictKind.UNKNOWN  # type: ignore[union-attr]
    api.append_serial("vm-1", w.line("shutdown", {"reason": "ladder", "rung": "10/10"}))
    api.set_fault("delete", Fault.REFUSE, count=1)  # the first delete is refused
    o1 = p1.poll("vm-1")
    assert o1.action == "failover" and o1.decision is not None and o1.decision.won
    assert o1.reap_error and "403" in o1.reap_error and o1.reaped is None
    # a second poller process (own cursors) sees the same shutdown: already decided
    p2 = Poller(
        make_client(api, sleeps),
        CursorStore(tmp_path / "other"),
        P,
        Z,
        open_ledger(tmp_path / "ledger.sqlite"),
        Policy(),
        reap=True,
        clock=lambda: now,
    )
    o2 = p2.poll("vm-1")
    assert o2.action == "already_decided"
    assert o2.decision is not None and o2.decision.token == o1.decision.token
    assert o2.reaped and o2.reaped.startswith("operation-")  # it finished the reap
    deletes = api.calls_to("delete")
    assert [c.status for c in deletes] == [403, 200]
    assert {c.query["requestId"] for c in deletes} == {o1.decision.request_id}
    o3 = p1.poll("vm-1")  # the instance is gone now; nothing more happens
    assert o3.status == "MISSING" and o3.action == "already_decided"
    assert len(api.calls_to("delete")) == 2


@pytest.mark.process
def test_api_outage_gives_no_verdict_and_no_decision(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    w = Writer()
    api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
    p = make_poller(api, sleeps, tmp_path, w.ts_ms / 1000)
    p.poll("vm-1")
    p.clock = lambda: w.ts_ms / 1000 + 3600  # an hour later the API is down
    api.set_fault("serial", Fault.SERVER_ERROR)
    out = p.poll("vm-1")
    assert out.verdict is None and out.error and "gave up after 3 attempts" in out.error
    assert out.action == "error"
    assert p.ledger is not None and p.ledger.decisions.all() == []
    api.set_fault("serial", None)  # back: now the silence is real
    assert p.poll("vm-1").verdict.kind is VerdictKind.SUSPECTED_WEDGE  # type: ignore[union-attr]


@pytest.mark.process
def test_spot_vm_terminated_without_a_line_is_preempted_only_on_evidence(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    # Issue 24: a Spot VM off without a terminal line is no longer "presumed preempted"; the
    # zone operation compute.instances.preempted decides, and without it the verdict is the
    # ended_unread alarm, no failover.
    api.add_instance("spot-1", project=P, zone=Z, spot=True, status="RUNNING")
    api.add_instance("spot-0", project=P, zone=Z, spot=True, status="RUNNING")
    w = Writer()
    for name in ("spot-1", "spot-0"):
        api.append_serial(name, w.line("phase", {"ph": "workload"}) + KERNEL_MSG + b"\n")
    api.preempt("spot-1")
    api.guest_shutdown("spot-0")
    p = make_poller(api, sleeps, tmp_path, w.ts_ms / 1000)
    out = p.poll("spot-1")
    assert out.verdict is not None and out.verdict.kind is VerdictKind.PREEMPTED
    assert out.action == "failover"
    other = p.poll("spot-0")
    assert other.verdict is not None and other.verdict.kind is VerdictKind.ENDED_UNREAD
    assert other.action == "none" and other.to_json()["alarm"] is True


@pytest.mark.process
def test_an_off_vm_whose_serial_port_cannot_be_read_still_gets_its_verdict(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path
) -> None:
    # GCE answers getSerialPortOutput with errors once the VM is off; the verdict must then come
    # from what was read while it ran, not turn into an endless "error" with no decision.
    api.add_instance("spot-2", project=P, zone=Z, spot=True, status="RUNNING")
    w = Writer()
    api.append_serial("spot-2", w.line("phase", {"ph": "workload"}))
    p = make_poller(api, sleeps, tmp_path, w.ts_ms / 1000)
    assert p.poll("spot-2").verdict.kind is VerdictKind.UNKNOWN  # type: ignore[union-attr]
    api.preempt("spot-2")  # (issue 24: the preemption is evidence, no longer presumed)
    api.set_fault("serial", Fault.SERVER_ERROR)
    out = p.poll("spot-2")
    assert out.verdict is not None and out.verdict.kind is VerdictKind.PREEMPTED
    assert out.action == "failover" and out.error is None


@pytest.mark.process
def test_poll_parse_and_report_give_one_verdict_for_the_same_bytes_and_times(
    api: FakeComputeAPI, sleeps: Sleeps, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 15, item 7: one verdict function, one clock rule. The poller receives the bytes at
    rx on its own clock; parse and report, told the same receive time and now, agree with it,
    whatever the guest's clock said (here: a year fast)."""
    from gce_watchdog.cli import main

    w = Writer(boot="aaaa0001", ts_ms=int((time.time() + 365 * 86400) * 1000))
    data = w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"})
    rx = 1_800_000_000.0
    clock = [rx - 30]
    poller = Poller(make_client(api, sleeps), CursorStore(tmp_path), P, Z, clock=lambda: clock[0])
    # the poller read the port before the lines came: it received them new, at rx (a first
    # read alone would not tell their age: docs/poller.md, "Freshness")
    assert poller.poll("vm-1").verdict.kind is VerdictKind.UNKNOWN  # type: ignore[union-attr]
    api.append_serial("vm-1", data)
    clock[0] = rx
    assert poller.poll("vm-1").verdict.kind is VerdictKind.HEALTHY  # type: ignore[union-attr]
    dump = tmp_path / "dump.log"
    dump.write_bytes(data)
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rx))
    for dt in (600.0, 901.0):  # silent 10 min (healthy), then past the drain timeout (wedge)
        clock[0] = rx + dt
        polled = poller.poll("vm-1").verdict
        assert polled is not None
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rx + dt))
        got = []
        for cmd in ("parse", "report"):
            args = [cmd, str(dump), "--json", "--status", "RUNNING", "--received", iso]
            assert main([*args, "--now", now]) == 0
            got.append(json.loads(capsys.readouterr().out)["verdict"]["kind"])
        assert got == [polled.kind.value] * 2, (dt, got, polled)
    assert polled.kind is VerdictKind.SUSPECTED_WEDGE


@pytest.mark.pure
def test_a_cursor_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "cursors"
    d.mkdir(mode=0o700)
    CursorStore(d)  # ours: trusted
    if os.geteuid() == 0:  # root can give it away; any other user is "another user" to root
        os.chown(d, 4242, -1)
        owner, euid = 4242, None
    else:  # an unprivileged user cannot: the store is asked as if it ran as someone else
        owner, euid = os.geteuid(), os.geteuid() + 1
    with pytest.raises(OSError, match=rf"{d} is owned by uid {owner}, not by this user"):
        CursorStore(d, euid=euid)


@pytest.mark.pure
def test_the_cursor_dir_is_created_private(tmp_path: Path) -> None:
    d = tmp_path / "state" / "cursors"
    CursorStore(d)
    assert d.is_dir() and d.stat().st_mode & 0o777 == 0o700  # whatever the umask
