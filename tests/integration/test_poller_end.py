"""Issue 24 items 2-4 on the poller side: evidence before a verdict, the alarms, reap every end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
from gce_watchdog.poller.ledgers import Ledger, open_ledger
from gce_watchdog.poller.poller import Poller, end_request_id
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.verdict import (
    INSTANCE_STATUSES,
    InstanceState,
    Policy,
    VerdictKind,
    decide,
)
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault
from gce_watchdog.testing.synth import Writer
from gce_watchdog.wire.protocol import make_event
from hypothesis import given
from hypothesis import strategies as st

P, Z = "test-project", "us-central1-a"
T0 = 1_800_000_000.0
K = VerdictKind


def ev(name: str, seq: int, **fields: object) -> object:
    return make_event(name, "b0000001", seq, int(T0 * 1000) + seq * 1000, fields)


def events(*items: tuple[str, dict[str, object]]) -> list:  # type: ignore[type-arg]
    return [ev(n, i + 1, **f) for i, (n, f) in enumerate(items)]


WORK: tuple[str, dict[str, object]] = ("phase", {"ph": "workload"})


@pytest.mark.pure
@pytest.mark.parametrize(
    ("lines", "want"),
    [
        ([WORK, ("exit", {"rc": "0", "result": "missing"})], K.WORKLOAD_UNVERIFIED),
        ([WORK, ("result", {"status": "ok"}), ("exit", {"rc": "0", "result": "reported"})],
         K.WORKLOAD_OK),
        ([WORK, ("exit", {"rc": "0"})], K.WORKLOAD_OK),  # not configured to report
        ([WORK, ("result", {"status": "fail"}), ("exit", {"rc": "0", "result": "reported"})],
         K.WORKLOAD_FAILED),
        ([WORK, ("exit", {"rc": "3", "result": "missing"})], K.WORKLOAD_FAILED),
    ],
)  # fmt: skip
def test_the_job_result_decides_an_exit(
    lines: list[tuple[str, dict[str, object]]], want: VerdictKind
) -> None:
    v = decide(events(*lines), InstanceState("TERMINATED"), T0 + 60, Policy(), received_s=T0)
    assert v.kind is want, v.reason
    assert not v.failover
    assert v.alarm is (want is K.WORKLOAD_UNVERIFIED)


@pytest.mark.pure
def test_policy_flags_turn_the_alarms_into_failovers() -> None:
    unverified = events(WORK, ("exit", {"rc": "0", "result": "missing"}))
    on = Policy(unverified_failover=True, ended_unread_failover=True)
    assert decide(unverified, InstanceState("RUNNING"), T0, on, received_s=T0).failover
    unread = events(WORK)
    off = InstanceState("TERMINATED", end_ops=("compute.instances.guestTerminate",))
    assert not decide(unread, off, T0, Policy(), received_s=T0).failover
    v = decide(unread, off, T0, on, received_s=T0)
    assert v.kind is K.ENDED_UNREAD and v.failover


NON_TERMINAL = st.sampled_from(
    [("phase", {"ph": "workload"}), ("phase", {"ph": "bootstrap"}), ("tick", {"rung": "3/10"}),
     ("heartbeat", {"ph": "workload"}), ("start", {"v": "1"}), ("stop", {}),
     ("end", {"reason": "done"})]
)  # fmt: skip
BENIGN_OPS = st.lists(
    st.sampled_from(
        ["compute.instances.guestTerminate", "stop", "delete", "setMetadata", "suspend"]
    )
)


@pytest.mark.pure
@given(
    st.lists(NON_TERMINAL, max_size=8),
    st.sampled_from([*sorted(INSTANCE_STATUSES - {"RUNNING"}), "MISSING", "SOMETHING_NEW"]),
    st.booleans(),
    st.one_of(st.none(), BENIGN_OPS),
    st.floats(0, 10**6),
)
def test_an_ended_vm_is_never_failed_over_on_a_guess(
    lines: list[tuple[str, dict[str, object]]],
    status: str,
    spot: bool,
    ops: list[str] | None,
    later: float,
) -> None:
    """Whatever was read (no terminal line), whatever the non-RUNNING status, however long the
    silence: without a preemption or host error recorded, the default policy never fails over."""
    state = InstanceState(status, spot, None if ops is None else tuple(ops))
    v = decide(events(*lines), state, T0 + later, Policy(), received_s=T0)
    assert not v.failover, v
    with_preemption = InstanceState(status, spot, (*(ops or ()), "compute.instances.preempted"))
    pv = decide(events(*lines), with_preemption, T0 + later, Policy(), received_s=T0)
    if status in {"TERMINATED", "STOPPED", "SUSPENDED", "MISSING"}:
        assert pv.kind is K.PREEMPTED and pv.failover


# -- the poller against the fake -----------------------------------------------------------------


@pytest.fixture
def now() -> list[float]:
    return [T0]


@pytest.fixture
def api(now: list[float]) -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(
        token="tok", clock=lambda: now[0], stop_delay_s=5.0, op_pending_s=2.0,
        serial_needs_running=True,
    ) as a:  # fmt: skip
        yield a


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with open_ledger(tmp_path / "ledger.sqlite", "t") as led:
        yield led


def poller(api: FakeComputeAPI, ledger: Ledger, now: list[float], **kw: object) -> Poller:
    from google.oauth2.credentials import Credentials

    creds = Credentials("tok")  # type: ignore[no-untyped-call]
    client = ComputeClient.create(
        creds, api_base=api.base_url, retry=ComputeRetry(attempts=1, sleep=lambda s: None)
    )
    return Poller(client, CursorStore(None), P, Z, ledger, clock=lambda: now[0], **kw)  # type: ignore[arg-type]


def finished(api: FakeComputeAPI, name: str, now: list[float], rc: str = "0") -> Writer:
    api.add_instance(name, project=P, zone=Z)
    w = Writer(ts_ms=int(now[0] * 1000))
    api.append_serial(name, w.line("phase", {"ph": "workload"}) + w.line("exit", {"rc": rc}))
    return w


@pytest.mark.process
def test_reap_of_an_end_waits_for_done(
    api: FakeComputeAPI, ledger: Ledger, now: list[float]
) -> None:
    finished(api, "vm-1", now)
    p = poller(api, ledger, now, reap=True)
    first = p.poll("vm-1")  # RUNNING, in its linger: read, decided, not reaped
    assert first.verdict is not None and first.verdict.kind is K.WORKLOAD_OK
    assert first.reaped is None and not api.calls_to("delete")
    api.guest_shutdown("vm-1")
    now[0] += 10  # TERMINATED now
    out = p.poll("vm-1")
    assert out.reaped is None and out.reap_pending  # the delete is PENDING: not recorded
    inst = api.instance("vm-1")
    assert not inst.deleted
    now[0] += 1
    assert p.poll("vm-1").reap_pending  # still PENDING (2 s), same requestId
    now[0] += 2
    done = p.poll("vm-1")
    assert done.reaped and done.reaped.startswith("operation-") and inst.deleted
    rids = {c.query["requestId"] for c in api.calls_to("delete")}
    assert rids == {end_request_id(inst.id, done.verdict.boot or "-")}
    assert ledger.decisions.all() == []  # nothing was decided: no ledger entry


@pytest.mark.process
def test_a_failed_delete_operation_is_an_error_never_reaped(
    api: FakeComputeAPI, ledger: Ledger, now: list[float]
) -> None:
    finished(api, "vm-1", now, rc="3")
    api.fail_next_operation(403, "PERMISSION_DENIED", "compute.instances.delete denied")
    p = poller(api, ledger, now, reap=True)
    p.poll("vm-1")  # read while RUNNING
    api.set_status("vm-1", "TERMINATED")
    out = p.poll("vm-1")
    assert out.reap_pending
    now[0] += 5
    out = p.poll("vm-1")
    assert out.verdict is not None and out.verdict.kind is K.WORKLOAD_FAILED
    assert out.reaped is None and out.reap_error and "PERMISSION_DENIED" in out.reap_error
    assert not api.instance("vm-1").deleted


@pytest.mark.process
def test_without_reap_an_end_is_left_alone(
    api: FakeComputeAPI, ledger: Ledger, now: list[float]
) -> None:
    finished(api, "vm-1", now)
    p = poller(api, ledger, now)
    p.poll("vm-1")
    api.set_status("vm-1", "TERMINATED")
    out = p.poll("vm-1")
    assert out.verdict is not None and out.verdict.kind is K.WORKLOAD_OK and out.reaped is None
    assert not api.calls_to("delete")


@pytest.mark.process
def test_failover_reap_is_recorded_only_once_done(
    api: FakeComputeAPI, ledger: Ledger, now: list[float]
) -> None:
    api.add_instance("spot-1", project=P, zone=Z, spot=True)
    w = Writer(ts_ms=int(now[0] * 1000))
    api.append_serial("spot-1", w.line("phase", {"ph": "workload"}))
    p = poller(api, ledger, now, reap=True)
    assert p.poll("spot-1").action == "none"
    api.preempt("spot-1")
    now[0] += 10
    out = p.poll("spot-1")
    assert out.verdict is not None and out.verdict.kind is K.PREEMPTED
    assert out.action == "failover" and out.reap_pending
    assert ledger.decisions.all()[0].reaped_at is None
    now[0] += 5
    again = p.poll("spot-1")
    assert again.reaped and ledger.decisions.all()[0].reaped_at is not None


@pytest.mark.process
def test_operations_of_an_earlier_boot_are_not_evidence(
    api: FakeComputeAPI, ledger: Ledger, now: list[float]
) -> None:
    api.add_instance("spot-1", project=P, zone=Z, spot=True)
    api.preempt("spot-1")  # an earlier incarnation's preemption
    now[0] += 3600
    api.set_status("spot-1", "RUNNING")  # restarted
    w = Writer(ts_ms=int(now[0] * 1000))
    api.append_serial("spot-1", w.line("phase", {"ph": "workload"}))
    p = poller(api, ledger, now)
    assert p.poll("spot-1").action == "none"
    api.set_status("spot-1", "TERMINATED")  # off again, no operation says why
    out = p.poll("spot-1")
    assert out.verdict is not None and out.verdict.kind is K.ENDED_UNREAD, out.verdict
    assert out.action == "none" and "compute.instances.preempted" not in out.verdict.reason


@pytest.mark.process
def test_blind_to_the_operations_means_no_verdict(
    api: FakeComputeAPI, ledger: Ledger, now: list[float]
) -> None:
    api.add_instance("vm-1", project=P, zone=Z)
    w = Writer(ts_ms=int(now[0] * 1000))
    api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
    p = poller(api, ledger, now)
    p.poll("vm-1")
    api.set_status("vm-1", "TERMINATED")
    api.set_fault("operations", Fault.SERVER_ERROR)
    out = p.poll("vm-1")
    assert out.verdict is None and out.error and out.action == "error"
    api.set_fault("operations", None)
    assert p.poll("vm-1").verdict is not None


@pytest.mark.process
def test_a_peer_cursor_that_read_the_last_line_decides(
    api: FakeComputeAPI, ledger: Ledger, now: list[float], tmp_path: Path
) -> None:
    from google.oauth2.credentials import Credentials

    finished(api, "vm-1", now)
    creds = Credentials("tok")  # type: ignore[no-untyped-call]
    client = ComputeClient.create(creds, api_base=api.base_url)
    peer = Poller(client, CursorStore(tmp_path / "peer"), P, Z, None, clock=lambda: now[0])
    assert peer.poll("vm-1").verdict.kind is K.WORKLOAD_OK  # type: ignore[union-attr]
    api.set_status("vm-1", "TERMINATED")  # our poller never read the VM while it ran
    late = Poller(client, CursorStore(tmp_path / "late"), P, Z, ledger, clock=lambda: now[0],
                  peers=[tmp_path / "peer"])  # fmt: skip
    late.reader.cursor(P, Z, "vm-1").instance_id = api.instance("vm-1").id  # seen before
    out = late.poll("vm-1")
    assert out.verdict is not None and out.verdict.kind is K.WORKLOAD_OK, out.verdict
    assert any("peer_cursor" in e for e in out.verdict.evidence) and out.action == "none"
