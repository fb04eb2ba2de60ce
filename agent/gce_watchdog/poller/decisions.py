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
left the fleet's label selection while it ran; docs/poller.md, "Untracked VMs").
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from gce_watchdog.lib import jsontime
from gce_watchdog.lib.cli import EX_IOERR, EX_OK, EX_USAGE, CommandError
from gce_watchdog.poller.ledger import (
    DELIVERY_STATES,
    VM_UNTRACKED,
    Decision,
    DecisionStore,
    Hold,
    InstanceAlarm,
)

# The view's version: a field's meaning never changes within a version. 2: the delivery state
# (``delivery``, ``delivery_attempts``, ``delivery_error``); every field of 1 is unchanged.
VERSION = 2
FOLLOW_INTERVAL_S = 1.0  # --follow asks the ledger this often for new decisions


def decision_doc(d: Decision, details: dict[str, Any]) -> dict[str, Any]:
    """The versioned view of one decision (docs/poller.md lists every field)."""
    project, _, rest = d.instance.partition("/")
    zone, sep, name = rest.partition("/")
    if not sep:  # recorded by an older poller: the bare name
        project, zone, name = "", "", d.instance
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
        "labels": dict(details.get("labels") or {}),
        "job": details.get("job"),
        "decided_at": jsontime.from_epoch(d.decided_at),
        "delivery": d.delivery,
        "delivery_attempts": d.delivery_attempts,
        "delivery_error": d.delivery_error,
    }


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


ALARM_METRIC = "gce_watchdog_poller_alarms"
ALARMS = (VM_UNTRACKED,)  # every alarm about a whole instance, each a metric label


def alarm_metrics(alarms: Iterable[InstanceAlarm]) -> str:
    """The raised alarms by kind as Prometheus text (``GET /metrics``; pure)."""
    counts = dict.fromkeys(ALARMS, 0)
    for a in alarms:
        counts[a.alarm] = counts.get(a.alarm, 0) + 1
    lines = [
        f"# HELP {ALARM_METRIC} Alarms raised about whole instances and not cleared"
        " (vm_untracked: left the fleet's label selection while running).",
        f"# TYPE {ALARM_METRIC} gauge",
    ]
    lines += [f'{ALARM_METRIC}{{alarm="{k}"}} {n}' for k, n in sorted(counts.items())]
    return "\n".join(lines) + "\n"


def alarm_doc(a: InstanceAlarm) -> dict[str, Any]:
    """The view of one raised alarm (``decisions alarms``; docs/poller.md)."""
    project, _, rest = a.instance.partition("/")
    zone, _, name = rest.partition("/")
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
    return decision_doc(*rows[0])


def follow(
    ledger: DecisionStore,
    after: int,
    out: Callable[[dict[str, Any]], None],
    stop: threading.Event,
    keep_following: bool,
    interval_s: float = FOLLOW_INTERVAL_S,
) -> int:
    """Hand every decision above ``after`` to ``out`` in token order; with ``keep_following``,
    then wait for new ones until ``stop``. The last token handed over."""
    last = after
    while True:
        rows = ledger.details_after(last)
        for d, details in rows:
            out(decision_doc(d, details))
            last = d.token
        if rows:
            continue  # maybe more than one page
        if not keep_following or stop.wait(interval_s):
            return last


def hold_doc(h: Hold) -> dict[str, Any]:
    project, _, rest = h.instance.partition("/")
    zone, _, name = rest.partition("/")
    return {
        "v": VERSION,
        "instance_id": h.instance_id,
        "project": project,
        "zone": zone,
        "name": name,
        "boot": h.boot,
        "verdict": h.verdict,
        "reason": h.reason,
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
            emit(decision_doc(*rows[0]) if rows else hold_doc(h))
        if unknown:  # each one said above, before the releases' lines
            raise CommandError(EX_USAGE)
        return EX_OK
    except ledger.errors as e:
        raise CommandError(EX_IOERR, f"gce-watchdog decisions: ledger failed: {e}") from None
