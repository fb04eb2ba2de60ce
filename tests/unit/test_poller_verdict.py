"""The pure verdict function: one test per row of the decision table in docs/poller.md."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gce_watchdog.poller.verdict import (
    InstanceState,
    Policy,
    VerdictKind,
    current_boot,
    decide,
    latest_boot_events,
)
from gce_watchdog.wire.protocol import Event, make_event
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

T0 = 1_764_475_094_000
B1, B2 = "aaaa0001", "bbbb0002"
K = VerdictKind


def ev(name: str, seq: int, boot: str = B1, **fields: object) -> Event:
    return make_event(name, boot, seq, T0 + seq * 30_000, fields)


def seq_of(*names_fields: tuple[str, dict[str, object]], boot: str = B1) -> list[Event]:
    return [ev(n, i, boot, **f) for i, (n, f) in enumerate(names_fields)]


WORKLOAD = [("start", {"v": "1"}), ("phase", {"ph": "workload"})]
NOW = (T0 + 10 * 30_000) / 1000  # shortly after the events below
RUN = InstanceState("RUNNING")

TABLE: list[tuple[str, list[tuple[str, dict[str, object]]], InstanceState, float, K]] = [
    (
        "1 setup_failed",
        [("phase", {"ph": "bootstrap"}), ("setup_failed", {"step": "uv", "rc": 6})],
        InstanceState("TERMINATED"),
        NOW,
        K.SETUP_FAILED,
    ),
    (
        "1 setup_failed cause=job",
        [("phase", {"ph": "bootstrap"}), ("setup_failed", {"step": "uv", "rc": 6, "cause": "job"})],
        InstanceState("TERMINATED"),
        NOW,
        K.SETUP_FAILED,
    ),
    (
        "1b setup_failed cause=infra (DNS never came up): fail over",
        [
            ("phase", {"ph": "bootstrap"}),
            ("setup_failed", {"step": "dns", "rc": 75, "cause": "infra"}),
        ],
        InstanceState("TERMINATED"),
        NOW,
        K.SETUP_FAILED_INFRA,
    ),
    (
        "2 ladder shutdown",
        [*WORKLOAD, ("tick", {"rung": "10/10"}), ("shutdown", {"reason": "ladder"})],
        RUN,
        NOW,
        K.SELF_SHUTDOWN,
    ),
    (
        "2 ladder shutdown then the workload killed by it",
        [*WORKLOAD, ("shutdown", {"reason": "ladder"}), ("exit", {"rc": "-", "sig": "TERM"})],
        InstanceState("TERMINATED"),
        NOW,
        K.SELF_SHUTDOWN,
    ),
    (
        "3 preemption notice",
        [*WORKLOAD, ("preempted", {"kind": "spot"}), ("exit", {"rc": "-", "sig": "TERM"})],
        InstanceState("STOPPING"),
        NOW,
        K.PREEMPTED,
    ),
    ("4 exit rc 0", [*WORKLOAD, ("exit", {"rc": 0, "sig": "-"})], RUN, NOW, K.WORKLOAD_OK),
    (
        "4 phase done",
        [*WORKLOAD, ("phase", {"ph": "done"})],
        InstanceState("TERMINATED"),
        NOW,
        K.WORKLOAD_OK,
    ),
    (
        "4 finished, then the network died",
        [*WORKLOAD, ("exit", {"rc": 0}), ("shutdown", {"reason": "ladder"})],
        RUN,
        NOW,
        K.WORKLOAD_OK,
    ),
    ("5 exit rc 1", [*WORKLOAD, ("exit", {"rc": 1, "sig": "-"})], RUN, NOW, K.WORKLOAD_FAILED),
    (
        "5 killed by a signal",
        [*WORKLOAD, ("exit", {"rc": "-", "sig": "KILL"})],
        RUN,
        NOW,
        K.WORKLOAD_FAILED,
    ),
    # Rows 6-7 (issue 24): off without a terminal line, the zone operations decide; with no
    # evidence the verdict is ended_unread (an alarm, no failover by default). Before issue 24
    # a Spot VM was "presumed preempted" and any other VM failed over unexplained.
    (
        "6 spot VM off, GCE preempted it",
        WORKLOAD,
        InstanceState("TERMINATED", spot=True, end_ops=("compute.instances.preempted",)),
        NOW,
        K.PREEMPTED,
    ),
    (
        "6 deleted after a preemption",
        WORKLOAD,
        InstanceState("MISSING", spot=True, end_ops=("compute.instances.preempted", "delete")),
        NOW,
        K.PREEMPTED,
    ),
    (
        "6 host error",
        WORKLOAD,
        InstanceState("TERMINATED", end_ops=("compute.instances.hostError",)),
        NOW,
        K.TERMINATED_UNEXPLAINED,
    ),
    (
        "7 spot VM off, no operation",
        WORKLOAD,
        InstanceState("TERMINATED", spot=True, end_ops=()),
        NOW,
        K.ENDED_UNREAD,
    ),
    (
        "7 guest shutdown",
        WORKLOAD,
        InstanceState("TERMINATED", end_ops=("compute.instances.guestTerminate",)),
        NOW,
        K.ENDED_UNREAD,
    ),
    ("7 user stop", WORKLOAD, InstanceState("STOPPED", end_ops=("stop",)), NOW, K.ENDED_UNREAD),
    ("7 operations not looked up", WORKLOAD, InstanceState("STOPPED"), NOW, K.ENDED_UNREAD),
    ("7 suspended", WORKLOAD, InstanceState("SUSPENDED", end_ops=()), NOW, K.ENDED_UNREAD),
    ("7 deleted, no line of ours ever", [], InstanceState("MISSING"), NOW, K.ENDED_UNREAD),
    ("8 deprovisioning, silent", WORKLOAD, InstanceState("DEPROVISIONING"), NOW + 3600, K.UNKNOWN),
    ("8 pending (flex start)", WORKLOAD, InstanceState("PENDING"), NOW + 3600, K.UNKNOWN),
    ("8 pending stop", WORKLOAD, InstanceState("PENDING_STOP"), NOW + 3600, K.UNKNOWN),
    ("8 repairing", WORKLOAD, InstanceState("REPAIRING"), NOW + 3600, K.UNKNOWN),
    ("8 suspending", WORKLOAD, InstanceState("SUSPENDING"), NOW + 3600, K.UNKNOWN),
    ("8 staging", WORKLOAD, InstanceState("STAGING"), NOW + 3600, K.UNKNOWN),
    ("8 undocumented status", WORKLOAD, InstanceState("HIBERNATING"), NOW + 3600, K.UNKNOWN),
    ("8 stopping", WORKLOAD, InstanceState("STOPPING"), NOW + 3600, K.UNKNOWN),
    ("8 provisioning", WORKLOAD, InstanceState("PROVISIONING"), NOW, K.UNKNOWN),
    ("9 nothing yet", [], RUN, NOW, K.UNKNOWN),
    (
        "10 agent stopped by an operator, silent",
        [*WORKLOAD, ("stop", {"reason": "sigterm"})],
        RUN,
        NOW + 3600,
        K.UNKNOWN,
    ),
    ("11 silent in workload", WORKLOAD, RUN, NOW + 3600, K.SUSPECTED_WEDGE),
    (
        "11 silent in bootstrap",
        [("phase", {"ph": "bootstrap"})],
        RUN,
        NOW + 3600,
        K.SUSPECTED_WEDGE,
    ),
    (
        "11 silent, phase known only from ticks",
        [("tick", {"rung": "3/10", "ph": "workload"})],
        InstanceState(None),
        NOW + 3600,
        K.SUSPECTED_WEDGE,
    ),
    (
        "11 restarted agent, then silent",
        [*WORKLOAD, ("stop", {"reason": "sigterm"}), ("start", {"v": "1"})],
        RUN,
        NOW + 3600,
        K.SUSPECTED_WEDGE,
    ),
    (
        "12 alive",
        [*WORKLOAD, ("heartbeat", {"rung": "0/10", "ph": "workload"})],
        RUN,
        NOW,
        K.HEALTHY,
    ),
    ("12 alive, status unknown", WORKLOAD, InstanceState(None), NOW, K.HEALTHY),
]


@pytest.mark.parametrize(
    ("name", "lines", "state", "now", "want"), TABLE, ids=[t[0] for t in TABLE]
)
def test_decision_table(
    name: str, lines: list[tuple[str, dict[str, object]]], state: InstanceState, now: float, want: K
) -> None:
    events = seq_of(*lines)
    # the reader received each line as it was written (the guest's clock agrees with ours here)
    rx = max((e.ts_ms for e in events), default=0) / 1000 if events else None
    v = decide(events, state, now, Policy(), received_s=rx)
    assert v.kind is want, v.reason
    assert v.failover is want.failover
    assert v.reason
    if lines:
        assert v.boot == B1


def test_failover_set_is_exactly_the_documented_one() -> None:
    assert {k for k in K if k.failover} == {
        K.SELF_SHUTDOWN,
        K.SETUP_FAILED_INFRA,
        K.SUSPECTED_WEDGE,
        K.PREEMPTED,
        K.TERMINATED_UNEXPLAINED,
    }


def test_drain_timeout_boundary_and_policy_validation() -> None:
    events = seq_of(*WORKLOAD)
    last = events[-1].ts_ms / 1000
    pol = Policy(drain_timeout_s=60)
    assert decide(events, RUN, last + 60, pol, received_s=last).kind is K.HEALTHY
    assert decide(events, RUN, last + 60.001, pol, received_s=last).kind is K.SUSPECTED_WEDGE
    # Silence is on the reader's clock: a guest clock far ahead (lines "from the future") does
    # not hide a wedge, and one far behind does not fake one.
    assert decide(events, RUN, last + 60.001 - 10**6, pol, received_s=last - 10**6).kind is (
        K.SUSPECTED_WEDGE
    )
    assert decide(events, RUN, last + 10**6, pol, received_s=last + 10**6 - 1).kind is K.HEALTHY
    # Without a receive time there is no measure of silence: never a wedge.
    assert decide(events, RUN, last + 10**6, pol).kind is K.HEALTHY
    with pytest.raises(ValueError):
        Policy(drain_timeout_s=0)


def test_healthy_reason_reports_the_ladder() -> None:
    events = seq_of(*WORKLOAD, ("tick", {"rung": "4/10", "ph": "workload"}))
    v = decide(events, RUN, NOW, Policy())
    assert v.kind is K.HEALTHY and "ladder at 4/10" in v.reason


def test_only_the_latest_boot_decides() -> None:
    old = seq_of(*WORKLOAD, ("shutdown", {"reason": "ladder"}), boot=B1)
    new = [ev("start", 0, B2), ev("phase", 1, B2, ph="workload")]
    v = decide(old + new, RUN, NOW, Policy())
    assert v.kind is K.HEALTHY and v.boot == B2
    # and the other way round: an old boot's setup_failed does not stop a new boot's failover
    old = seq_of(("setup_failed", {"step": "x"}), boot=B1)
    new = [ev("phase", 0, B2, ph="workload"), ev("shutdown", 1, B2, reason="ladder")]
    assert decide(old + new, RUN, NOW, Policy()).kind is K.SELF_SHUTDOWN


def test_first_terminal_event_by_seq_even_when_lines_arrive_out_of_order() -> None:
    a = ev("shutdown", 5, reason="ladder")
    b = ev("exit", 6, rc="-", sig="TERM")
    assert decide([b, a], RUN, NOW, Policy()).kind is K.SELF_SHUTDOWN
    assert latest_boot_events([b, a]) == [a, b]


# -- properties ----------------------------------------------------------------------------

NAMES = [
    "start",
    "stop",
    "phase",
    "setup_failed",
    "exit",
    "shutdown",
    "preempted",
    "tick",
    "heartbeat",
    "recovered",
    "x_other",
]
PHASES = ["bootstrap", "workload", "done", "-"]
STATUSES = [
    None,
    "RUNNING",
    "TERMINATED",
    "STOPPED",
    "STOPPING",
    "MISSING",
    "SUSPENDED",
    "PROVISIONING",
    "WEIRD",
]

an_event = st.builds(
    lambda name, boot, seq, dt, ph, rc: make_event(
        name, boot, seq, T0 + dt, {"ph": ph, "rc": rc, "reason": "ladder"}
    ),
    st.sampled_from(NAMES),
    st.sampled_from([B1, B2]),
    st.integers(0, 50),
    st.integers(0, 10_000_000),
    st.sampled_from(PHASES),
    st.sampled_from(["0", "1", "-", "137"]),
)


@given(
    st.lists(an_event, max_size=30), st.sampled_from(STATUSES), st.booleans(), st.floats(0, 20_000)
)
def test_decide_is_total_and_consistent(
    events: list[Event], status: str | None, spot: bool, dt: float
) -> None:
    v = decide(events, InstanceState(status, spot), T0 / 1000 + dt, Policy())
    assert isinstance(v.kind, K) and v.reason
    assert v.failover == v.kind.failover
    if events:
        assert v.boot in (None, current_boot(events))


@given(
    st.lists(an_event, min_size=1, max_size=20),
    st.lists(an_event, max_size=20),
    st.sampled_from(STATUSES),
    st.floats(0, 20_000),
)
def test_earlier_boots_never_change_the_verdict(
    latest: list[Event], earlier: list[Event], status: str | None, dt: float
) -> None:
    boot = latest[-1].boot
    latest = [e for e in latest if e.boot == boot]
    start = min(e.ts_ms for e in latest)
    # an earlier boot: every line of it older than the latest boot's first line
    other = [replace(e, ts_ms=start - 1 - e.seq) for e in earlier if e.boot != boot]
    state = InstanceState(status)
    now = T0 / 1000 + dt
    rx = T0 / 1000
    want = decide(latest, state, now, Policy(), received_s=rx)
    assert decide(other + latest, state, now, Policy(), received_s=rx) == want
    # lines of the earlier boot replayed after the latest boot's: still the latest boot decides
    assert decide(latest + other, state, now, Policy(), received_s=rx) == want
