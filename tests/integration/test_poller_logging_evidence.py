"""Issue 24 item 2: the serial-port log in Cloud Logging as evidence for a VM that ended unread.

The real poller against the faithful fake Compute API (serial output only while RUNNING) and the
fake Cloud Logging API (``testing/simlogging.py``), on one simulated clock.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
from gce_watchdog.poller.cloudlogging import (
    LoggingClient,
    create_logging_client,
    decode_payload,
    serial_filter,
)
from gce_watchdog.poller.poller import LOG_TRIES, Poller
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.verdict import VerdictKind
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.simlogging import FakeLoggingAPI
from gce_watchdog.testing.synth import Writer
from gce_watchdog.wire.protocol import LineKey

P, Z = "test-project", "us-central1-a"
T0 = 1_800_000_000.0
K = VerdictKind


@pytest.fixture
def now() -> list[float]:
    return [T0]


@pytest.fixture
def api(now: list[float]) -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", clock=lambda: now[0], serial_needs_running=True) as a:
        yield a


@pytest.fixture
def logs() -> Iterator[FakeLoggingAPI]:
    fake = FakeLoggingAPI(token="tok").start()
    yield fake
    fake.close()


def make_poller(
    api: FakeComputeAPI, logs: FakeLoggingAPI | None, now: list[float]
) -> tuple[Poller, LoggingClient | None]:
    from google.oauth2.credentials import Credentials

    creds = Credentials("tok")  # type: ignore[no-untyped-call]
    client = ComputeClient.create(
        creds, api_base=api.base_url, retry=ComputeRetry(attempts=1, sleep=lambda s: None)
    )
    lc = None if logs is None else create_logging_client(creds, logs.base_url)
    return Poller(client, CursorStore(None), P, Z, None, clock=lambda: now[0], logging=lc), lc


def ended_after_last_read(
    api: FakeComputeAPI, now: list[float], poller: Poller
) -> tuple[Writer, str]:
    """A VM read while RUNNING up to its workload phase; its final line (if any) is written after
    that read, then the guest powers off before the next poll (it never reaches the API)."""
    inst = api.add_instance("vm-1", project=P, zone=Z)
    w = Writer(ts_ms=int(now[0] * 1000))
    api.append_serial("vm-1", w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"}))
    first = poller.poll("vm-1")
    # a first read: its age is not known (docs/poller.md, "Freshness")
    assert first.verdict is not None and first.verdict.kind is K.UNKNOWN, first.verdict
    now[0] += 20
    api.guest_shutdown("vm-1")
    now[0] += 10  # TERMINATED: the final line is not served any more
    return w, inst.id


def log_line(line: bytes, how: str) -> str:
    """One serial line as the export shows it (GoogleCloudPlatform/khi's field set test)."""
    text = line.rstrip(b"\n").decode()
    if how == "crlf":
        return text + "\\r\\n"  # a literal backslash-r backslash-n, not a CR LF
    if how == "journald":
        return "Dec 01 19:43:13 vm-1 gce-watchdog[812]: " + text + "\\r\\n"
    return text


@pytest.mark.process
@pytest.mark.parametrize("how", ["plain", "crlf", "journald"])
def test_a_finished_job_whose_last_line_is_only_in_the_log_is_workload_ok(
    api: FakeComputeAPI, logs: FakeLoggingAPI, now: list[float], how: str
) -> None:
    p, lc = make_poller(api, logs, now)
    w = Writer(ts_ms=int(now[0] * 1000))
    inst = api.add_instance("vm-1", project=P, zone=Z)
    early = w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"})
    api.append_serial("vm-1", early)
    assert p.poll("vm-1").verdict.kind is K.UNKNOWN  # type: ignore[union-attr]  # a first read
    final = w.line("exit", {"rc": "0"})
    for i, line in enumerate([*early.splitlines(keepends=True), final]):
        logs.add_serial(P, inst.id, log_line(line, how), T0 + i)
    api.guest_shutdown("vm-1")
    now[0] += 30
    out = p.poll("vm-1")
    assert out.verdict is not None and out.verdict.kind is K.WORKLOAD_OK, out.verdict
    assert "cloud_logging=line" in out.verdict.evidence
    assert out.action == "none"
    (call,) = logs.calls
    assert call.status == 200 and inst.id in call.body["filter"]
    assert call.body["resourceNames"] == [f"projects/{P}"]
    assert lc is not None
    lc.close()


@pytest.mark.process
def test_a_log_with_nothing_after_the_last_read_is_ended_unread(
    api: FakeComputeAPI, logs: FakeLoggingAPI, now: list[float]
) -> None:
    p, _ = make_poller(api, logs, now)
    w, iid = ended_after_last_read(api, now, p)
    logs.add_serial(P, iid, "[  OK  ] Reached target Power-Off.", now[0] - 15)
    logs.add_serial(P, "999", log_line(w.line("exit", {"rc": "0"}), "plain"), now[0])  # not ours
    outs = [p.poll("vm-1") for _ in range(LOG_TRIES + 2)]
    for out in outs:
        assert out.verdict is not None and out.verdict.kind is K.ENDED_UNREAD, out.verdict
        assert out.verdict.alarm and out.action == "none"
    assert "cloud_logging=none" in outs[0].verdict.evidence  # type: ignore[union-attr]
    assert len(logs.calls) == LOG_TRIES  # bounded: the request budget, then no more reads


@pytest.mark.process
@pytest.mark.parametrize("status", [403, 404, 500])
def test_a_refusal_from_logging_is_no_guess_never_a_failover(
    api: FakeComputeAPI, logs: FakeLoggingAPI, now: list[float], status: int
) -> None:
    p, _ = make_poller(api, logs, now)
    w, iid = ended_after_last_read(api, now, p)
    logs.add_serial(P, iid, log_line(w.line("exit", {"rc": "0"}), "plain"), now[0] - 5)
    logs.set_status(status)
    out = p.poll("vm-1")
    assert out.verdict is not None and out.verdict.kind is K.ENDED_UNREAD, out.verdict
    assert not out.verdict.failover and out.error is None
    assert f"cloud_logging=error({status})" in out.verdict.evidence
    logs.set_status(None)  # permission granted later: the next poll reads the line
    assert p.poll("vm-1").verdict.kind is K.WORKLOAD_OK  # type: ignore[union-attr]


@pytest.mark.process
def test_without_the_flag_logging_is_never_called(
    api: FakeComputeAPI, logs: FakeLoggingAPI, now: list[float]
) -> None:
    p, _ = make_poller(api, None, now)
    w, iid = ended_after_last_read(api, now, p)
    logs.add_serial(P, iid, log_line(w.line("exit", {"rc": "0"}), "plain"), now[0] - 5)
    assert p.poll("vm-1").verdict.kind is K.ENDED_UNREAD  # type: ignore[union-attr]
    assert not logs.calls


@pytest.mark.process
def test_a_forged_line_in_the_log_decides_nothing(
    api: FakeComputeAPI, logs: FakeLoggingAPI, now: list[float]
) -> None:
    """Anyone who can write to the console writes to the export too: the line must be signed."""
    p, _ = make_poller(api, logs, now)
    w, iid = ended_after_last_read(api, now, p)
    forger = Writer(boot=w.boot, key=LineKey(b"k" * 32), announce=False, seq=w.seq, ts_ms=w.ts_ms)
    logs.add_serial(P, iid, log_line(forger.line("exit", {"rc": "0"}), "plain"), now[0] - 5)
    out = p.poll("vm-1")
    assert out.verdict is not None and out.verdict.kind is K.ENDED_UNREAD, out.verdict


@pytest.mark.pure
def test_decode_payload_undoes_the_exports_escapes() -> None:
    assert decode_payload("abc\\r\\n") == b"abc\n"
    assert decode_payload("a\\x1b[0mb") == b"a\x1b[0mb\n"
    assert decode_payload("back\\\\slash") == b"back\\slash\n"
    assert decode_payload("plain") == b"plain\n"


@pytest.mark.pure
def test_the_filter_names_the_serial_log_and_the_instance() -> None:
    f = serial_filter("p-1", "123", T0)
    assert 'logName="projects/p-1/logs/serialconsole.googleapis.com%2Fserial_port_1_output"' in f
    assert 'resource.labels.instance_id="123"' in f and 'timestamp>="2027-' in f


@pytest.mark.process
def test_paging_is_followed_within_the_budget(logs: FakeLoggingAPI) -> None:
    from google.oauth2.credentials import Credentials

    creds = Credentials("tok")  # type: ignore[no-untyped-call]
    lc = create_logging_client(creds, logs.base_url, max_pages=2)
    for i in range(1500):
        logs.add_serial(P, "7", f"line {i}", T0 + i)
    data = lc.serial_lines(P, "7", None)
    assert data.count(b"\n") == 1500 and data.startswith(b"line 0\n")
    assert [c.body.get("pageToken") for c in logs.calls] == [None, "1000"]
    lc.close()


@pytest.mark.process
def test_a_long_log_is_read_from_its_end(logs: FakeLoggingAPI) -> None:
    """More entries than the pages allowed: the newest are read (the final line is there)."""
    from google.oauth2.credentials import Credentials

    creds = Credentials("tok")  # type: ignore[no-untyped-call]
    lc = create_logging_client(creds, logs.base_url, max_pages=1)
    for i in range(2500):
        logs.add_serial(P, "7", f"line {i}", T0 + i)
    data = lc.serial_lines(P, "7", None)
    assert data.endswith(b"line 2499\n") and data.startswith(b"line 1500\n")
    lc.close()
