"""The poller's decision: a pure function of (events, instance state, now, policy).

No clock, no I/O. ``docs/poller.md`` has the decision table with the reason for every row; the
rules below are in the same order. In short:

1. Only authenticated events reach this module (``wire.protocol``: a line whose signature does
   not verify under the pinned key is forged and never decides), and only the current boot's
   count: the caller's ``boot`` (``Timeline.latest_boot``, by stream order), else the boot whose
   earliest line carries the latest signed time (an earlier boot's shutdown says nothing about
   the VM that is running now, and a line replayed from it cannot make it current again).
2. The first terminal event of that boot (by ``seq``) decides: ``setup_failed``, ``shutdown``,
   ``preempted``, ``exit`` (rc 0 or not) and ``phase ph=done``. First, because what follows a
   terminal event is its consequence (a ladder shutdown kills the workload, which then logs a
   signal exit), never new information about the job.
3. Without a terminal event, the instance status decides. Off (TERMINATED, STOPPED, SUSPENDED,
   or gone): the poller never guesses; the zone operations of the instance decide (a
   ``compute.instances.preempted`` one: preempted; ``compute.instances.hostError``: terminated by
   the host), and without such evidence the verdict is ``ended_unread``, an alarm that fails over
   only if the policy says so (the job may have finished after the last read). In transition or
   not started (STOPPING, PENDING_STOP, DEPROVISIONING, PENDING, PROVISIONING, ...): wait. A
   status outside the documented enum: no verdict.
4. Running (or unknown, e.g. a saved dump) and silent for longer than the drain timeout while
   in a non-terminal phase: a suspected wedge the agent could not even report. Otherwise healthy.
   Silence is measured on the reader's clock from when it received the boot's newest line.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import Event

# Three missed heartbeats: the agent writes one every heartbeat_every (10) healthy ticks of 30 s,
# i.e. every 300 s, and a tick line every 30 s while the ladder climbs, so 900 s of no line at all
# cannot be an agent at work.
DEFAULT_DRAIN_TIMEOUT_S = 900.0

# Instance.status.enum of the Compute v1 discovery document, revision 20261106; "MISSING" is
# ours (the GET answered 404). docs/poller.md gives the reason for each status's row.
INSTANCE_STATUSES = frozenset(
    {
        "DEPROVISIONING", "PENDING", "PENDING_STOP", "PROVISIONING", "REPAIRING", "RUNNING",
        "STAGING", "STOPPED", "STOPPING", "SUSPENDED", "SUSPENDING", "TERMINATED",
    }
)  # fmt: skip
OFF_STATES = frozenset({"TERMINATED", "STOPPED", "SUSPENDED", "MISSING"})
TRANSITIONAL_STATES = frozenset(
    {
        "STOPPING", "PENDING_STOP", "SUSPENDING", "DEPROVISIONING", "REPAIRING",
        "PENDING", "PROVISIONING", "STAGING",
    }
)  # fmt: skip
# Zone operation types that explain an end (docs/fakes.md has the references).
OP_PREEMPTED = "compute.instances.preempted"
OP_HOST_ERROR = "compute.instances.hostError"
OP_GUEST_TERMINATE = "compute.instances.guestTerminate"
# Ends that are evidence of neither a wedge nor a lost job: the guest powered itself off (what
# the end-of-life chain does after the final line), or a user stopped or deleted it.
BENIGN_END_OPS = frozenset({OP_GUEST_TERMINATE, "stop", "delete", "suspend"})
TERMINAL_PHASES = frozenset({"done"})


class VerdictKind(enum.Enum):
    """The documented set of verdicts; ``failover`` says what the poller does about each."""

    HEALTHY = "healthy"
    SELF_SHUTDOWN = "self_shutdown"
    SUSPECTED_WEDGE = "suspected_wedge"
    SETUP_FAILED = "setup_failed"
    SETUP_FAILED_INFRA = "setup_failed_infra"  # setup_failed cause=infra: the VM's network failed
    PREEMPTED = "preempted"
    TERMINATED_UNEXPLAINED = "terminated_unexplained"
    WORKLOAD_OK = "workload_ok"
    WORKLOAD_FAILED = "workload_failed"
    # exit rc=0 of a job configured to report its result, without the result: an alarm
    WORKLOAD_UNVERIFIED = "workload_unverified"
    # off without a terminal line read and without evidence of why: an alarm
    ENDED_UNREAD = "ended_unread"
    UNKNOWN = "unknown"

    @property
    def failover(self) -> bool:
        return self in _FAILOVER

    @property
    def alarm(self) -> bool:
        """A verdict a human must look at (the policy says whether it also fails over)."""
        return self in (VerdictKind.WORKLOAD_UNVERIFIED, VerdictKind.ENDED_UNREAD)


_FAILOVER = frozenset(
    {
        VerdictKind.SELF_SHUTDOWN,
        VerdictKind.SETUP_FAILED_INFRA,
        VerdictKind.SUSPECTED_WEDGE,
        VerdictKind.PREEMPTED,
        VerdictKind.TERMINATED_UNEXPLAINED,
    }
)


@dataclass(frozen=True)
class InstanceState:
    """What the Compute API says about the instance; ``status`` None = not known (a saved dump)."""

    status: str | None = None
    spot: bool = False
    # The zone operation types recorded for this instance since the boot began (zoneOperations
    # .list); None = not looked up (a saved dump, or the poller has not asked yet).
    end_ops: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Policy:
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # What to do about the alarms (docs/poller.md, "ended_unread"): default no failover, since
    # a job that may have finished must not run twice (a duplicate costs GPU hours).
    ended_unread_failover: bool = False
    unverified_failover: bool = False

    def __post_init__(self) -> None:
        if not self.drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s!r}")


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    reason: str
    boot: str | None = None  # the boot the verdict is about (None: no line of ours at all)
    evidence: tuple[str, ...] = ()  # the deciding lines (encoded) and observations
    policy_failover: bool = False  # an alarm the policy fails over (or a recorded decision)

    @property
    def failover(self) -> bool:
        return self.kind.failover or self.policy_failover

    @property
    def alarm(self) -> bool:
        return self.kind.alarm


def current_boot(events: Sequence[Event]) -> str | None:
    """The boot running now: the one whose earliest line carries the latest (signed) time.

    Not "the boot of the most recent line": a line replayed from an earlier boot arrives last
    but keeps its own boot's time, which the replayer cannot change without the key. Ties go to
    the boot seen first later in the stream.
    """
    first: dict[str, tuple[int, int]] = {}
    for i, e in enumerate(events):
        t, pos = first.get(e.boot, (e.ts_ms, i))
        first[e.boot] = (min(t, e.ts_ms), pos)
    if not first:
        return None
    return max(first, key=lambda b: first[b])


def latest_boot_events(events: Sequence[Event], boot: str | None = None) -> list[Event]:
    """The events of ``boot`` (default: :func:`current_boot`), sorted by ``seq``."""
    boot = boot or current_boot(events)
    return sorted((e for e in events if e.boot == boot), key=lambda e: e.seq)


def terminal_kind(ev: Event, reported_fail: bool = False) -> VerdictKind | None:
    """The verdict a terminal event decides (rows 1-5), or None for any other event."""
    name = ev.event
    if name == vocab.SETUP_FAILED:
        infra = ev.get("cause") == "infra"
        return VerdictKind.SETUP_FAILED_INFRA if infra else VerdictKind.SETUP_FAILED
    if name == vocab.SHUTDOWN:
        return VerdictKind.SELF_SHUTDOWN
    if name == vocab.PREEMPTED:
        return VerdictKind.PREEMPTED
    if name == vocab.EXIT:
        if ev.get("rc") != "0" or reported_fail:
            return VerdictKind.WORKLOAD_FAILED
        if ev.get("result") == vocab.EXIT_RESULT_MISSING:
            return VerdictKind.WORKLOAD_UNVERIFIED
        return VerdictKind.WORKLOAD_OK
    if name == vocab.PHASE and ev.get("ph") in TERMINAL_PHASES:
        return VerdictKind.WORKLOAD_OK
    return None


def _describe(kind: VerdictKind, ev: Event) -> str:
    f = ev.fields_dict
    if kind is VerdictKind.SETUP_FAILED_INFRA:
        return (
            f"bootstrap failed at step {f.get('step', '?')} ({f.get('reason', '?')}, "
            f"rc {f.get('rc', '?')}, cause infra): the network, DNS or the package source never "
            "came up, the job never ran; running it elsewhere is safe"
        )
    if kind is VerdictKind.SETUP_FAILED:
        return (
            f"bootstrap failed at step {f.get('step', '?')} ({f.get('reason', '?')}, "
            f"rc {f.get('rc', '?')}): the job itself is broken, failing over would repeat it"
        )
    if kind is VerdictKind.SELF_SHUTDOWN:
        return (
            f"the agent shut the VM down (reason {f.get('reason', '?')}, rung "
            f"{f.get('rung', '?')}): the job is not running anywhere"
        )
    if kind is VerdictKind.PREEMPTED:
        detail = " ".join(f"{k}={v}" for k, v in ev.fields) or "no details"
        return f"the agent saw a preemption notice ({detail})"
    if ev.event == vocab.PHASE:
        return "the job reported phase done"
    if kind is VerdictKind.WORKLOAD_UNVERIFIED:
        return (
            "ALARM: the workload exited with rc 0 but never reported the result it was "
            "configured to report (its last line may be lost): not verified"
        )
    if kind is VerdictKind.WORKLOAD_OK:
        return "the workload exited with rc 0"
    if ev.get("rc") == "0":
        return "the workload exited with rc 0 after reporting result fail"
    return f"the workload exited with rc {f.get('rc', '?')} signal {f.get('sig', '-')}"


def _last_phase(events: Sequence[Event]) -> str | None:
    for ev in reversed(events):
        if ev.event in (vocab.PHASE, vocab.TICK, vocab.HEARTBEAT):
            ph = ev.get("ph")
            if ph and ph != "-":
                return ph
    return None


def decide(
    events: Sequence[Event],
    instance: InstanceState,
    now: float,
    policy: Policy,
    *,
    received_s: float | None = None,
    boot: str | None = None,
) -> Verdict:
    """Decide what the poller does about one VM.

    ``events``: authenticated events in stream order (several boots allowed); ``boot``: the
    current boot (default :func:`current_boot`); ``now`` and ``received_s`` (when the reader
    first received the current boot's newest line) on the reader's own clock, in seconds since
    the epoch. Silence is ``now - received_s``, never measured with the guest's timestamps;
    without ``received_s`` there is no measure of silence and no wedge is suspected.
    """
    mine = latest_boot_events(events, boot)
    boot = mine[0].boot if mine else None
    status = instance.status
    status_ev = f"status={status or 'unknown'}" + (" spot" if instance.spot else "")

    # Row 1-5: the first terminal event of the latest boot.
    reported_fail = False
    for ev in mine:
        if ev.event == vocab.RESULT:
            reported_fail = ev.get("status") == vocab.RESULT_FAIL
        kind = terminal_kind(ev, reported_fail)
        if kind is not None:
            pf = kind is VerdictKind.WORKLOAD_UNVERIFIED and policy.unverified_failover
            return Verdict(kind, _describe(kind, ev), boot, (ev.render(), status_ev), pf)

    # Row 6-7: no terminal line and the instance is off (or gone): evidence, never a guess.
    if status in OFF_STATES:
        return _ended(mine, instance, status, status_ev, boot, policy)

    # Row 8: in transition, or not started: the next poll sees where it lands.
    if status in TRANSITIONAL_STATES:
        reason = f"instance is {status}: deciding on a later poll"
        return Verdict(VerdictKind.UNKNOWN, reason, boot, (status_ev,))
    if status is not None and status not in INSTANCE_STATUSES:
        reason = f"instance status {status!r} is not in the documented enum: no verdict"
        return Verdict(VerdictKind.UNKNOWN, reason, boot, (status_ev,))

    # Row 9: nothing of ours yet.
    if not mine:
        return Verdict(
            VerdictKind.UNKNOWN,
            "no protocol line yet (booting, or agent not installed)",
            None,
            (status_ev,),
        )

    last = mine[-1]
    silent_s = max(0.0, now - received_s) if received_s is not None else 0.0
    phase = _last_phase(mine)
    lifecycle = [e for e in mine if e.event in (vocab.START, vocab.STOP)]
    agent_stopped = bool(lifecycle) and lifecycle[-1].event == vocab.STOP
    evidence = (last.render(), status_ev, f"silent={silent_s:.0f}s", f"phase={phase or 'unknown'}")

    if silent_s > policy.drain_timeout_s:
        # Row 10: the agent stopped cleanly (service stopped by an operator): no evidence.
        if agent_stopped:
            return Verdict(
                VerdictKind.UNKNOWN,
                f"agent stopped cleanly and silent for {silent_s:.0f}s: no evidence either way",
                boot,
                evidence,
            )
        # Row 11: silent in a non-terminal phase past the drain timeout.
        return Verdict(
            VerdictKind.SUSPECTED_WEDGE,
            f"no line for {silent_s:.0f}s (drain timeout {policy.drain_timeout_s:.0f}s) in phase "
            f"{phase or 'unknown'}: suspected wedge the agent could not report",
            boot,
            evidence,
        )

    # Row 12: alive.
    rung = last.get("rung")
    extra = f", ladder at {rung}" if rung and not rung.startswith("0/") else ""
    dry = [e for e in mine if e.event == vocab.DRY_RUN_SHUTDOWN and not e.get("rep")]
    if dry:  # shown, never a failover: the VM was not shut down
        extra += f", {len(dry)} dry-run shutdown decision(s), no action taken"
    return Verdict(
        VerdictKind.HEALTHY,
        f"last line {silent_s:.0f}s ago in phase {phase or 'unknown'}{extra}",
        boot,
        evidence,
    )


def _ended(
    mine: Sequence[Event],
    instance: InstanceState,
    status: str,
    status_ev: str,
    boot: str | None,
    policy: Policy,
) -> Verdict:
    """Off without a terminal line read: decide on the zone operations, or raise the alarm."""
    tail: tuple[str, ...] = (mine[-1].render(),) if mine else ()
    ops = instance.end_ops
    seen = f"operations={','.join(ops) or 'none'}" if ops is not None else "operations=unknown"
    evidence = (status_ev, seen, *tail)
    if ops is not None and OP_PREEMPTED in ops:
        reason = f"instance is {status}: GCE preempted it ({OP_PREEMPTED})"
        return Verdict(VerdictKind.PREEMPTED, reason, boot, evidence)
    if ops is not None and OP_HOST_ERROR in ops:
        reason = f"instance is {status}: its host failed ({OP_HOST_ERROR}), the job was killed"
        return Verdict(VerdictKind.TERMINATED_UNEXPLAINED, reason, boot, evidence)
    benign = sorted(set(ops or ()) & BENIGN_END_OPS)
    why = (
        f"ended by {', '.join(benign)} (not evidence of a wedge)"
        if benign
        else "no operation explains it"
        if ops is not None
        else "its operations were not looked up"
    )
    action = "failing over by policy" if policy.ended_unread_failover else "no failover"
    reason = (
        f"ALARM: instance is {status} and its last line read is not terminal; {why}: the job "
        f"may have finished after the last read ({action})"
    )
    return Verdict(VerdictKind.ENDED_UNREAD, reason, boot, evidence, policy.ended_unread_failover)
