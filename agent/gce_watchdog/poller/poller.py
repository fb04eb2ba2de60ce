"""One poll of one instance: read new serial output, decide, record a failover once, reap.

The wiring of the reader (I/O), the verdict (pure) and the ledger (durable). Errors reading the
API produce an outcome with ``error`` set and **no verdict**: a poller that cannot see the
serial port must not mistake its own blindness for the VM's silence (an API outage would
otherwise look like every VM wedged at once).

The poller never guesses why a VM ended: when it is off and the last line read is not terminal,
it looks for evidence first (the cursors of other pollers, then the instance's zone operations:
one ``zoneOperations.list`` per instance and boot, remembered; then, with ``logging``, the
instance's serial-port log in Cloud Logging: at most ``LOG_TRIES`` ``entries.list`` reads per
instance and boot), and only then takes the verdict, ``ended_unread`` when nothing explains the
end. With ``reap`` it deletes a VM after a failover and
after every end (``workload_ok``, ``workload_failed``, ``setup_failed``) once the VM is off, and
records ``reaped`` only when the delete operation is DONE without ``error``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gce_watchdog.lib import jsontime
from gce_watchdog.lib.compute import (
    AuthError,
    ComputeAPIError,
    ComputeClient,
    InstanceStatus,
    SerialChunk,
)
from gce_watchdog.poller.boots import ALARM_BOOT_REGRESSED
from gce_watchdog.poller.cloudlogging import LoggingClient, LoggingError
from gce_watchdog.poller.cost import BootFacts, boot_facts, gpu_count
from gce_watchdog.poller.ledger import NO_BOOT, Decision, DecisionStore, instance_parts
from gce_watchdog.poller.ledgers import Ledger
from gce_watchdog.poller.reader import Cursor, CursorStore, ReadResult, SerialReader
from gce_watchdog.poller.timeline import Timeline
from gce_watchdog.poller.verdict import (
    ALARM_IDLE_BUSY,
    OFF_STATES,
    PLANNED_STOPS,
    InstanceState,
    Policy,
    Verdict,
    VerdictKind,
    first_terminal,
    gce_stop,
    killed_by_signal,
    latest_boot_events,
)

# The label that names an instance's job for the dispatcher (docs/poller.md, "Decisions as an
# interface"): recorded with each decision as ``job``.
JOB_LABEL = "gce-watchdog-job"
# The verdicts of a job's own ending: reaped with ``reap`` once the VM is off (issue 24).
END_VERDICTS = frozenset(
    {VerdictKind.WORKLOAD_OK, VerdictKind.WORKLOAD_FAILED, VerdictKind.SETUP_FAILED}
)
# Verdicts a peer's cursor can prove (a line it read): they replace an ended_unread.
_LINE_VERDICTS = frozenset(
    {
        VerdictKind.WORKLOAD_OK, VerdictKind.WORKLOAD_FAILED, VerdictKind.WORKLOAD_UNVERIFIED,
        VerdictKind.SETUP_FAILED, VerdictKind.SETUP_FAILED_INFRA, VerdictKind.SELF_SHUTDOWN,
        VerdictKind.PREEMPTED, VerdictKind.GPU_FAULT, VerdictKind.JOB_STUCK,
    }
)  # fmt: skip
# A zone operation counts for the current boot from this long before the boot's first line
# (signed guest time): the guest clock is synced to Google's (metadata server NTP).
OP_SLACK_S = 60.0
SELF_LINK_BASE = "https://www.googleapis.com/compute/v1"  # how GCE writes targetLink
# Cloud Logging reads per (instance id, boot) that ended unread: the export lags the port by
# seconds to minutes (ingestion), so a read that finds nothing is tried on the next polls too.
LOG_TRIES = 3
_END_NS = uuid.UUID("6f1d5b52-43c5-4c1e-9a40-5d0f3f1f2a7e")


def began_after(tl: Timeline, boot: str | None, last_start: float | None) -> bool:
    """Whether ``boot``, as ``tl`` read it, is the boot GCE's last start began: its first
    signed line is not older than ``last_start`` (less OP_SLACK_S: the guest's clock is
    Google's). False when either is not known."""
    info = tl.boots.get(boot) if boot is not None else None
    if info is None or last_start is None:
        return False
    return info.first_ts_ms / 1000 >= last_start - OP_SLACK_S


def _boot_key(instance_id: str, tl: Timeline, last_start: float | None) -> tuple[str, str]:
    """The (instance id, boot) the end's lookups are remembered by; with no line read, the
    boot is named by GCE's last start (a later start is another boot)."""
    if tl.latest_boot is not None:
        return instance_id, tl.latest_boot
    return instance_id, "-" if last_start is None else f"-@{last_start:.3f}"


def _killed(tl: Timeline) -> bool:
    """The current boot's first terminal line is the workload killed by a stop signal."""
    verified = [e for e in tl.events if not e.covered]
    term = first_terminal(latest_boot_events(verified, tl.latest_boot))
    return term is not None and killed_by_signal(term)


def end_request_id(instance_id: str, boot: str) -> str:
    """The requestId of the delete after an end: one per (instance id, boot)."""
    return str(uuid.uuid5(_END_NS, f"end/{instance_id}/{boot}"))


def _op_time(op: dict[str, Any]) -> float | None:
    try:
        return dt.datetime.fromisoformat(str(op.get("insertTime", ""))).timestamp()
    except ValueError:
        return None


# `poll --json`'s version (docs/json.md, schemas/poll.schema.json): 1 since times are RFC 3339
# strings (decided_at was epoch seconds in the unversioned output before it).
POLL_JSON_VERSION = 1


@dataclass(frozen=True)
class PollOutcome:
    """Everything one poll learned about one instance (rendered by the CLI as text or JSON)."""

    instance: str
    instance_id: str
    status: str
    verdict: Verdict | None
    read: ReadResult | None = None
    decision: Decision | None = None
    reaped: str | None = None  # the delete operation's name, or "gone"
    reap_error: str | None = None
    reap_pending: str | None = None  # a delete operation not DONE yet (checked next poll)
    error: str | None = None
    lost_lines: int = 0
    lost_bytes: int = 0
    rejected: int = 0
    forged: int = 0  # lines that did not authenticate: an alarm, never evidence
    forged_reasons: dict[str, int] | None = None
    key_conflict: bool = False
    key_alarm: str = ""  # protocol v3: no pin, an unplaced key, an ephemeral key ("" if none)
    # This poll announces the decision: its claim won, or it took over the announcement of a
    # decision whose claimer died before announcing it (the lease lapsed).
    announce: bool = False
    project: str = ""
    zone: str = ""

    @property
    def action(self) -> str:
        """``failover`` for the one poll that announces a decision; ``already_decided`` after."""
        if self.verdict is None:
            return "error"
        if not self.verdict.failover:
            return "none"
        if self.decision is None:
            return "failover_unrecorded"
        if self.decision.held:
            return "held"
        return "failover" if self.announce else "already_decided"

    def to_json(self) -> dict[str, Any]:
        v = self.verdict
        d = self.decision
        return {
            "v": POLL_JSON_VERSION,
            "instance": self.instance,
            "project": self.project,
            "zone": self.zone,
            "instance_id": self.instance_id,
            "status": self.status,
            "verdict": v.kind.value if v else None,
            "failover": v.failover if v else None,
            "action": self.action,
            "reason": v.reason if v else None,
            "boot": v.boot if v else None,
            "evidence": list(v.evidence) if v else [],
            "decision": None
            if d is None
            else {
                "token": d.token,
                "won": d.won,
                "owner": d.owner,
                "decided_at": jsontime.from_epoch(d.decided_at),
                "request_id": d.request_id,
                "held": d.held,  # the fleet-wide brake holds it: token 0, nothing decided yet
            },
            "alarm": v.alarm if v else False,
            "alarms": list(v.alarms) if v else [],
            "reaped": self.reaped,
            "reap_error": self.reap_error,
            "reap_pending": self.reap_pending,
            "error": self.error,
            "read": None
            if self.read is None
            else {
                "fetched_bytes": self.read.fetched,
                "new_bytes": self.read.new,
                "lost_bytes": self.read.lost,
                "reset": self.read.reset,
                "new_events": self.read.new_events,
            },
            "lost_lines": self.lost_lines,
            "lost_bytes_total": self.lost_bytes,
            "rejected": self.rejected,
            "forged": self.forged,
            "forged_reasons": self.forged_reasons or {},
            "key_conflict": self.key_conflict,
            "key_alarm": self.key_alarm,
        }


def decision_details(
    info: InstanceStatus | None, verdict: Verdict, cost: BootFacts | None = None
) -> dict[str, Any]:
    """What the ledger records beside a decision for the dispatcher: labels, job, evidence, and
    the decided boot's cost facts (None: no line of that boot)."""
    labels = dict(info.labels) if info is not None else {}
    return {
        "labels": labels,
        "job": labels.get(JOB_LABEL),
        "evidence": list(verdict.evidence),
        "cost": None if cost is None else cost.to_json(),
    }


def decided_boot_facts(
    instance_id: str, tl: Timeline, info: InstanceStatus | None, boot: str | None, now: float
) -> BootFacts | None:
    """The decided boot's facts for what it cost (docs/job-progress.md, "What it cost"): its
    lines' times capped by their receipt; for the instance's current boot, GCE's
    ``lastStartTimestamp``, and its ``lastStopTimestamp`` once off (still running: billed as
    far as its last line, a lower bound; the reap ends the rest); the GPUs from
    ``guestAccelerators`` or the machine type. ``now``: no later than the decision."""
    b = tl.boots.get(boot or "")
    if b is None:
        return None
    current = boot == tl.latest_boot and info is not None
    stopped: float | None = None
    if current and info is not None and info.status in OFF_STATES and info.last_stop:
        stopped = min(info.last_stop, now)
    gpus = 0 if info is None else info.accelerators or gpu_count(info.machine_type)
    return boot_facts(
        instance_id,
        [e for e in tl.events if e.boot == boot],
        last_rx=b.last_rx,
        span_ms=(b.first_ts_ms, b.last_ts_ms),
        started=info.last_start if current and info is not None else None,
        stopped=stopped,
        gpus=gpus,
        machine_type="" if info is None else info.machine_type,
    )


class TargetNotFound(ComputeAPIError):
    """The project or the zone does not exist (a typo, a wrong API base): a configuration
    error for every instance, never a verdict."""


class Poller:
    """Polls instances of one project/zone. ``ledger`` None: decide but record nothing."""

    def __init__(
        self,
        client: ComputeClient,
        store: CursorStore,
        project: str,
        zone: str,
        ledger: Ledger | None = None,
        policy: Policy | None = None,
        reap: bool = False,
        clock: Callable[[], float] = time.time,
        peers: Sequence[Path] = (),
        logging: LoggingClient | None = None,
        on_read: Callable[[str, SerialChunk], None] | None = None,
    ) -> None:
        self.client = client
        self.reader = SerialReader(
            client,
            store,
            clock,
            pins=None if ledger is None else ledger.pins,
            freshness=None if ledger is None else ledger.freshness,
            on_read=on_read,
        )
        self.project = project
        self.zone = zone
        self.ledger = ledger
        self.decisions: DecisionStore | None = None if ledger is None else ledger.decisions
        self.policy = policy or Policy()
        self.reap = reap
        self.clock = clock
        self.peers = tuple(peers)  # other pollers' cursor dirs (read only): evidence of an end
        # (instance id, boot) -> the zone operation types found for that boot's end
        self._end_ops: dict[tuple[str, str], tuple[str, ...]] = {}
        self.logging = logging  # None: no Cloud Logging evidence (--logging-evidence)
        # (instance id, boot) -> Cloud Logging reads made for that boot's end
        self._log_tries: dict[tuple[str, str], int] = {}
        # (instance id, boot) -> the name of our delete of an ended job's VM, not DONE yet
        self._reaping: dict[tuple[str, str], str] = {}
        # (instance id, boot) -> when this poller first saw the VM running again after a planned
        # stop of that boot it waits for (--on-planned-stop wait)
        self._back: dict[tuple[str, str], float] = {}

    def poll(
        self, name: str, known: InstanceStatus | None = None, gone: bool = False
    ) -> PollOutcome:
        """Poll one instance. Raises AuthError (affects every instance); other errors are
        reported in the outcome. ``known``: the instance as a list call just returned it (fleet
        discovery), which saves the GET; ``gone``: a GET just answered 404."""
        out = self._poll(name, known, gone)
        return dataclasses.replace(out, project=self.project, zone=self.zone)

    def _settled_cursor(self, p: str, z: str, name: str) -> Cursor:
        """The instance's cursor after its settle: lines a flood delayed are checked even if no
        byte follows; kept when that changed something, so the next poll goes on from here (a
        VM that is off serves no byte, and no read saves the cursor)."""
        cur = self.reader.cursor(p, z, name)
        waiting = cur.timeline.waiting
        cur.timeline.settle(self.clock())
        if cur.timeline.waiting != waiting:
            self.reader.store.save(p, z, cur)
        return cur

    def _instance_alarm(
        self, name: str, instance_id: str, info: InstanceStatus | None, alarm: str
    ) -> None:
        """An alarm beside the verdict about the instance in the ledger, listed by ``decisions
        alarms`` and counted on ``/metrics`` whether or not the boot failed over:
        ``idle_busy``, the job's GPUs were not released at its end (``exit idle=busy``, issue
        37: a finished job's boot has no decision to carry it); ``boot_regressed``, a boot at or
        below the instance's highest boot counter, not seen before it (a replay or a lost
        counter: poller/boots.py). Raised once; later polls that still see it note
        ``seen_at``."""
        assert self.decisions is not None
        self.decisions.raise_alarm(
            instance_id,
            alarm,
            self.path(name),
            info.status if info is not None else "MISSING",
            dict(info.labels) if info is not None else {},
            self.clock(),
        )

    def _poll(self, name: str, known: InstanceStatus | None, gone: bool) -> PollOutcome:
        p, z = self.project, self.zone
        try:
            if gone:
                info = None
            else:
                info = known if known is not None else self.client.get_instance(p, z, name)
        except AuthError:
            raise
        except ComputeAPIError as e:
            return PollOutcome(name, "", "", None, error=str(e))
        read = None
        if info is None and not self._ever_seen(name):
            # A 404 for an instance never seen (by this cursor, nor by any poller's ledger) is
            # not "VM gone": the name, the zone or the project is wrong. Never a verdict.
            return PollOutcome(name, "", "", None, error=self._not_found(name))
        if info is not None:
            try:
                read = self.reader.read(p, z, name, info.id)
            except AuthError:
                raise
            except ComputeAPIError as e:
                if e.status == 404:
                    # Deleted between the two calls (another poller reaped it): look again, and
                    # if it is gone, decide as for a missing VM (the ledger knows its decision).
                    with contextlib.suppress(ComputeAPIError):  # else the first answer stands
                        info = self.client.get_instance(p, z, name)
                if info is not None and info.status == "RUNNING":
                    return PollOutcome(name, "", "", None, error=str(e))
                # GCE serves serial output only while the instance runs: a VM that is off (or
                # stopping) answers with an error, which means "no new bytes", not "no verdict".
                # Decide on what was read while it ran (the linger exists for exactly this).
        cur = self._settled_cursor(p, z, name)
        tl = cur.timeline
        state = InstanceState(info.status, info.spot) if info else InstanceState("MISSING")
        instance_id = info.id if info else cur.instance_id
        try:
            verdict = self._judge(name, instance_id, tl, state, info.last_start if info else None)
        except AuthError:
            raise
        except ComputeAPIError as e:  # blind to the evidence: no verdict, retried next poll
            return PollOutcome(name, instance_id, state.status or "", None, error=str(e))
        decision = None
        reaped = reap_error = reap_pending = None
        announce = False
        for alarm in (ALARM_IDLE_BUSY, ALARM_BOOT_REGRESSED):
            if alarm in verdict.alarms and self.decisions is not None and instance_id:
                self._instance_alarm(name, instance_id, info, alarm)
        if verdict.failover and self.decisions is not None:
            decision, announce, (reaped, reap_error, reap_pending) = self._claim(
                name, instance_id, info, verdict, tl
            )
        elif self.reap and verdict.kind in END_VERDICTS and instance_id:
            boot = verdict.boot or NO_BOOT
            ours = info is None and (instance_id, boot) in self._reaping  # our delete, done?
            if ours or self._ended(info, tl):
                reaped, reap_error, reap_pending = self._reap_end(name, instance_id, boot)
        return PollOutcome(
            name,
            instance_id,
            info.status if info else "MISSING",
            verdict,
            read,
            decision,
            reaped,
            reap_error,
            reap_pending,
            lost_lines=tl.lost_lines,
            lost_bytes=tl.lost_bytes,
            rejected=tl.rejected,
            forged=tl.forged,
            forged_reasons=tl.forged_reasons,
            key_conflict=tl.key_conflict,
            key_alarm=tl.key_alarm,
            announce=announce,
        )

    def _claim(
        self,
        name: str,
        instance_id: str,
        info: InstanceStatus | None,
        verdict: Verdict,
        tl: Timeline,
    ) -> tuple[Decision, bool, tuple[str | None, str | None, str | None]]:
        """A failover verdict claimed in the ledger: (the decision that stands, whether its
        announcement is this poll's, its reap as (reaped, reap_error, reap_pending))."""
        assert self.decisions is not None
        key = instance_id or f"name:{name}"
        now = self.clock()
        decision = self.decisions.claim(
            key,
            verdict.boot or NO_BOOT,
            verdict.kind.value,
            verdict.reason,
            self.path(name),
            now,
            decision_details(info, verdict, decided_boot_facts(key, tl, info, verdict.boot, now)),
        )
        # The ledger decides, not the cursor: an existing decision (even one for another key
        # of the same instance) is what this poll reports. Its announcement is ours if we
        # won it, or if its claimer died before announcing and the lease lapsed.
        announce = decision.won or (
            decision.announced_at is None
            and self.decisions.take_announcement(decision.instance_id, decision.boot, now)
        )
        reap: tuple[str | None, str | None, str | None] = (None, None, None)
        if decision.held:
            pass  # the brake holds it: nothing is announced nor reaped until released
        elif self.reap and decision.reaped_at is None:
            reap = self._reap(name, info, decision)
        elif decision.reaped_at is not None:
            reap = (decision.reap_result, None, None)
        return decision, announce, reap

    def _judge(
        self,
        name: str,
        instance_id: str,
        tl: Timeline,
        state: InstanceState,
        last_start: float | None = None,
    ) -> Verdict:
        """The verdict, with the operations read where it needs them (ComputeAPIError: blind).
        ``last_start``: GCE's ``lastStartTimestamp`` of the instance (None: not known)."""
        verdict = tl.judge(state, self.clock(), self.policy)
        if verdict.kind is VerdictKind.ENDED_UNREAD:
            return self._evidence(name, instance_id, tl, state, verdict, last_start)
        if verdict.kind is VerdictKind.SUSPECTED_WEDGE and self.policy.planned_stop_wait:
            return self._back_evidence(name, instance_id, tl, state, verdict)
        if verdict.kind is VerdictKind.WORKLOAD_FAILED and instance_id and _killed(tl):
            return self._killed_evidence(name, instance_id, tl, state, verdict)
        if verdict.reported_only and state.status in OFF_STATES and instance_id:
            # --on-gpu-fault report (--on-job-stuck report) holds back only the GPU's (the
            # stuck job's) own failover: a preemption or a planned stop of the VM after it still
            # decides, so its operations are read too
            state = dataclasses.replace(state, end_ops=self._boot_ops(name, instance_id, tl))
            return tl.judge(state, self.clock(), self.policy)
        return verdict

    def _ever_seen(self, name: str) -> bool:
        """This cursor read the instance, or the ledger holds a decision for it (another
        poller, with another cursor dir, decided and maybe reaped it)."""
        if self.reader.cursor(self.project, self.zone, name).instance_id:
            return True
        return self.decisions is not None and (
            self.decisions.find_instance("", self.path(name)) is not None
        )

    def _not_found(self, name: str) -> str:
        """What does not exist, most general first; raises TargetNotFound for a project or
        zone (every instance is affected)."""
        p, z = self.project, self.zone
        # projects.get and zones.get only sharpen the message: the documented least-privilege
        # role (docs/poller.md) has neither permission, and there a 404 from instances.get is
        # all we know. A 403 from them must not stop the other names (issue 23).
        unchecked = ""
        try:
            if not self.client.scope_exists(p):
                raise TargetNotFound(f"project {p!r} not found (GET projects/{p}: 404)", 404)
            if not self.client.scope_exists(p, z):
                raise TargetNotFound(f"zone {z!r} not found in project {p!r} (404)", 404)
        except AuthError as e:
            if e.status != 403:
                raise
            unchecked = (
                "; the project and zone were not checked (no compute.projects.get/"
                "compute.zones.get permission)"
            )
        return (
            f"instance {name!r} not found in {p}/{z} and never seen by this poller "
            f"(a typo? no verdict){unchecked}"
        )

    def path(self, name: str) -> str:
        """The instance's name as the ledger records it: unique across projects and zones."""
        return f"{self.project}/{self.zone}/{name}"

    def announced(self, out: PollOutcome) -> bool:
        """Call once the outcome of an announcing poll was written (printed and flushed): the
        decision is no longer pending. False if another poller had announced it already."""
        if not out.announce or out.decision is None or self.decisions is None:
            return False
        d = out.decision
        return self.decisions.mark_announced(d.instance_id, d.boot, self.clock())

    def _evidence(
        self,
        name: str,
        instance_id: str,
        tl: Timeline,
        state: InstanceState,
        verdict: Verdict,
        last_start: float | None = None,
    ) -> Verdict:
        """Off, and the last line read is not terminal: what other pollers read, then what
        GCE recorded, decides; the verdict stays ``ended_unread`` only when nothing does.

        A reader that read no line of a VM that is still there (a fresh cursor of a stopped
        VM: GCE serves no output then) does not know which boot ended: a peer's boot, a
        decision or an operation counts only when it belongs to the boot GCE's last start
        (``last_start``) began, never an older boot's (docs/poller.md, "A stopped VM")."""
        now = self.clock()
        unread = verdict.boot is None and state.status != "MISSING"
        for d in self.peers:
            peer = CursorStore(d).load(self.project, self.zone, name)
            if not peer.instance_id or peer.instance_id != instance_id:
                continue
            pv = peer.timeline.judge(state, now, self.policy)
            if unread and not began_after(peer.timeline, pv.boot, last_start):
                continue  # the peer read an older boot: not the one that ended
            if pv.kind in _LINE_VERDICTS and verdict.boot in (None, pv.boot):
                return dataclasses.replace(pv, evidence=(*pv.evidence, f"peer_cursor={d}"))
        if self.decisions is not None:  # another poller decided this boot (and maybe reaped it)
            prior = self.decisions.find_instance(instance_id or f"name:{name}", self.path(name))
            if (
                prior is not None
                and unread
                and (last_start is None or prior.decided_at < last_start)
            ):
                prior = None  # decided before the VM's last start: an older boot's decision
            if prior is not None and verdict.boot in (None, prior.boot, NO_BOOT):
                why = f"{prior.reason} (recorded by {prior.owner})"
                kind = VerdictKind(prior.verdict)
                return Verdict(kind, why, prior.boot, verdict.evidence, policy_failover=True)
        if not instance_id:
            return verdict
        start = last_start if unread else None  # the boot that ended: the one GCE last started
        state = dataclasses.replace(state, end_ops=self._boot_ops(name, instance_id, tl, start))
        verdict = tl.judge(state, now, self.policy)
        if verdict.kind is VerdictKind.ENDED_UNREAD and self.logging is not None:
            return self._log_evidence(instance_id, tl, state, verdict, start, unread)
        return verdict

    def _back_evidence(
        self, name: str, instance_id: str, tl: Timeline, state: InstanceState, verdict: Verdict
    ) -> Verdict:
        """Running and silent while the policy waits for restarts: a planned stop that ended
        this boot (the same one lookup per boot) explains the silence; the VM's return is timed
        from this poll, so a restarted VM that never speaks is a wedge one drain timeout on."""
        if not instance_id or tl.latest_boot is None:
            return verdict
        ops = self._boot_ops(name, instance_id, tl)
        if not any(op in PLANNED_STOPS for op in ops):
            # not remembered: read while running, it says nothing of how this boot ends
            self._end_ops.pop((instance_id, tl.latest_boot), None)
            return verdict
        back_s = self._back.setdefault((instance_id, tl.latest_boot), self.clock())
        state = dataclasses.replace(state, end_ops=ops, back_s=back_s)
        return tl.judge(state, self.clock(), self.policy)

    def _killed_evidence(
        self, name: str, instance_id: str, tl: Timeline, state: InstanceState, verdict: Verdict
    ) -> Verdict:
        """The workload was killed by SIGTERM or SIGKILL: if GCE stopped the VM (a preemption,
        a host error, host maintenance: the same one lookup per boot), that stop decides. An
        answer without such a stop is remembered only once the VM is off: read while it runs,
        the stop may not be recorded yet (one lookup per poll until it is off, which the
        end-of-life chain does within its linger)."""
        if tl.latest_boot is None:
            return verdict
        ops = self._boot_ops(name, instance_id, tl)
        if gce_stop(ops) is None:
            if state.status not in OFF_STATES:
                self._end_ops.pop((instance_id, tl.latest_boot), None)
            return verdict
        back_s = None
        if state.status == "RUNNING" and self.policy.planned_stop_wait:
            back_s = self._back.setdefault((instance_id, tl.latest_boot), self.clock())
        state = dataclasses.replace(state, end_ops=ops, back_s=back_s)
        return tl.judge(state, self.clock(), self.policy)

    def _boot_ops(
        self, name: str, instance_id: str, tl: Timeline, last_start: float | None = None
    ) -> tuple[str, ...]:
        """The zone operation types of this instance since its current boot began: one
        ``zoneOperations.list`` per instance and boot, remembered. ``last_start``: no line was
        read, the boot is the one GCE's last start began (its operations only)."""
        key = _boot_key(instance_id, tl, last_start)
        if key not in self._end_ops:
            since = None
            if tl.latest_boot is not None:
                since = tl.boots[tl.latest_boot].first_ts_ms / 1000 - OP_SLACK_S
            elif last_start is not None:
                since = last_start - OP_SLACK_S
            # Google's sample "List preemption history" filters on targetLink this way
            link = f"{SELF_LINK_BASE}/projects/{self.project}/zones/{self.zone}/instances/{name}"
            flt = f'targetLink = "{link}"'
            ops = self.client.zone_operations(self.project, self.zone, flt)
            found = []
            for op in ops:
                if str(op.get("targetId", "")) != instance_id:
                    continue  # an earlier instance under the same name
                t = _op_time(op)
                if since is not None and (t is None or t < since):
                    continue  # before this boot
                found.append(str(op.get("operationType", "")))
            self._end_ops[key] = tuple(found)
        return self._end_ops[key]

    def _log_evidence(
        self,
        instance_id: str,
        tl: Timeline,
        state: InstanceState,
        verdict: Verdict,
        last_start: float | None = None,
        unread: bool = False,
    ) -> Verdict:
        """The lines Cloud Logging kept after the last read: judged on a copy of the timeline
        (the cursor stays the Compute API's). Any refusal (403 without the permission, 404, an
        outage) is no evidence: the verdict stays ``ended_unread``, never a guess. ``unread``:
        no line was read; only a boot GCE's last start (``last_start``) began may decide."""
        assert self.logging is not None
        key = _boot_key(instance_id, tl, last_start)
        tries = self._log_tries.get(key, 0)
        if tries >= LOG_TRIES:
            return verdict
        self._log_tries[key] = tries + 1
        since = None
        if tl.latest_boot is not None:
            # the newest line read, on the guest's signed clock (synced to Google's)
            since = tl.boots[tl.latest_boot].last_ts_ms / 1000 - OP_SLACK_S
        elif last_start is not None:
            since = last_start - OP_SLACK_S
        try:
            data = self.logging.serial_lines(self.project, instance_id, since)
        except LoggingError as e:
            why = f"cloud_logging=error({e.status or '-'})"
            return dataclasses.replace(verdict, evidence=(*verdict.evidence, why))
        if not data:
            return dataclasses.replace(verdict, evidence=(*verdict.evidence, "cloud_logging=none"))
        copy = Timeline.from_json(tl.to_json())
        copy.feed(data)
        copy.finish()
        copy.settle()
        lv = copy.judge(state, self.clock(), self.policy)
        older = unread and not began_after(copy, lv.boot, last_start)
        if lv.kind in _LINE_VERDICTS and verdict.boot in (None, lv.boot) and not older:
            self._log_tries[key] = LOG_TRIES  # decided: no more reads for this boot
            return dataclasses.replace(lv, evidence=(*lv.evidence, "cloud_logging=line"))
        return dataclasses.replace(verdict, evidence=(*verdict.evidence, "cloud_logging=none"))

    def _ended(self, info: InstanceStatus | None, tl: Timeline) -> bool:
        """The VM of an ended job may be reaped: it is off, or still RUNNING past the drain
        timeout after its last line (its own power-off failed)."""
        if info is None:
            return False  # gone already
        if info.status != "RUNNING":
            return True
        boot = tl.latest_boot
        rx = tl.boots[boot].last_rx if boot is not None else None
        return rx is not None and self.clock() - rx > self.policy.drain_timeout_s

    def _delete(
        self, name: str, request_id: str
    ) -> tuple[dict[str, Any] | None, str | None, str | None]:
        """(operation DONE without error, error, pending operation name); None op = gone."""
        try:
            op = self.client.delete_instance(self.project, self.zone, name, request_id)
        except AuthError as e:
            return None, str(e), None
        except ComputeAPIError as e:
            if e.status == 404:
                return None, None, None
            return None, str(e), None  # the next poll retries with the same requestId
        if op.get("status") != "DONE":
            return None, None, str(op.get("name", "operation"))
        err = op.get("error")
        if err:
            errs = err.get("errors") if isinstance(err, dict) else None
            first = errs[0] if isinstance(errs, list) and errs and isinstance(errs[0], dict) else {}
            code = first.get("code", op.get("httpErrorStatusCode", "?"))
            return (
                None,
                f"delete operation {op.get('name')} failed: {code} {first.get('message', '')}",
                None,
            )
        return op, None, None

    def _reap(
        self, name: str, info: InstanceStatus | None, decision: Decision
    ) -> tuple[str | None, str | None, str | None]:
        assert self.decisions is not None
        if info is None:
            self.decisions.mark_reaped(decision.instance_id, decision.boot, "gone", self.clock())
            return "gone", None, None
        op, err, pending = self._delete(name, decision.request_id)
        if err is not None or pending is not None:
            return None, err, pending
        result = "gone" if op is None else str(op.get("name", "operation"))
        self.decisions.mark_reaped(decision.instance_id, decision.boot, result, self.clock())
        return result, None, None

    def _reap_end(
        self, name: str, instance_id: str, boot: str
    ) -> tuple[str | None, str | None, str | None]:
        """Delete the VM of an ended job (no ledger entry: nothing was decided). The same
        requestId again returns the same operation, also once the VM is gone."""
        key = (instance_id, boot)
        op, err, pending = self._delete(name, end_request_id(instance_id, boot))
        if pending is not None:
            self._reaping[key] = pending
        if err is not None or pending is not None:
            return None, err, pending
        self._reaping.pop(key, None)
        return ("gone" if op is None else str(op.get("name", "operation"))), None, None


def lapsed_announcements(ledger: DecisionStore, now: float) -> list[PollOutcome]:
    """Take over the announcement of every decision whose claimer died before announcing it
    (its lease has lapsed), as outcomes to print, then to mark with ``announced_outcome``.

    A poll of the VM takes such a decision over too, but a VM that is gone (reaped before its
    claimer died) is polled only once more: every loop calls this once per round, so no claimed
    decision stays unannounced.
    """
    outs = []
    for d in ledger.pending_announcements():
        if not ledger.take_announcement(d.instance_id, d.boot, now):
            continue  # its claimer's lease is live, or another poller took it just now
        project, zone, name = instance_parts(d.instance)
        # every recorded decision is a failover (an alarm recorded by policy too)
        verdict = Verdict(VerdictKind(d.verdict), d.reason, d.boot, policy_failover=True)
        outs.append(
            PollOutcome(
                name or d.instance_id,
                d.instance_id,
                "",
                verdict,
                decision=d,
                reaped=d.reap_result,
                announce=True,
                project=project,
                zone=zone,
            )
        )
    return outs


def announced_outcome(ledger: DecisionStore, out: PollOutcome, now: float) -> bool:
    """``Poller.announced`` without a Poller: mark the outcome's decision announced."""
    if not out.announce or out.decision is None:
        return False
    return ledger.mark_announced(out.decision.instance_id, out.decision.boot, now)
