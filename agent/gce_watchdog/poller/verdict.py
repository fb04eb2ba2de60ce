"""The poller's decision: a pure function of (events, instance state, now, policy).

No clock, no I/O. ``docs/poller.md`` has the decision table with the reason for every row; the
rules below are in the same order. In short:

1. Only authenticated events reach this module (``wire.protocol``: a line whose signature does
   not verify under the pinned key is forged and never decides), and only the current boot's
   count: the caller's ``boot`` (``Timeline.latest_boot``), else :func:`current_boot`, both by
   the one rule of ``poller/boots.py`` (the highest boot counter; an earlier boot's shutdown
   says nothing about the VM that is running now, and a line replayed from it cannot make it
   current again).
2. The first terminal event of that boot (by ``seq``) decides: ``setup_failed``, ``shutdown``,
   ``preempted``, ``exit`` (rc 0 or not) and ``phase ph=done``. First, because what follows a
   terminal event is its consequence (a ladder shutdown kills the workload, which then logs a
   signal exit), never new information about the job. An ``exit`` killed by SIGTERM or SIGKILL
   in a boot that GCE ended (a preemption, a host error or host maintenance among the zone
   operations) is the guest shutdown's consequence too: that stop decides, as in rule 3.
   A GPU fault (a signed ``gpu_fault`` line, or ``memory_gpu st=lost``: every GPU lost) before
   the first terminal event, or without one, decides ``gpu_fault`` unless the job's own success
   follows it (the job finished: never run it twice); the policy fails it over or only reports
   it. ``gpu_event`` and ``gpu_stall`` never decide: they are shown in the evidence.
   A stuck job (a signed ``job_stuck`` line: no progress for its window) before the first
   terminal event, or without one, decides ``job_stuck`` the same way (the terminal ``exit``
   that follows, a signal death during the agent's end of life, is its consequence); a GPU
   fault before the terminal event explains it and decides instead, unless the policy only
   reports GPU faults.
3. Without a terminal event, the instance status decides. Off (TERMINATED, STOPPED, SUSPENDED,
   or gone): the poller never guesses; the zone operations of the instance decide (a
   ``compute.instances.preempted`` one: preempted; ``compute.instances.hostError``: host_error;
   ``compute.instances.terminateOnHostMaintenance``: host_maintenance, the agent's signed
   ``maintenance`` line corroborating it where present), and without such evidence the verdict
   is ``ended_unread``, an alarm that fails over only if the policy says so (the job may have
   finished after the last read). A planned stop fails over, or by policy waits for GCE's
   automatic restart. In transition or not started (STOPPING, PENDING_STOP, DEPROVISIONING,
   PENDING, PROVISIONING, ...): wait. A status outside the documented enum: no verdict.
4. Running (or unknown, e.g. a saved dump) and silent for longer than the drain timeout while
   in a non-terminal phase: a suspected wedge the agent could not even report, unless the VM is
   back from a planned stop the policy waits for (silence counted from its return). Otherwise
   healthy. Silence is measured on the reader's clock from when it received the boot's newest
   line.
5. Beside any verdict, alarms that change neither it nor its failover: an ``exit`` line of the
   boot that says ``idle=busy`` (the GPUs not released after the job) is ``idle_busy``, said
   first in the reason and kept in the evidence as ``alarm=idle_busy``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gce_watchdog.poller import boots
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
OP_HOST_MAINTENANCE = "compute.instances.terminateOnHostMaintenance"
OP_GUEST_TERMINATE = "compute.instances.guestTerminate"
# Ends that are evidence of neither a wedge nor a lost job: the guest powered itself off (what
# the end-of-life chain does after the final line), or a user stopped or deleted it.
BENIGN_END_OPS = frozenset({OP_GUEST_TERMINATE, "stop", "delete", "suspend"})
TERMINAL_PHASES = frozenset({"done"})
# The signals a guest shutdown kills the job with: systemd stops the start-up script's unit with
# SIGTERM (KillSignal=, the default) and SIGKILL once TimeoutStopSec has passed (systemd.kill(5));
# ``exec`` writes the signal's name (``exit rc=- sig=SIGTERM``, docs/bootstrap.md).
STOP_SIGNALS = frozenset({"SIGTERM", "SIGKILL"})
# The agent's `maintenance` line that announces a planned stop (instance/maintenance-event,
# Compute Engine docs "Get notice of host maintenance"): corroboration, never a verdict alone (the
# job may finish within the hour of notice, and its final line may be the one never read).
MAINTENANCE_TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"
# GPU lines shown in the evidence of every verdict (they never decide): the boot's most recent
# 3, enough to see what preceded a verdict, bounded so that a stream of application Xids cannot
# grow the evidence the ledger records with a decision.
GPU_EVIDENCE_LINES = 3
_GPU_SHOWN = frozenset({vocab.GPU_EVENT, vocab.GPU_STALL})
# Alarms beside a verdict (docs/poller.md, "Alarms beside a verdict"): they change neither the
# verdict nor its failover, and are kept as observations ``alarm=NAME`` in the evidence, so the
# ledger records them with a decision's evidence and the decisions view reads them back.
ALARM_PREFIX = "alarm="
# The job's ``exit`` line says ``idle=busy``: a process still held a GPU, or its memory was not
# back, after the job ended (docs/job-progress.md, "The GPUs are released at the end").
ALARM_IDLE_BUSY = "idle_busy"


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
    # GCE stopped it for host maintenance (compute.instances.terminateOnHostMaintenance)
    HOST_MAINTENANCE = "host_maintenance"
    HOST_ERROR = "host_error"  # its host failed (compute.instances.hostError)
    # a signed gpu_fault line (or memory_gpu st=lost): a GPU is gone, the job cannot go on
    GPU_FAULT = "gpu_fault"
    # a signed job_stuck line: the job made no progress for its window (docs/job-progress.md)
    JOB_STUCK = "job_stuck"
    UNKNOWN = "unknown"

    @property
    def failover(self) -> bool:
        """Fails over whatever the policy says (``POLICY_KINDS`` fail over through
        ``Verdict.policy_failover``: by default, see ``Policy``)."""
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
# Kinds that fail over under the default policy through ``Verdict.policy_failover`` (their
# ``kind.failover`` is False: a policy may wait or only report instead).
POLICY_KINDS = frozenset(
    {
        VerdictKind.HOST_MAINTENANCE,
        VerdictKind.HOST_ERROR,
        VerdictKind.GPU_FAULT,
        VerdictKind.JOB_STUCK,
    }
)
# Planned stops by operation type, host error first. These kinds, and GPU_FAULT, fail over
# through ``Verdict.policy_failover``: by default, unless the policy waits for GCE's restart
# (planned stops) or only reports (GPU faults).
PLANNED_STOPS = {
    OP_HOST_ERROR: VerdictKind.HOST_ERROR,
    OP_HOST_MAINTENANCE: VerdictKind.HOST_MAINTENANCE,
}


@dataclass(frozen=True)
class InstanceState:
    """What the Compute API says about the instance; ``status`` None = not known (a saved dump)."""

    status: str | None = None
    spot: bool = False
    # The zone operation types recorded for this instance since the boot began (zoneOperations
    # .list); None = not looked up (a saved dump, or the poller has not asked yet).
    end_ops: tuple[str, ...] | None = None
    # When the poller first saw the instance running again after a planned stop it waits for
    # (its own clock); None: not seen back, or not known.
    back_s: float | None = None


@dataclass(frozen=True)
class Policy:
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # What to do about the alarms (docs/poller.md, "ended_unread"): default no failover, since
    # a job that may have finished must not run twice (a duplicate costs GPU hours).
    ended_unread_failover: bool = False
    unverified_failover: bool = False
    # A planned stop (host_maintenance, host_error): wait for GCE's automatic restart instead of
    # failing over (docs/poller.md, "Planned stops"); default: fail over.
    planned_stop_wait: bool = False
    # gpu_fault: an alarm only ("report"), no failover; default: fail over.
    gpu_fault_report: bool = False
    # job_stuck: an alarm only ("report"), no failover; default: fail over.
    job_stuck_report: bool = False

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
    def reported_only(self) -> bool:
        """A GPU fault or a stuck job the policy only reports (``--on-gpu-fault report``,
        ``--on-job-stuck report``): no failover."""
        reported = self.kind in (VerdictKind.GPU_FAULT, VerdictKind.JOB_STUCK)
        return reported and not self.failover

    @property
    def alarms(self) -> tuple[str, ...]:
        """The alarms beside the verdict (``ALARM_IDLE_BUSY``), from its evidence."""
        return alarms_of(self.evidence)

    @property
    def alarm(self) -> bool:
        # a GPU fault the policy only reports is an alarm: a human decides
        return self.kind.alarm or self.reported_only or bool(self.alarms)


def alarms_of(evidence: Sequence[str]) -> tuple[str, ...]:
    """The alarms recorded in a verdict's (or a decision's) evidence, in order."""
    return tuple(e[len(ALARM_PREFIX) :] for e in evidence if e.startswith(ALARM_PREFIX))


def current_boot(events: Sequence[Event]) -> str | None:
    """The boot running now among ``events`` (stream order): the one rule of
    :func:`gce_watchdog.poller.boots.order` (the highest boot counter; without counters, the
    stream order), on the boots as these events show them (no ledger record)."""
    return boots.order(boots.seen_of(events)).current


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


def killed_by_signal(ev: Event) -> bool:
    """An ``exit`` line of a workload killed by a signal of a guest shutdown (``STOP_SIGNALS``)."""
    return ev.event == vocab.EXIT and ev.get("sig") in STOP_SIGNALS


def first_terminal(events: Sequence[Event]) -> Event | None:
    """The first terminal event of one boot's events (sorted by ``seq``), or None."""
    reported_fail = False
    for ev in events:
        if ev.event == vocab.RESULT:
            reported_fail = ev.get("status") == vocab.RESULT_FAIL
        if terminal_kind(ev, reported_fail) is not None:
            return ev
    return None


def gce_stop(ops: tuple[str, ...] | None) -> tuple[str, VerdictKind] | None:
    """The stop by Compute Engine among the operations: (operation type, verdict); a
    preemption first, then a host error, then host maintenance."""
    if ops is not None and OP_PREEMPTED in ops:
        return OP_PREEMPTED, VerdictKind.PREEMPTED
    return _planned_stop(ops)


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
    received_known: bool = True,
) -> Verdict:
    """Decide what the poller does about one VM.

    ``events``: authenticated events in stream order (several boots allowed); ``boot``: the
    current boot (default :func:`current_boot`); ``now`` and ``received_s`` (when the reader
    first received the current boot's newest line) on the reader's own clock, in seconds since
    the epoch. Silence is ``now - received_s``, never measured with the guest's timestamps;
    without ``received_s`` there is no measure of silence and no wedge is suspected.
    ``received_known`` False: that line was found by a reader's first read with no record of
    the boot (it may be hours old): never ``healthy`` from it, ``unknown`` until a newer line
    arrives, and a suspected wedge once the drain timeout has passed since ``received_s``.
    """
    mine = latest_boot_events(events, boot)
    boot = mine[0].boot if mine else None
    status = instance.status
    status_ev = f"status={status or 'unknown'}" + (" spot" if instance.spot else "")
    term, v = _decide(mine, instance, now, policy, received_s, boot, status_ev)
    if v.kind is VerdictKind.HEALTHY and not received_known:
        v = _age_unknown(v, now, policy, received_s)
    v = _stuck(mine, term, v, policy, boot, status_ev)
    gpu = tuple(e.render() for e in mine if e.event in _GPU_SHOWN)[-GPU_EVIDENCE_LINES:]
    fault = gpu_fault_event(mine)
    if fault is not None and (term is None or fault.seq < term.seq):
        shown = (fault.render(), *gpu)
        if _stands(v, policy.gpu_fault_report):
            return _released(mine, replace(v, evidence=(*v.evidence, *shown)))
        reason = _gpu_reason(fault, policy)
        evidence = (*shown, status_ev)
        v = Verdict(VerdictKind.GPU_FAULT, reason, boot, evidence, not policy.gpu_fault_report)
        return _released(mine, v)
    return _released(mine, replace(v, evidence=(*v.evidence, *gpu)) if gpu else v)


def gpu_busy_exit(events: Sequence[Event]) -> Event | None:
    """The first ``exit`` line of one boot's events that says ``idle=busy``, or None."""
    return next(
        (e for e in events if e.event == vocab.EXIT and e.get("idle") == vocab.EXIT_IDLE_BUSY),
        None,
    )


def _released(mine: Sequence[Event], v: Verdict) -> Verdict:
    """The verdict with the alarm ``idle_busy`` where the job's exit line says ``idle=busy``:
    the reason says it first and the line is in the evidence; the verdict and its failover are
    unchanged (a GPU held after the job is the next job's and the bill's problem, not the
    finished job's: never a reason to run it again)."""
    busy = gpu_busy_exit(mine)
    if busy is None:
        return v
    shown = busy.render()
    evidence = v.evidence if shown in v.evidence else (*v.evidence, shown)
    why = busy.text.split("GPUs busy: ", 1)[-1] if busy.text else "no detail"
    reason = f"ALARM: the GPUs were not released when the job ended (idle=busy: {why}); {v.reason}"
    return replace(v, reason=reason, evidence=(*evidence, ALARM_PREFIX + ALARM_IDLE_BUSY))


def _age_unknown(v: Verdict, now: float, policy: Policy, received_s: float | None) -> Verdict:
    """Healthy by silence alone, but the newest line came with the reader's first read and no
    record of the boot: how old it is cannot be known (docs/poller.md, "Freshness")."""
    left = policy.drain_timeout_s - (now - received_s) if received_s is not None else 0.0
    reason = (
        "the newest line was found by a first read with no record of this boot: its age is "
        f"not known; healthy once a newer line arrives, a suspected wedge if none comes in "
        f"{max(0.0, left):.0f}s ({v.reason})"
    )
    return replace(v, kind=VerdictKind.UNKNOWN, reason=reason, evidence=(*v.evidence, "fresh=no"))


def _stands(v: Verdict, report: bool) -> bool:
    """The verdict stands over a GPU fault or a stuck job before its end, which is only shown:
    the job finished despite it (never run a finished job twice), or the policy only reports it
    (``report``) and another cause fails over (report mode holds back only its own failover)."""
    return v.kind in (VerdictKind.WORKLOAD_OK, VerdictKind.WORKLOAD_UNVERIFIED) or (
        report and v.failover
    )


def _stuck(
    mine: Sequence[Event],
    term: Event | None,
    v: Verdict,
    policy: Policy,
    boot: str | None,
    status_ev: str,
) -> Verdict:
    """The verdict with the boot's first ``job_stuck`` line applied (the GPU rule after it)."""
    stuck = next((e for e in mine if e.event == vocab.JOB_STUCK), None)
    if stuck is None or (term is not None and term.seq < stuck.seq):
        return v  # none, or after the job's end: the end decides
    shown = stuck.render()
    if _stands(v, policy.job_stuck_report):
        return replace(v, evidence=(*v.evidence, shown))
    f = stuck.fields_dict
    action = (
        "ALARM, reported only (--on-job-stuck report)"
        if policy.job_stuck_report
        else "the agent ends it, the job runs elsewhere"
        if f.get("act") == "end"
        else "the job runs elsewhere"
    )
    reason = (
        f"the job is stuck: no progress for {f.get('quiet', '?')}s (rule {f.get('rule', '?')}, "
        f"last step {f.get('step', '-')}): {action}"
    )
    return Verdict(
        VerdictKind.JOB_STUCK, reason, boot, (shown, status_ev), not policy.job_stuck_report
    )


def gpu_fault_event(events: Sequence[Event]) -> Event | None:
    """The first GPU fault of one boot's events (by ``seq``): a ``gpu_fault`` line, or a
    ``memory_gpu st=lost`` (every GPU stopped answering NVML) that no later ``memory_gpu st=ok``
    took back before it. None: no fault."""
    lost: Event | None = None
    for ev in events:
        if ev.event == vocab.GPU_FAULT:
            return lost or ev
        if ev.event == vocab.MEMORY_GPU:
            st = ev.get("st")
            if st == vocab.MEMORY_GPU_LOST:
                lost = lost or ev
            elif st == vocab.MEMORY_GPU_OK:
                lost = None
    return lost


def _gpu_reason(fault: Event, policy: Policy) -> str:
    action = (
        "ALARM, reported only (--on-gpu-fault report)"
        if policy.gpu_fault_report
        else "the job cannot go on here"
    )
    if fault.event == vocab.MEMORY_GPU:
        return f"every GPU stopped answering NVML (memory_gpu st=lost): {action}"
    f = fault.fields_dict
    return (
        f"GPU {f.get('gpu', '?')} ({f.get('pci', '?')}) failed: Xid {f.get('xid', '-')}, "
        f"confirmed by {f.get('sig', '?')}: {action}"
    )


def _decide(
    mine: Sequence[Event],
    instance: InstanceState,
    now: float,
    policy: Policy,
    received_s: float | None,
    boot: str | None,
    status_ev: str,
) -> tuple[Event | None, Verdict]:
    """Rows 1-12 on one boot's events: (the first terminal event or None, the verdict)."""
    status = instance.status
    # Row 1-5: the first terminal event of the latest boot.
    reported_fail = False
    for ev in mine:
        if ev.event == vocab.RESULT:
            reported_fail = ev.get("status") == vocab.RESULT_FAIL
        kind = terminal_kind(ev, reported_fail)
        if kind is VerdictKind.WORKLOAD_FAILED and killed_by_signal(ev) and not reported_fail:
            # Row 5b: killed as GCE stopped the VM: the stop decides (unless the job had
            # reported its own failure: its word stands, failing over would repeat it)
            stopped = _killed_by_gce_stop(ev, mine, instance, now, policy, boot, status_ev)
            if stopped is not None:
                return ev, stopped
        if kind is not None:
            pf = kind is VerdictKind.WORKLOAD_UNVERIFIED and policy.unverified_failover
            return ev, Verdict(kind, _describe(kind, ev), boot, (ev.render(), status_ev), pf)

    # Row 6-7: no terminal line and the instance is off (or gone): evidence, never a guess.
    if status in OFF_STATES:
        return None, _ended(mine, instance, status, status_ev, boot, policy)

    # Row 8: in transition, or not started: the next poll sees where it lands.
    if status in TRANSITIONAL_STATES:
        reason = f"instance is {status}: deciding on a later poll"
        return None, Verdict(VerdictKind.UNKNOWN, reason, boot, (status_ev,))
    if status is not None and status not in INSTANCE_STATUSES:
        reason = f"instance status {status!r} is not in the documented enum: no verdict"
        return None, Verdict(VerdictKind.UNKNOWN, reason, boot, (status_ev,))

    # Row 9: nothing of ours yet.
    if not mine:
        return None, Verdict(
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
            return None, Verdict(
                VerdictKind.UNKNOWN,
                f"agent stopped cleanly and silent for {silent_s:.0f}s: no evidence either way",
                boot,
                evidence,
            )
        # Row 10b: running again after a planned stop of this boot (the poller looks the
        # operations up for a silent boot): the silence is the stop's, not a wedge.
        back = _back_from_planned_stop(mine, instance, now, policy, boot, evidence)
        if back is not None:
            return None, back
        # Row 11: silent in a non-terminal phase past the drain timeout.
        return None, Verdict(
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
    notice = _maintenance_notice(mine)
    if notice is not None:  # shown: the stop it announces decides once GCE records it
        extra += f", host maintenance announced ({notice.get('event')})"
    return None, Verdict(
        VerdictKind.HEALTHY,
        f"last line {silent_s:.0f}s ago in phase {phase or 'unknown'}{extra}",
        boot,
        evidence,
    )


def _killed_by_gce_stop(
    ev: Event,
    mine: Sequence[Event],
    instance: InstanceState,
    now: float,
    policy: Policy,
    boot: str | None,
    status_ev: str,
) -> Verdict | None:
    """Row 5b: the first terminal line is the workload killed by SIGTERM or SIGKILL and GCE
    recorded a stop of this boot (a preemption, a host error, host maintenance): the signal is
    the guest shutdown's (systemd stops the job as GCE shuts the guest down), so the stop's
    verdict, as for an off VM without a terminal line (row 6b). None: no such stop."""
    stop = gce_stop(instance.end_ops)
    if stop is None:
        return None
    op, kind = stop
    sig = ev.get("sig")
    evidence: tuple[str, ...] = (ev.render(), status_ev)
    if kind is VerdictKind.PREEMPTED:
        reason = f"the workload was killed by {sig} as GCE preempted the VM ({op})"
        return Verdict(kind, reason, boot, (*evidence, _ops_evidence(instance.end_ops)))
    if instance.status == "RUNNING":  # back from the stop (GCE's automatic restart): row 10b
        return _back_from_planned_stop(mine, instance, now, policy, boot, evidence)
    what = "host maintenance" if kind is VerdictKind.HOST_MAINTENANCE else "a host error"
    evidence = (*evidence, _ops_evidence(instance.end_ops))
    notice = _maintenance_notice(mine)
    if notice is not None:  # the agent's signed notice corroborates the operation
        evidence = (*evidence, notice.render())
    reason = (
        f"the workload was killed by {sig} as GCE stopped the VM for {what} ({op}); "
        f"{_planned_action(policy)}"
    )
    return Verdict(kind, reason, boot, evidence, not policy.planned_stop_wait)


def _ops_evidence(ops: tuple[str, ...] | None) -> str:
    return f"operations={','.join(ops) or 'none'}" if ops is not None else "operations=unknown"


def _planned_action(policy: Policy) -> str:
    """What a planned stop's verdict does under the policy (its reason's last words)."""
    if policy.planned_stop_wait:
        return "waiting for GCE's automatic restart (--on-planned-stop wait)"
    return "the job was killed"


def _maintenance_notice(mine: Sequence[Event]) -> Event | None:
    """The boot's latest ``maintenance`` line, if it announces a stop (not a migration)."""
    notes = [e for e in mine if e.event == vocab.MAINTENANCE]
    if notes and notes[-1].get("event") == MAINTENANCE_TERMINATE:
        return notes[-1]
    return None


def _planned_stop(ops: tuple[str, ...] | None) -> tuple[str, VerdictKind] | None:
    """The planned stop among the operations: (operation type, verdict), host error first."""
    for op, kind in PLANNED_STOPS.items():
        if ops is not None and op in ops:
            return op, kind
    return None


def _back_from_planned_stop(
    mine: Sequence[Event],
    instance: InstanceState,
    now: float,
    policy: Policy,
    boot: str | None,
    evidence: tuple[str, ...],
) -> Verdict | None:
    """Running, silent, and a planned stop ended this boot: the stop's verdict (failing over),
    or while the policy waits, wait for the new boot's first line for one drain timeout from
    the VM's return (a restarted VM that never speaks is then a suspected wedge)."""
    planned = _planned_stop(instance.end_ops)
    if planned is None:
        return None
    op, kind = planned
    what = "host maintenance" if kind is VerdictKind.HOST_MAINTENANCE else "a host error"
    evidence = (*evidence, _ops_evidence(instance.end_ops))
    if not policy.planned_stop_wait:
        reason = f"this boot was ended by {what} ({op}): the job was killed"
        return Verdict(kind, reason, boot, evidence, policy_failover=True)
    back_for = max(0.0, now - instance.back_s) if instance.back_s is not None else 0.0
    if back_for > policy.drain_timeout_s:
        return Verdict(
            VerdictKind.SUSPECTED_WEDGE,
            f"running again for {back_for:.0f}s after {what} ({op}) and no line of a new boot "
            f"(drain timeout {policy.drain_timeout_s:.0f}s): suspected wedge",
            boot,
            evidence,
        )
    return Verdict(
        VerdictKind.UNKNOWN,
        f"running again after {what} ({op}) for {back_for:.0f}s: waiting for the new boot's "
        "first line (--on-planned-stop wait)",
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
    evidence = (status_ev, _ops_evidence(ops), *tail)
    if ops is not None and OP_PREEMPTED in ops:
        reason = f"instance is {status}: GCE preempted it ({OP_PREEMPTED})"
        return Verdict(VerdictKind.PREEMPTED, reason, boot, evidence)
    planned = _planned_stop(ops)
    if planned is not None:
        op, kind = planned
        what = (
            "GCE stopped it for host maintenance"
            if kind is VerdictKind.HOST_MAINTENANCE
            else "its host failed"
        )
        notice = _maintenance_notice(mine)
        if notice is not None:  # the agent's signed notice corroborates the operation
            evidence = (*evidence, notice.render())
            what += " (the agent had the notice)"
        reason = f"instance is {status}: {what} ({op}); {_planned_action(policy)}"
        return Verdict(kind, reason, boot, evidence, not policy.planned_stop_wait)
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
