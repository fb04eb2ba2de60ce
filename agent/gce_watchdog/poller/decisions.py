"""Decisions as an interface: the ledger's versioned view for dispatchers (docs/poller.md).

``gce-watchdog decisions --after TOKEN [--follow] --json`` prints one JSON object per failover
decision with a token above TOKEN, in token order. Tokens are gap-free and increasing (each claim
takes ``fence.last_token + 1`` under the ledger's claim lock and commits before the next claim can
start), so a reader that remembers the last token it handled and resumes ``--after`` it never
misses a decision nor sees one twice. ``--on-failover`` gets the same object on stdin
(:func:`decision_doc`): one schema for both, versioned by ``v``.

``decisions held`` lists what the fleet-wide brake holds; ``decisions release --all|ID...``
releases it (each release is an ordinary claim, announced by the next round of any poller).
``decisions alarms`` lists the raised alarms about whole instances (``vm_untracked``: a VM that
left the fleet's label selection while it ran; docs/poller.md, "Untracked VMs";
``boot_regressed``: a boot counter at or below the instance's highest, "Boot order").
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from gce_watchdog.lib import jsontime
from gce_watchdog.lib.cli import EX_IOERR, EX_OK, EX_USAGE, CommandError
from gce_watchdog.poller.boots import ALARM_BOOT_REGRESSED
from gce_watchdog.poller.cost import CATEGORIES, BootFacts, Cost, cost_doc, job_cost, with_deletion
from gce_watchdog.poller.ledger import (
    DELIVERY_STATES,
    VM_UNTRACKED,
    Decision,
    DecisionStore,
    Hold,
    InstanceAlarm,
    instance_parts,
)
from gce_watchdog.poller.verdict import ALARM_IDLE_BUSY, alarms_of

# The view's version: a field's meaning never changes within a version. 2: the delivery state
# (``delivery``, ``delivery_attempts``, ``delivery_error``); every field of 1 is unchanged.
# ``alarms`` (the alarms beside the verdict, read from its evidence) is a field added within 2.
VERSION = 2
FOLLOW_INTERVAL_S = 1.0  # --follow asks the ledger this often for new decisions


def cost_facts(d: Decision, details: dict[str, Any]) -> BootFacts | None:
    """The decided boot's cost facts as recorded at the claim, with its reap as its deletion;
    None when the decision has none (an older poller's, or no line of that boot)."""
    raw = details.get("cost")
    if not isinstance(raw, dict):
        return None
    try:
        return with_deletion(BootFacts.from_json(raw), d.reaped_at)
    except (KeyError, TypeError, ValueError):
        return None


def decision_doc(
    d: Decision, details: dict[str, Any], job_total: Cost | None = None
) -> dict[str, Any]:
    """The versioned view of one decision (docs/poller.md lists every field). ``job_total``:
    what its job cost so far (``follow`` knows the earlier decisions); None: null."""
    facts = cost_facts(d, details)
    project, zone, name = instance_parts(d.instance)
    return {
        "v": VERSION,
        "token": d.token,
        "request_id": d.request_id,
        "instance_id": d.instance_id,
        "project": project,
        "zone": zone,
        "name": name,
        "boot": d.boot,
        "verdict": d.verdict,
        "reason": d.reason,
        "evidence": list(details.get("evidence") or []),
        "alarms": list(alarms_of(details.get("evidence") or [])),
        "labels": dict(details.get("labels") or {}),
        "job": details.get("job"),
        "decided_at": jsontime.from_epoch(d.decided_at),
        "delivery": d.delivery,
        "delivery_attempts": d.delivery_attempts,
        "delivery_error": d.delivery_error,
        "cost": None if facts is None else cost_doc(facts),
        "job_cost": None if job_total is None else job_total.to_json(),
    }


class JobCosts:
    """The cost facts of each job's decisions, in token order: a job's total so far is the
    union of its boots' intervals per instance (poller/cost.py), never a boot twice."""

    def __init__(self) -> None:
        self.facts: dict[str, list[BootFacts]] = {}

    def add(self, d: Decision, details: dict[str, Any]) -> Cost | None:
        """Count this decision in its job; the job's total so far (None: no job label)."""
        job = details.get("job")
        if not job:
            return None
        boots = self.facts.setdefault(str(job), [])
        f = cost_facts(d, details)
        if f is not None:
            boots.append(f)
        return job_cost(boots)


def all_rows(
    ledger: DecisionStore, upto: int | None = None
) -> list[tuple[Decision, dict[str, Any]]]:
    """Every decision (with a token up to ``upto``), page by page, in token order."""
    out: list[tuple[Decision, dict[str, Any]]] = []
    last = 0
    while rows := ledger.details_after(last):
        for d, details in rows:
            if upto is not None and d.token > upto:
                return out
            out.append((d, details))
            last = d.token
    return out


COST_METRIC = "gce_watchdog_poller_cost"
_COST_HELP = {
    "billed": "seconds the decided boots' VMs ran (billed)",
    "useful": "seconds of those up to each boot's last progress or result line",
    "ladder": "seconds from the first failing rung (or stall) to the shutdown decision",
    "linger": "seconds from the shutdown decision to the VM off",
    "zombie": "seconds the VMs were off but not yet deleted (until the reap)",
    "gpu": "GPU-seconds: billed seconds times the machine's GPUs",
}


def cost_metrics(rows: Iterable[tuple[Decision, dict[str, Any]]]) -> str:
    """What the ledger's decided boots cost as Prometheus counters (``GET /metrics``; pure):
    per instance the union of its boots' intervals, summed over instances (docs/poller.md)."""
    facts = [f for d, details in rows if (f := cost_facts(d, details)) is not None]
    total = job_cost(facts)
    lines: list[str] = []
    for cat in (*CATEGORIES, "gpu"):
        name = f"{COST_METRIC}_{cat}_seconds_total"
        lines += [
            f"# HELP {name} Decided boots in the ledger: {_COST_HELP[cat]}.",
            f"# TYPE {name} counter",
            f"{name} {getattr(total, cat):.3f}",
        ]
    return "\n".join(lines) + "\n"


DELIVERY_METRIC = "gce_watchdog_poller_decisions"


def delivery_metrics(counts: dict[str, int]) -> str:
    """The decisions by delivery state as Prometheus text (``GET /metrics``; pure)."""
    lines = [
        f"# HELP {DELIVERY_METRIC} Decisions in the ledger by delivery state"
        " (--on-failover, --publish): pending, delivered, failed.",
        f"# TYPE {DELIVERY_METRIC} gauge",
    ]
    lines += [
        f'{DELIVERY_METRIC}{{delivery="{s}"}} {int(counts.get(s, 0))}' for s in DELIVERY_STATES
    ]
    return "\n".join(lines) + "\n"


def poller_metrics(ledger: DecisionStore) -> str:
    """``GET /metrics`` of ``poll --health-port``: the delivery states, the raised alarms by
    kind, then what it cost."""
    return (
        delivery_metrics(ledger.delivery_counts())
        + alarm_metrics(ledger.alarms())
        + cost_metrics(all_rows(ledger))
    )


ALARM_METRIC = "gce_watchdog_poller_alarms"
# every alarm about a whole instance, a label each
ALARMS = (ALARM_BOOT_REGRESSED, ALARM_IDLE_BUSY, VM_UNTRACKED)


def alarm_metrics(alarms: Iterable[InstanceAlarm]) -> str:
    """The raised alarms by kind as Prometheus text (``GET /metrics``; pure)."""
    counts = dict.fromkeys(ALARMS, 0)
    for a in alarms:
        counts[a.alarm] = counts.get(a.alarm, 0) + 1
    lines = [
        f"# HELP {ALARM_METRIC} Alarms raised about whole instances and not cleared"
        " (vm_untracked: left the fleet's label selection while running; idle_busy: a job's"
        " GPUs not released at its end; boot_regressed: a boot counter at or below the"
        " instance's highest, a replay or a lost counter).",
        f"# TYPE {ALARM_METRIC} gauge",
    ]
    lines += [f'{ALARM_METRIC}{{alarm="{k}"}} {n}' for k, n in sorted(counts.items())]
    return "\n".join(lines) + "\n"


def alarm_doc(a: InstanceAlarm) -> dict[str, Any]:
    """The view of one raised alarm (``decisions alarms``; docs/poller.md)."""
    project, zone, name = instance_parts(a.instance)
    return {
        "v": VERSION,
        "alarm": a.alarm,
        "instance_id": a.instance_id,
        "project": project,
        "zone": zone,
        "name": name,
        "status": a.status,
        "labels": dict(a.labels),
        "raised_at": jsontime.from_epoch(a.raised_at),
        "raised_by": a.raised_by,
        "seen_at": jsontime.from_epoch(a.seen_at),
    }


def doc_for(ledger: DecisionStore, token: int) -> dict[str, Any] | None:
    """The view of the decision with this token, or None."""
    rows = ledger.details_after(token - 1, 1)
    if not rows or rows[0][0].token != token:
        return None
    return decision_doc(*rows[0], job_total(ledger, *rows[0]))


def job_total(ledger: DecisionStore, d: Decision, details: dict[str, Any]) -> Cost | None:
    """What the decision's job cost up to it (its decisions with a lower token read first)."""
    if not details.get("job"):
        return None
    jobs = JobCosts()
    for earlier, det in all_rows(ledger, d.token - 1) if d.token > 1 else []:
        if det.get("job") == details.get("job"):
            jobs.add(earlier, det)
    return jobs.add(d, details)


def follow(
    ledger: DecisionStore,
    after: int,
    out: Callable[[dict[str, Any]], None],
    stop: threading.Event,
    keep_following: bool,
    interval_s: float = FOLLOW_INTERVAL_S,
) -> int:
    """Hand every decision above ``after`` to ``out`` in token order; with ``keep_following``,
    then wait for new ones until ``stop``. The last token handed over. Each one's ``job_cost``
    counts every decision of its job up to it, those up to ``after`` included (read first)."""
    jobs = JobCosts()
    for d, details in all_rows(ledger, after) if after > 0 else []:
        jobs.add(d, details)
    last = after
    while True:
        rows = ledger.details_after(last)
        for d, details in rows:
            out(decision_doc(d, details, jobs.add(d, details)))
            last = d.token
        if rows:
            continue  # maybe more than one page
        if not keep_following or stop.wait(interval_s):
            return last


def hold_doc(h: Hold) -> dict[str, Any]:
    project, zone, name = instance_parts(h.instance)
    return {
        "v": VERSION,
        "instance_id": h.instance_id,
        "project": project,
        "zone": zone,
        "name": name,
        "boot": h.boot,
        "verdict": h.verdict,
        "reason": h.reason,
        "alarms": list(alarms_of(h.details.get("evidence") or [])),
        "labels": dict(h.details.get("labels") or {}),
        "job": h.details.get("job"),
        "held_at": jsontime.from_epoch(h.held_at),
    }


def selected(holds: Iterable[Hold], ids: list[str], every: bool) -> tuple[list[Hold], list[str]]:
    """The holds ``release`` names (an instance id, or project/zone/name), and the unknown ids."""
    holds = list(holds)
    if every:
        return holds, []
    picked = [h for h in holds if h.instance_id in ids or h.instance in ids]
    known = {h.instance_id for h in holds} | {h.instance for h in holds}
    return picked, [i for i in ids if i not in known]


def _line(doc: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(doc, sort_keys=True)
    parts = [f"{k}={doc[k]}" for k in ("token", "project", "zone", "name", "boot") if k in doc]
    if "alarm" in doc:  # an alarm about a whole instance
        parts += [f"id={doc['instance_id']}", f"ALARM {doc['alarm']}", f"status={doc['status']}"]
        return " ".join([*parts, f"raised_at={doc['raised_at']}", f"seen_at={doc['seen_at']}"])
    parts += [f"verdict={doc['verdict']}", f"job={doc.get('job') or '-'}"]
    if doc.get("alarms"):
        parts.append(f"alarms={','.join(doc['alarms'])}")
    if "delivery" in doc:  # a decision (a hold has none)
        parts.append(f"delivery={doc['delivery']}/{doc['delivery_attempts']}")
    return " ".join(parts)


def run_decisions(
    ledger: DecisionStore,
    what: str,
    after: int,
    keep_following: bool,
    as_json: bool,
    ids: list[str],
    every: bool,
    stop: threading.Event,
    stdout: TextIO | None = None,
) -> int:
    """``gce-watchdog decisions [list|held|release]``: the exit status. ``stdout``: None is
    ``sys.stdout`` as it is when a line is written."""

    def emit(doc: dict[str, Any]) -> None:
        print(_line(doc, as_json), file=stdout or sys.stdout, flush=True)

    try:
        if what == "list":
            follow(ledger, after, emit, stop, keep_following)
            return EX_OK
        if what == "alarms":
            for a in ledger.alarms():
                emit(alarm_doc(a))
            return EX_OK
        holds = ledger.holds()
        if what == "held":
            for h in holds:
                emit(hold_doc(h))
            return EX_OK
        picked, unknown = selected(holds, ids, every)
        for i in unknown:
            print(f"gce-watchdog decisions: {i!r} is not held", file=sys.stderr)
        for h in picked:
            d = ledger.release(h, by=ledger.owner)
            rows = ledger.details_after(d.token - 1, 1)
            emit(decision_doc(*rows[0], job_total(ledger, *rows[0])) if rows else hold_doc(h))
        if unknown:  # each one said above, before the releases' lines
            raise CommandError(EX_USAGE)
        return EX_OK
    except ledger.errors as e:
        raise CommandError(EX_IOERR, f"gce-watchdog decisions: ledger failed: {e}") from None
