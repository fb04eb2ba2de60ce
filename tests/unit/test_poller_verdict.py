"""The pure verdict function: one test per row of the decision table in docs/poller.md."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from gce_watchdog.poller.verdict import (
    POLICY_KINDS,
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
        "6b host error (issue 36: its own verdict)",
        WORKLOAD,
        InstanceState("TERMINATED", end_ops=("compute.instances.hostError",)),
        NOW,
        K.HOST_ERROR,
    ),
    (
        "6c host maintenance stopped a GPU VM",
        WORKLOAD,
        InstanceState("TERMINATED", end_ops=("compute.instances.terminateOnHostMaintenance",)),
        NOW,
        K.HOST_MAINTENANCE,
    ),
    (
        "6c host maintenance, then deleted by a user",
        [*WORKLOAD, ("maintenance", {"event": "TERMINATE_ON_HOST_MAINTENANCE", "was": "NONE"})],
        InstanceState(
            "MISSING", end_ops=("compute.instances.terminateOnHostMaintenance", "delete")
        ),
        NOW,
        K.HOST_MAINTENANCE,
    ),
    (
        "7 the maintenance notice alone is no evidence of the stop",
        [*WORKLOAD, ("maintenance", {"event": "TERMINATE_ON_HOST_MAINTENANCE", "was": "NONE"})],
        InstanceState("TERMINATED", end_ops=()),
        NOW,
        K.ENDED_UNREAD,
    ),
    (
        "G a verified gpu_fault while running",
        [*WORKLOAD, ("gpu_fault", {"xid": 79, "pci": "0000:00:04.0", "gpu": 0, "sig": "lost"})],
        RUN,
        NOW,
        K.GPU_FAULT,
    ),
    (
        "G every GPU lost (memory_gpu st=lost)",
        [*WORKLOAD, ("memory_gpu", {"st": "lost", "n": 0})],
        RUN,
        NOW,
        K.GPU_FAULT,
    ),
    (
        "G an application Xid never decides",
        [*WORKLOAD, ("gpu_event", {"xid": 13, "pci": "0000:00:04.0", "gpu": 0, "cls": "app"})],
        RUN,
        NOW,
        K.HEALTHY,
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
    assert v.failover is (want.failover or want in POLICY_KINDS)
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
    "gpu_fault",
    "gpu_event",
    "gpu_stall",
    "job_stuck",
    "progress",
    "maintenance",
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
    assert v.failover == (v.kind.failover or v.kind in POLICY_KINDS)
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
    # the latest boot counts 2 (``bc``), the earlier one 1: the counter orders them, whatever the
    # stream order (poller/boots.py); lines without a counter are ordered by stream position
    latest = [replace(e, fields=(*e.fields, ("bc", "2"))) for e in latest if e.boot == boot]
    start = min(e.ts_ms for e in latest)
    # an earlier boot: every line of it older than the latest boot's first line
    other = [
        replace(e, ts_ms=start - 1 - e.seq, fields=(*e.fields, ("bc", "1")))
        for e in earlier
        if e.boot != boot
    ]
    state = InstanceState(status)
    now = T0 / 1000 + dt
    rx = T0 / 1000
    want = decide(latest, state, now, Policy(), received_s=rx)
    assert decide(other + latest, state, now, Policy(), received_s=rx) == want
    # lines of the earlier boot replayed after the latest boot's: still the latest boot decides
    assert decide(latest + other, state, now, Policy(), received_s=rx) == want


# -- planned stops (issue 36.1) --------------------------------------------------------------

Line = tuple[str, dict[str, object]]
OP_PRE, OP_ERR, OP_MAINT = (
    "compute.instances.preempted",
    "compute.instances.hostError",
    "compute.instances.terminateOnHostMaintenance",
)
NOTICE: Line = ("maintenance", {"event": "TERMINATE_ON_HOST_MAINTENANCE", "was": "NONE"})
WAIT = Policy(planned_stop_wait=True)
OPS = [OP_PRE, OP_ERR, OP_MAINT, "compute.instances.guestTerminate", "stop", "delete"]


def test_policy_kinds_fail_over_by_default_and_only_by_policy() -> None:
    assert {K.HOST_MAINTENANCE, K.HOST_ERROR, K.GPU_FAULT, K.JOB_STUCK} == POLICY_KINDS
    assert not any(k.failover for k in POLICY_KINDS)  # the policy decides, default: fail over


def test_every_set_of_end_operations() -> None:
    """Exhaustive over the end operations: a preemption first, then a host error, then host
    maintenance; a planned stop is never ended_unread; the policy only moves the failover."""
    import itertools

    statuses = ["TERMINATED", "STOPPED", "SUSPENDED", "MISSING"]
    for mask, status, notice, wait in itertools.product(
        range(2 ** len(OPS)), statuses, (False, True), (False, True)
    ):
        _check_end_operations(mask, status, notice, wait)


def _check_end_operations(mask: int, status: str, notice: bool, wait: bool) -> None:
    ops = tuple(op for i, op in enumerate(OPS) if mask >> i & 1)
    lines = [*WORKLOAD, NOTICE] if notice else WORKLOAD
    policy = Policy(planned_stop_wait=wait)
    v = decide(seq_of(*lines), InstanceState(status, end_ops=ops), NOW, policy)
    want = (
        K.PREEMPTED
        if OP_PRE in ops
        else K.HOST_ERROR
        if OP_ERR in ops
        else K.HOST_MAINTENANCE
        if OP_MAINT in ops
        else K.ENDED_UNREAD
    )
    assert v.kind is want, v.reason
    if want in (K.HOST_ERROR, K.HOST_MAINTENANCE):
        assert v.failover is not wait and not v.alarm
        assert ("automatic restart" in v.reason) is wait
        # the agent's signed notice is shown beside the operation (corroboration)
        assert any("TERMINATE_ON_HOST_MAINTENANCE" in e for e in v.evidence) is notice
        assert ("the agent had the notice" in v.reason) is notice
    if want is K.PREEMPTED:
        assert v.failover  # the wait policy is about planned stops only


def test_a_terminal_line_still_decides_before_a_planned_stop() -> None:
    lines = [*WORKLOAD, ("exit", {"rc": "0", "sig": "-"})]
    state = InstanceState("TERMINATED", end_ops=(OP_MAINT,))
    assert decide(seq_of(*lines), state, NOW, Policy()).kind is K.WORKLOAD_OK


def test_a_running_vm_with_the_notice_is_healthy_and_says_so() -> None:
    v = decide(seq_of(*WORKLOAD, NOTICE), RUN, NOW, Policy())
    assert v.kind is K.HEALTHY and "host maintenance announced" in v.reason
    migrate = ("maintenance", {"event": "MIGRATE_ON_HOST_MAINTENANCE", "was": "NONE"})
    assert "announced" not in decide(seq_of(*WORKLOAD, migrate), RUN, NOW, Policy()).reason


def test_back_from_a_planned_stop_while_waiting() -> None:
    """The VM came back (RUNNING) before the new boot's first line: the old boot's silence is
    the stop's. Waiting: unknown for one drain timeout from its return, then a wedge; without
    the wait policy the stop's own verdict (a failover)."""
    events = seq_of(*WORKLOAD)
    rx = events[-1].ts_ms / 1000
    late = rx + 7200  # two hours of maintenance: the old boot is long silent
    silent = decide(events, RUN, late, WAIT, received_s=rx)
    assert silent.kind is K.SUSPECTED_WEDGE  # without the operations: nothing explains it
    back = InstanceState("RUNNING", end_ops=(OP_MAINT,), back_s=late - 60)
    v = decide(events, back, late, WAIT, received_s=rx)
    assert v.kind is K.UNKNOWN and not v.failover and "waiting for the new boot" in v.reason
    limit = WAIT.drain_timeout_s
    assert decide(events, back, late - 60 + limit, WAIT, received_s=rx).kind is K.UNKNOWN
    v = decide(events, back, late - 60 + limit + 1, WAIT, received_s=rx)
    assert v.kind is K.SUSPECTED_WEDGE and "running again" in v.reason
    v = decide(events, back, late, Policy(), received_s=rx)
    assert v.kind is K.HOST_MAINTENANCE and v.failover
    err = InstanceState("RUNNING", end_ops=(OP_ERR,), back_s=late)
    assert decide(events, err, late, Policy(), received_s=rx).kind is K.HOST_ERROR
    # a new boot's first line: judged afresh, the old boot's stop says nothing about it
    new = [*events, ev("start", 0, B2), ev("phase", 1, B2, ph="workload")]
    v = decide(new, back, late, WAIT, received_s=late)
    assert v.kind is K.HEALTHY and v.boot == B2


# -- GPU faults (issue 36.2) -----------------------------------------------------------------

FAULT: Line = ("gpu_fault", {"xid": 79, "pci": "0000:00:04.0", "gpu": 3, "sig": "lost"})
LOST: Line = ("memory_gpu", {"st": "lost", "n": 0})
BACK: Line = ("memory_gpu", {"st": "ok", "n": 8})
APP: Line = ("gpu_event", {"xid": 13, "pci": "0000:00:04.0", "gpu": 3, "cls": "app"})
STALL: Line = ("gpu_stall", {"ms": 12000, "to": 10000})
OK_EXIT: Line = ("exit", {"rc": "0", "sig": "-"})
BAD_EXIT: Line = ("exit", {"rc": "1", "sig": "-"})
SHUT: Line = ("shutdown", {"reason": "ladder", "rung": "10/10"})
BEAT: Line = ("heartbeat", {"rung": "0/10", "ph": "workload"})
REPORT = Policy(gpu_fault_report=True)
GPU_ALPHABET: list[Line] = [FAULT, LOST, BACK, APP, STALL, OK_EXIT, BAD_EXIT, SHUT, BEAT]


def test_gpu_fault_fails_over_or_reports_and_names_the_gpu() -> None:
    events = seq_of(*WORKLOAD, APP, FAULT)
    v = decide(events, RUN, NOW, Policy())
    assert v.kind is K.GPU_FAULT and v.failover and not v.alarm
    assert "GPU 3 (0000:00:04.0)" in v.reason and "Xid 79" in v.reason and "lost" in v.reason
    assert v.evidence[0] == events[-1].render()
    assert events[2].render() in v.evidence  # the gpu_event is shown
    r = decide(events, RUN, NOW, REPORT)
    assert r.kind is K.GPU_FAULT and not r.failover and r.alarm and "ALARM" in r.reason
    lost = decide(seq_of(*WORKLOAD, LOST), InstanceState("TERMINATED", end_ops=()), NOW, Policy())
    assert lost.kind is K.GPU_FAULT and "every GPU" in lost.reason


def test_gpu_fault_and_the_jobs_own_ending() -> None:
    # the job finished after the fault: never run a finished job twice
    assert decide(seq_of(*WORKLOAD, FAULT, OK_EXIT), RUN, NOW, Policy()).kind is K.WORKLOAD_OK
    # the job died after the fault: the fault is the cause
    assert decide(seq_of(*WORKLOAD, FAULT, BAD_EXIT), RUN, NOW, Policy()).kind is K.GPU_FAULT
    # a fault after the job's end is the end's consequence (or later news): the end decides
    assert decide(seq_of(*WORKLOAD, BAD_EXIT, FAULT), RUN, NOW, Policy()).kind is (
        K.WORKLOAD_FAILED
    )
    # report mode holds back only the GPU's own failover
    v = decide(seq_of(*WORKLOAD, FAULT, SHUT), RUN, NOW, REPORT)
    assert v.kind is K.SELF_SHUTDOWN and v.failover
    assert any("gpu_fault" in e for e in v.evidence)
    # every GPU lost, then back: not a fault
    assert decide(seq_of(*WORKLOAD, LOST, BACK), RUN, NOW, Policy()).kind is K.HEALTHY


def _gpu_rule(lines: list[tuple[str, dict[str, object]]], report: bool) -> tuple[K, bool]:
    """docs/poller.md's GPU rows restated over a sequence of GPU_ALPHABET lines (status
    RUNNING, no silence): (verdict, failover)."""
    term = next((i for i, (n, f) in enumerate(lines) if n in ("exit", "shutdown")), None)
    base = K.HEALTHY
    if term is not None:
        n, f = lines[term]
        base = {"shutdown": K.SELF_SHUTDOWN}.get(n) or (
            K.WORKLOAD_OK if f["rc"] == "0" else K.WORKLOAD_FAILED
        )
    fault, lost = None, None
    for i, (n, f) in enumerate(lines):
        if n == "gpu_fault":
            fault = lost if lost is not None else i
            break
        if n == "memory_gpu":
            lost = (lost if lost is not None else i) if f["st"] == "lost" else None
    fault = fault if fault is not None else lost
    if fault is None or (term is not None and term < fault) or base is K.WORKLOAD_OK:
        return base, base.failover
    if report and base.failover:
        return base, True
    return K.GPU_FAULT, not report


def test_every_gpu_sequence_up_to_four_lines() -> None:
    """Exhaustive: every sequence of up to 4 lines over the GPU alphabet, both policies."""
    import itertools

    n = 0
    for size in range(5):
        for combo in itertools.product(GPU_ALPHABET, repeat=size):
            lines = list(combo)
            events = seq_of(*WORKLOAD, *lines)
            for report in (False, True):
                v = decide(events, RUN, NOW, Policy(gpu_fault_report=report))
                assert (v.kind, v.failover) == _gpu_rule(lines, report), (lines, v.reason)
                n += 1
    assert n == 2 * sum(len(GPU_ALPHABET) ** k for k in range(5))


gpu_line = st.sampled_from([*GPU_ALPHABET, APP, STALL, BEAT, NOTICE])


@given(
    st.lists(gpu_line, max_size=12),
    st.lists(st.sampled_from([APP, STALL]), max_size=6),
    st.randoms(use_true_random=False),
    st.sampled_from(STATUSES),
    st.booleans(),
)
def test_gpu_events_and_stalls_never_decide(
    lines: list[tuple[str, dict[str, object]]],
    extra: list[tuple[str, dict[str, object]]],
    rnd: random.Random,
    status: str | None,
    report: bool,
) -> None:
    """Inserting gpu_event/gpu_stall lines anywhere changes neither the verdict nor the action;
    report mode never adds a failover, and where it removes one the verdict is gpu_fault."""
    mixed = list(lines)
    for x in extra:
        mixed.insert(rnd.randint(0, len(mixed)), x)
    state = InstanceState(status, end_ops=())
    rx = NOW - 5
    policy = Policy(gpu_fault_report=report)
    plain = decide(seq_of(*WORKLOAD, *lines), state, NOW, policy, received_s=rx)
    more = decide(seq_of(*WORKLOAD, *mixed), state, NOW, policy, received_s=rx)
    assert (more.kind, more.failover) == (plain.kind, plain.failover)
    fo = decide(seq_of(*WORKLOAD, *lines), state, NOW, Policy(), received_s=rx)
    rep = decide(seq_of(*WORKLOAD, *lines), state, NOW, REPORT, received_s=rx)
    assert rep.failover <= fo.failover
    if rep.failover != fo.failover:
        assert fo.kind is rep.kind is K.GPU_FAULT and rep.alarm


# -- a stuck job (issue 37) ------------------------------------------------------------------

STUCK: Line = ("job_stuck", {"rule": "idle", "step": 41, "quiet": 600, "act": "end"})
PROG: Line = ("progress", {"step": 41, "age": 3})
SIG_EXIT: Line = ("exit", {"rc": "-", "sig": "SIGTERM"})  # the end of life kills the job
STUCK_ALPHABET: list[Line] = [STUCK, PROG, FAULT, OK_EXIT, SIG_EXIT, SHUT, BEAT]


def test_job_stuck_fails_over_or_reports_and_says_why() -> None:
    events = seq_of(*WORKLOAD, PROG, STUCK, SIG_EXIT)
    v = decide(events, InstanceState("TERMINATED", end_ops=()), NOW, Policy())
    assert v.kind is K.JOB_STUCK and v.failover and not v.alarm
    assert "600s" in v.reason and "rule idle" in v.reason and "step 41" in v.reason
    assert v.evidence[0] == events[3].render()
    r = decide(events, RUN, NOW, Policy(job_stuck_report=True))
    assert r.kind is K.JOB_STUCK and not r.failover and r.alarm and "ALARM" in r.reason


def _stuck_rule(lines: list[Line], stuck_report: bool, gpu_report: bool) -> tuple[K, bool]:
    """docs/poller.md's rows S and G restated over STUCK_ALPHABET lines (RUNNING, no silence)."""
    term = next((i for i, (n, _) in enumerate(lines) if n in ("exit", "shutdown")), None)
    base = K.HEALTHY
    if term is not None:
        n, f = lines[term]
        base = (
            K.SELF_SHUTDOWN
            if n == "shutdown"
            else (K.WORKLOAD_OK if f["rc"] == "0" else K.WORKLOAD_FAILED)
        )
    kind, failover = base, base.failover
    stuck = next((i for i, (n, _) in enumerate(lines) if n == "job_stuck"), None)
    before = stuck is not None and (term is None or stuck < term)
    if before and base is not K.WORKLOAD_OK and not (stuck_report and base.failover):
        kind, failover = K.JOB_STUCK, not stuck_report
    fault = next((i for i, (n, _) in enumerate(lines) if n == "gpu_fault"), None)
    if fault is None or (term is not None and term < fault) or base is K.WORKLOAD_OK:
        return kind, failover
    if gpu_report and failover:
        return kind, failover
    return K.GPU_FAULT, not gpu_report


def test_every_stuck_sequence_up_to_four_lines() -> None:
    """Exhaustive: every sequence of up to 4 lines over the stuck alphabet, all four policies."""
    import itertools

    n = 0
    for size in range(5):
        for combo in itertools.product(STUCK_ALPHABET, repeat=size):
            lines = list(combo)
            events = seq_of(*WORKLOAD, *lines)
            for sr, gr in itertools.product((False, True), repeat=2):
                policy = Policy(job_stuck_report=sr, gpu_fault_report=gr)
                v = decide(events, RUN, NOW, policy)
                assert (v.kind, v.failover) == _stuck_rule(lines, sr, gr), (lines, sr, gr)
                n += 1
    assert n == 4 * sum(len(STUCK_ALPHABET) ** k for k in range(5))


@given(
    st.lists(st.sampled_from(STUCK_ALPHABET), max_size=10),
    st.lists(st.just(PROG), max_size=6),
    st.randoms(use_true_random=False),
    st.sampled_from(STATUSES),
)
def test_progress_lines_never_decide(
    lines: list[Line], extra: list[Line], rnd: random.Random, status: str | None
) -> None:
    mixed = list(lines)
    for x in extra:
        mixed.insert(rnd.randint(0, len(mixed)), x)
    state = InstanceState(status, end_ops=())
    rx = NOW - 5
    plain = decide(seq_of(*WORKLOAD, *lines), state, NOW, Policy(), received_s=rx)
    more = decide(seq_of(*WORKLOAD, *mixed), state, NOW, Policy(), received_s=rx)
    assert (more.kind, more.failover) == (plain.kind, plain.failover)


# -- a workload killed as GCE stops the VM (issue 36.1, row 5b) -----------------------------

KILLED_TERM: Line = ("exit", {"rc": "-", "sig": "SIGTERM", "dur": "3600.000"})
KILLED_KILL: Line = ("exit", {"rc": "-", "sig": "SIGKILL", "dur": "3690.000"})
KILLED_INT: Line = ("exit", {"rc": "-", "sig": "SIGINT", "dur": "10.000"})
RC1: Line = ("exit", {"rc": "1", "sig": "-", "dur": "10.000"})
RC0: Line = ("exit", {"rc": "0", "sig": "-", "dur": "10.000"})
RESULT_FAIL: Line = ("result", {"status": "fail"})
DONE: Line = ("phase", {"ph": "done"})
EXITS = [KILLED_TERM, KILLED_KILL, KILLED_INT, RC1, RC0]
KILL_STATUSES: list[str | None] = ["TERMINATED", "STOPPED", "MISSING", "STOPPING", "RUNNING", None]


def _want_killed(
    exit_line: Line, ops: tuple[str, ...], status: str | None, wait: bool, result_fail: bool
) -> K:
    """The rule, restated: rc 0 is the job's success; a job that reported its own failure
    failed; a SIGTERM/SIGKILL exit in a boot GCE stopped takes the stop's verdict (preempted,
    then host error, then host maintenance; waiting for the restart once it runs again)."""
    if exit_line is RC0 and not result_fail:
        return K.WORKLOAD_OK
    killed = exit_line in (KILLED_TERM, KILLED_KILL) and not result_fail
    if killed and OP_PRE in ops:
        return K.PREEMPTED
    stop = K.HOST_ERROR if OP_ERR in ops else K.HOST_MAINTENANCE if OP_MAINT in ops else None
    if not killed or stop is None:
        return K.WORKLOAD_FAILED
    return K.UNKNOWN if status == "RUNNING" and wait else stop


def test_every_killed_exit_with_every_set_of_end_operations() -> None:
    """Exhaustive over the exit (SIGTERM, SIGKILL, another signal, rc 1, rc 0), the end
    operations (all subsets of six), the status, the wait policy, the agent's notice, the job's
    own `result fail` before it and a `phase done` after it (the start-up script's)."""
    import itertools

    for exit_line, mask, status, wait, notice, rfail, done in itertools.product(
        EXITS, range(2 ** len(OPS)), KILL_STATUSES, *[(False, True)] * 4
    ):
        ops = tuple(op for i, op in enumerate(OPS) if mask >> i & 1)
        lines = [*WORKLOAD, *([NOTICE] if notice else []), *([RESULT_FAIL] if rfail else [])]
        lines += [exit_line, *([DONE] if done else [])]
        events = seq_of(*lines)
        state = InstanceState(status, end_ops=ops)
        v = decide(events, state, NOW, Policy(planned_stop_wait=wait))
        want = _want_killed(exit_line, ops, status, wait, rfail)
        assert v.kind is want, (exit_line, ops, status, wait, notice, rfail, done, v.reason)
        if want in (K.PREEMPTED, K.HOST_ERROR, K.HOST_MAINTENANCE):
            assert v.evidence[0] == events[len(lines) - 1 - done].render()  # the exit line
            assert v.failover is (want is K.PREEMPTED or not wait)
            assert str(exit_line[1]["sig"]) in v.reason or status == "RUNNING"
            assert not v.alarm
        # without the operations (not looked up) the exit decides as before
        v0 = decide(events, InstanceState(status), NOW, Policy(planned_stop_wait=wait))
        assert v0.kind is _want_killed(exit_line, (), status, wait, rfail)


def test_killed_exit_running_again_after_maintenance_waits_then_suspects_a_wedge() -> None:
    events = seq_of(*WORKLOAD, KILLED_TERM)
    rx = events[-1].ts_ms / 1000
    back = InstanceState("RUNNING", end_ops=(OP_MAINT,), back_s=rx + 3600)
    v = decide(events, back, rx + 3600 + 60, WAIT, received_s=rx)
    assert v.kind is K.UNKNOWN and "waiting for the new boot" in v.reason
    late = rx + 3600 + WAIT.drain_timeout_s + 1
    assert decide(events, back, late, WAIT, received_s=rx).kind is K.SUSPECTED_WEDGE
    v = decide(events, back, late, Policy(), received_s=rx)
    assert v.kind is K.HOST_MAINTENANCE and v.failover


def test_a_gpu_fault_before_a_killed_exit_still_decides() -> None:
    events = seq_of(*WORKLOAD, FAULT, KILLED_TERM)
    state = InstanceState("TERMINATED", end_ops=(OP_MAINT,))
    assert decide(events, state, NOW, Policy()).kind is K.GPU_FAULT
    # report mode holds back only the GPU's failover: the planned stop's fails over
    v = decide(events, state, NOW, REPORT)
    assert v.kind is K.HOST_MAINTENANCE and v.failover


# -- the GPUs not released at the end: an alarm beside the verdict (issue 37, item 3) --------

IDLE_EXITS = [
    ("exit", {"rc": "0", "sig": "-", "idle": idle}) for idle in ("ok", "busy", "unknown")
] + [("exit", {"rc": "1", "sig": "-", "idle": "busy"}), SIG_EXIT]
IDLE_ALPHABET: list[Line] = [*IDLE_EXITS, STUCK, FAULT, SHUT, BEAT, PROG]


def _busy_exit(text: str = "workload exited with 0; GPUs busy: gpu0 held by pid 4242") -> Event:
    return make_event("exit", B1, 2, T0 + 60_000, {"rc": "0", "sig": "-", "idle": "busy"}, text)


def test_an_exit_with_idle_busy_is_an_alarm_that_changes_nothing_else() -> None:
    events = [*seq_of(*WORKLOAD), _busy_exit()]
    v = decide(events, InstanceState("TERMINATED", end_ops=()), NOW, Policy())
    assert v.kind is K.WORKLOAD_OK and not v.failover
    assert v.alarm and v.alarms == ("idle_busy",)
    assert v.reason.startswith(
        "ALARM: the GPUs were not released when the job ended (idle=busy: gpu0 held by pid 4242)"
    )
    assert v.reason.endswith("the workload exited with rc 0")
    assert events[2].render() in v.evidence and v.evidence[-1] == "alarm=idle_busy"
    assert v.evidence.count(events[2].render()) == 1  # the deciding line, shown once


@pytest.mark.parametrize("idle", ["ok", "unknown", None])
def test_idle_ok_unknown_or_absent_is_no_alarm(idle: str | None) -> None:
    fields: dict[str, object] = {"rc": "0", "sig": "-"}
    if idle is not None:
        fields["idle"] = idle
    v = decide(seq_of(*WORKLOAD, ("exit", fields)), InstanceState("TERMINATED"), NOW, Policy())
    assert v.kind is K.WORKLOAD_OK and not v.alarm and v.alarms == ()
    assert not v.reason.startswith("ALARM")


def test_a_stuck_job_whose_exit_says_busy_fails_over_with_the_alarm() -> None:
    busy_kill: Line = ("exit", {"rc": "-", "sig": "SIGTERM", "idle": "busy"})
    events = seq_of(*WORKLOAD, PROG, STUCK, busy_kill)
    v = decide(events, InstanceState("TERMINATED", end_ops=()), NOW, Policy())
    assert v.kind is K.JOB_STUCK and v.failover and v.alarm and v.alarms == ("idle_busy",)
    assert events[3].render() in v.evidence and events[4].render() in v.evidence


def test_an_earlier_boots_busy_exit_is_not_this_boots_alarm() -> None:
    old = seq_of(*WORKLOAD, ("exit", {"rc": "0", "sig": "-", "idle": "busy"}), boot=B1)
    new = [make_event(n, B2, i, T0 + 3_600_000 + i, f) for i, (n, f) in enumerate(WORKLOAD)]
    v = decide([*old, *new], RUN, NOW + 3600, Policy(), received_s=NOW + 3600)
    assert v.boot == B2 and v.kind is K.HEALTHY and v.alarms == ()


@given(
    st.lists(st.sampled_from(IDLE_ALPHABET), max_size=8),
    st.sampled_from(STATUSES),
    st.booleans(),
    st.booleans(),
)
def test_idle_busy_only_adds_the_alarm(
    lines: list[Line], status: str | None, stuck_report: bool, gpu_report: bool
) -> None:
    """Against the same lines with the idle field left out: the same verdict and failover, the
    alarm exactly when an exit line of the boot says busy."""
    plain = [(n, {k: v for k, v in f.items() if k != "idle"}) for n, f in lines]
    state = InstanceState(status, end_ops=())
    policy = Policy(job_stuck_report=stuck_report, gpu_fault_report=gpu_report)
    v = decide(seq_of(*WORKLOAD, *lines), state, NOW, policy, received_s=NOW - 5)
    p = decide(seq_of(*WORKLOAD, *plain), state, NOW, policy, received_s=NOW - 5)
    assert (v.kind, v.failover, v.boot) == (p.kind, p.failover, p.boot)
    busy = any(n == "exit" and f.get("idle") == "busy" for n, f in lines)
    assert v.alarms == (("idle_busy",) if busy else ())
    assert v.alarm == (p.alarm or busy)
    assert v.reason.endswith(p.reason)


def test_a_first_read_alone_is_never_healthy_and_a_silent_vm_is_a_wedge_after_the_drain() -> None:
    """docs/poller.md, "Freshness": the newest line came with a reader's first read and no
    record (``received_known`` False): unknown within the drain timeout, a wedge after it."""
    events = seq_of(*WORKLOAD)
    pol = Policy(drain_timeout_s=900)
    fresh = decide(events, RUN, 1000.0, pol, received_s=1000.0, received_known=True)
    assert fresh.kind is K.HEALTHY
    first = decide(events, RUN, 1000.0, pol, received_s=1000.0, received_known=False)
    assert first.kind is K.UNKNOWN and "fresh=no" in first.evidence
    assert "900s" in first.reason and not first.failover
    late = decide(events, RUN, 1901.0, pol, received_s=1000.0, received_known=False)
    assert late.kind is K.SUSPECTED_WEDGE and late.failover
    done = seq_of(*WORKLOAD, ("exit", {"rc": 0}))  # a terminal line decides as before
    assert decide(done, RUN, 1000.0, pol, received_s=1000.0, received_known=False).kind is (
        K.WORKLOAD_OK
    )


@given(
    silent=st.floats(min_value=0, max_value=5000, allow_nan=False),
    drain=st.floats(min_value=1, max_value=3000, allow_nan=False),
    status=st.sampled_from([None, "RUNNING"]),
    n=st.integers(min_value=1, max_value=6),
)
def test_property_unknown_age_never_healthy_and_wedges_past_the_drain(
    silent: float, drain: float, status: str | None, n: int
) -> None:
    events = [ev("start", 0, v="1")] + [ev("heartbeat", i, ph="workload") for i in range(1, n)]
    pol = Policy(drain_timeout_s=drain)
    state = InstanceState(status)
    v = decide(events, state, 1e6 + silent, pol, received_s=1e6, received_known=False)
    known = decide(events, state, 1e6 + silent, pol, received_s=1e6, received_known=True)
    assert v.kind is not K.HEALTHY
    if known.kind is K.HEALTHY:
        assert v.kind is K.UNKNOWN and not v.failover
    else:  # the record's age only ever holds back "healthy"
        assert v == known
    assert (v.kind is K.SUSPECTED_WEDGE) == ((1e6 + silent) - 1e6 > drain)
