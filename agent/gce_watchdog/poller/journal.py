"""Which of ``poll``'s outcomes are written (``--log``), and the line that sums up a round. Pure.

``--log every`` writes every outcome of every round (what ``poll --json`` always did: about
1 KB per instance per round, 2.8 GB a day for 1,000 VMs at 30 s). ``--log changes`` writes an
outcome only when it says something new about its instance (:func:`is_change`): its first
sight by this process, a verdict or an action different from the last outcome written for it
(or another instance id under the same name), any decision or reap, any alarm, any error. Each
round then ends with one summary line (:func:`summary_text`): how many outcomes of each verdict,
how many written. docs/poller.md, "The journal".

No clock, no I/O, no lock: :class:`Journal` is fed by one thread at a time (``poller/app.py``
holds the lock where several threads emit).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from gce_watchdog.poller.verdict import Verdict

LOG_CHANGES = "changes"
LOG_EVERY = "every"
LOG_MODES = (LOG_CHANGES, LOG_EVERY)
# Instances remembered (what was last written for each); past it the longest unwritten is
# forgotten, and its next outcome is a first sight again (written). Bounds memory under churn.
REMEMBER = 100_000
# The actions that are a decision or its consequence: always written.
DECIDING_ACTIONS = frozenset({"failover", "failover_unrecorded", "held"})
ERROR = "error"  # the summary's name for an outcome without a verdict (the poll failed)


class Outcome(Protocol):
    """What the rule reads of a ``poller.PollOutcome``."""

    @property
    def instance(self) -> str: ...

    @property
    def project(self) -> str: ...

    @property
    def zone(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    @property
    def verdict(self) -> Verdict | None: ...

    @property
    def error(self) -> str | None: ...

    @property
    def announce(self) -> bool: ...

    @property
    def reaped(self) -> str | None: ...

    @property
    def reap_error(self) -> str | None: ...

    @property
    def forged(self) -> int: ...

    @property
    def key_conflict(self) -> bool: ...

    @property
    def key_alarm(self) -> str: ...

    @property
    def action(self) -> str: ...


@dataclass(frozen=True)
class Said:
    """What the last outcome written for one instance said."""

    instance_id: str
    verdict: str | None  # None: an error
    action: str


def said_of(out: Outcome, before: Said | None = None) -> Said:
    """What ``out`` says; an outcome without an id (an error) keeps the id said before."""
    iid = out.instance_id or (before.instance_id if before is not None else "")
    kind = None if out.error or out.verdict is None else out.verdict.kind.value
    return Said(iid, kind, out.action)


def alarm(out: Outcome) -> bool:
    """An alarm: a verdict a human must look at, lines that do not authenticate, a key not
    placed, a failover the fleet-wide brake holds."""
    v = out.verdict
    return bool(
        (v is not None and v.alarm)
        or out.forged
        or out.key_conflict
        or out.key_alarm
        or out.action == "held"
    )


def acted(out: Outcome) -> bool:
    """A decision or its consequence: an announcement, a failover, a hold, a reap."""
    return bool(out.announce or out.action in DECIDING_ACTIONS or out.reaped or out.reap_error)


def kind_of(out: Outcome) -> str:
    """The summary's bucket: the verdict's kind, or ``error``."""
    return ERROR if out.error or out.verdict is None else out.verdict.kind.value


def is_change(before: Said | None, out: Outcome) -> bool:
    """Whether ``--log changes`` writes ``out``, given what was last written for its instance
    (``before``; None: never written by this process)."""
    if before is None or out.error or alarm(out) or acted(out):
        return True
    now = said_of(out, before)
    if now.instance_id != before.instance_id:
        return True  # the name now belongs to another VM
    return (now.verdict, now.action) != (before.verdict, before.action)


@dataclass
class Tally:
    """One round's outcomes: how many of each verdict kind, how many written."""

    kinds: Counter[str] = field(default_factory=Counter)
    written: int = 0

    @property
    def outcomes(self) -> int:
        return sum(self.kinds.values())


class Journal:
    """The ``--log`` filter over one process's outcomes, and each round's tally."""

    def __init__(self, every: bool = False, remember: int = REMEMBER) -> None:
        self.every = every
        self.remember = max(1, remember)
        self.seen: dict[tuple[str, str, str], Said] = {}  # insertion order: least recent first
        self.tally = Tally()

    def admit(self, out: Outcome) -> bool:
        """Count ``out`` in the round; True when it is to be written."""
        self.tally.kinds[kind_of(out)] += 1
        key = (out.project, out.zone, out.instance)
        before = self.seen.get(key)
        if not (self.every or is_change(before, out)):
            return False
        self.tally.written += 1
        self.seen.pop(key, None)  # re-inserted last: the most recently written
        self.seen[key] = said_of(out, before)
        while len(self.seen) > self.remember:
            del self.seen[next(iter(self.seen))]
        return True

    def close_round(self) -> Tally:
        """The round's tally; the next round counts from zero."""
        done, self.tally = self.tally, Tally()
        return done


def summary_text(t: Tally) -> str:
    """``1000 outcome(s): healthy 950, workload_ok 48, error 2; 37 written, 963 unchanged``:
    kinds by count (most first, then by name)."""
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(t.kinds.items(), key=lambda x: (-x[1], x[0])))
    quiet = t.outcomes - t.written
    return f"{t.outcomes} outcome(s): {kinds or 'none'}; {t.written} written, {quiet} unchanged"
