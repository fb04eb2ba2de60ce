"""The decisions store: the first FAILOVER decision for (instance id, boot) wins, durably.

Each claim runs in a transaction that holds the ledger's claim lock (SQLite's ``BEGIN
IMMEDIATE``, PostgreSQL's row lock on ``fence``: :mod:`~gce_watchdog.poller.ledger_db`), so two
pollers cannot both see "no decision yet". The primary key on (instance_id, boot) is a second
line of defence: a duplicate insert fails.

The winner gets a fencing token: an integer that increases with every decision across the whole
ledger. Downstream systems (the dispatcher starting the job elsewhere) can reject any action that
carries a token lower than one they have already seen, which keeps a slow, stale poller from
acting after a newer decision.

Reaping (deleting the instance after a failover) is recorded here too, with a ``requestId`` that
is derived from the decision, so any poller that finds a decision not yet reaped can retry the
delete and GCE treats the retries as one request.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gce_watchdog.poller.ledger_db import SqlDb, locked

if TYPE_CHECKING:
    from gce_watchdog.poller.brake import BrakeRule

# Namespace for requestIds derived from decisions (any fixed UUID works; this one is ours).
_REQUEST_NS = uuid.UUID("6b0f2a4e-8a1d-4c1e-9a55-0d1f3c2b7e11")


# A decision is announced (the poller prints ``action=failover``) by whoever holds its
# announcement lease: the claimer first. Only if the lease runs out unannounced (the claimer died
# between its claim and its announcement) does another poller take it over. The lease covers a
# slow DELETE (--reap runs before the announcement line is printed): 5 attempts of at most 30 s
# read timeout each plus their waits stay under 5 min.
ANNOUNCE_LEASE_S = 300.0

_COLUMNS = (
    "instance_id, boot, token, verdict, reason, instance, owner, decided_at, reaped_at,"
    " reap_result, announced_at, announced_by, delivery_attempts, delivery_error"
)
_NCOLS = 14
# A decision's delivery state (``--on-failover``, ``--publish``; docs/poller.md, "Delivery"):
# announced (every configured delivery succeeded, or none is configured), or not yet: failed
# when its last delivery gave up (the next poll of any poller retries it), else pending.
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
DELIVERY_ERROR_MAX = 2048  # characters of the last error kept (a hook's output tail is 2 KiB)
DELIVERY_STATES = (PENDING, DELIVERED, FAILED)


# One claim of ``claim_many``: (instance id, boot, verdict, reason, instance).
ClaimArgs = tuple[str, str, str, str, str]


@dataclass(frozen=True)
class Decision:
    """A ledger row. ``won`` is True only for the caller whose claim created it."""

    instance_id: str
    boot: str
    token: int
    verdict: str
    reason: str
    instance: str
    owner: str
    decided_at: float
    won: bool
    reaped_at: float | None = None
    reap_result: str | None = None
    announced_at: float | None = None
    announced_by: str | None = None
    # The fleet-wide brake held this failover: nothing was recorded but the hold (token 0, no
    # announcement, no reap) until ``gce-watchdog decisions release`` (docs/poller.md).
    held: bool = False
    # Delivery attempts so far (each --on-failover run, each publish), across polls and
    # pollers, and the last failed delivery's error (None once one succeeded).
    delivery_attempts: int = 0
    delivery_error: str | None = None

    @property
    def delivery(self) -> str:
        """``delivered`` (announced), ``failed`` (its last delivery gave up) or ``pending``."""
        if self.announced_at is not None:
            return DELIVERED
        return FAILED if self.delivery_error is not None else PENDING

    @property
    def request_id(self) -> str:
        """The requestId for reaping this decision's instance: the same for every retry."""
        return str(uuid.uuid5(_REQUEST_NS, f"{self.instance_id}/{self.boot}/{self.token}"))


_COLUMNS_D = ", ".join(f"d.{c.strip()}" for c in _COLUMNS.split(","))


@dataclass(frozen=True)
class Hold:
    """A failover the fleet-wide brake holds (``brake_holds``)."""

    instance_id: str
    boot: str
    verdict: str
    reason: str
    instance: str  # project/zone/name
    details: dict[str, Any]
    held_at: float


def instance_parts(path: str) -> tuple[str, str, str]:
    """``PROJECT/ZONE/NAME`` as the ledger records an instance -> (project, zone, name); a bare
    name (recorded by an older poller) -> ("", "", name). Pure."""
    project, _, rest = path.partition("/")
    zone, sep, name = rest.partition("/")
    return (project, zone, name) if sep else ("", "", path)


VM_UNTRACKED = "vm_untracked"  # left the fleet's label selection while it ran (poller/fleet.py)


@dataclass(frozen=True)
class InstanceAlarm:
    """An alarm about an instance as a whole (``instance_alarms``), raised and not cleared."""

    instance_id: str
    alarm: str
    instance: str  # project/zone/name
    status: str  # the instance's status when last seen
    labels: dict[str, str]
    raised_at: float
    raised_by: str
    seen_at: float


# Keys without a boot: the verdict came from no line of ours ("-"), or without an instance id
# ("name:..."). Such a claim is an opinion about the instance, not about one boot of it.
NO_BOOT = "-"


def _row(row: tuple[object, ...], won: bool = False) -> Decision:
    iid, boot, token, verdict, reason, inst, owner, at, reaped_at, reap_result, ann_at, ann_by = (
        row[:12]
    )
    attempts, error = row[12:_NCOLS]
    return Decision(
        str(iid),
        str(boot),
        int(token),  # type: ignore[call-overload]
        str(verdict),
        str(reason),
        str(inst),
        str(owner),
        float(at),  # type: ignore[arg-type]
        won,
        None if reaped_at is None else float(reaped_at),  # type: ignore[arg-type]
        None if reap_result is None else str(reap_result),
        None if ann_at is None else float(ann_at),  # type: ignore[arg-type]
        None if ann_by is None else str(ann_by),
        delivery_attempts=int(attempts or 0),  # type: ignore[call-overload]
        delivery_error=None if error is None else str(error),
    )


class DecisionStore(Protocol):
    """The decisions (docs/poller.md): claims, their announcement leases, reaps, the brake's
    holds and the dispatcher's view. ``owner`` names this poller in what it writes; ``errors``:
    what a failed ledger raises."""

    brake: BrakeRule | None
    fleet_size: Callable[[], int]

    @property
    def owner(self) -> str: ...

    @property
    def errors(self) -> tuple[type[BaseException], ...]: ...

    def claim(
        self,
        instance_id: str,
        boot: str,
        verdict: str,
        reason: str,
        instance: str = "",
        now: float | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> Decision: ...

    def claim_many(
        self, claims: Sequence[ClaimArgs], now: float | None = None
    ) -> list[Decision]: ...

    def holds(self) -> list[Hold]: ...

    def release(self, hold: Hold, by: str, now: float | None = None) -> Decision: ...

    def details_after(
        self, after: int, limit: int = 500
    ) -> list[tuple[Decision, dict[str, Any]]]: ...

    def find_instance(self, instance_id: str, instance: str = "") -> Decision | None: ...

    def get(self, instance_id: str, boot: str) -> Decision | None: ...

    def take_announcement(self, instance_id: str, boot: str, now: float | None = None) -> bool: ...

    def hold_announcement(self, instance_id: str, boot: str, now: float | None = None) -> bool: ...

    def mark_announced(self, instance_id: str, boot: str, now: float | None = None) -> bool: ...

    def mark_announced_many(
        self, keys: Sequence[tuple[str, str]], now: float | None = None
    ) -> int: ...

    def pending_announcements(self) -> list[Decision]: ...

    def mark_reaped(
        self, instance_id: str, boot: str, result: str, now: float | None = None
    ) -> None: ...

    def all(self) -> list[Decision]: ...

    def record_delivery(
        self, token: int, attempts: int, error: str | None, now: float | None = None
    ) -> None: ...

    def delivery_counts(self) -> dict[str, int]: ...

    def raise_alarm(
        self,
        instance_id: str,
        alarm: str,
        instance: str,
        status: str,
        labels: Mapping[str, str],
        now: float | None = None,
    ) -> bool: ...

    def clear_alarm(
        self, instance_id: str, alarm: str, why: str, now: float | None = None
    ) -> bool: ...

    def alarms(self) -> list[InstanceAlarm]: ...


class SqlDecisions:
    """The decisions over a ledger database (SQLite or PostgreSQL: the backend's ``SqlDb``).

    - ``claim``: one decision per (instance id, boot); the winner gets the next fencing token
      (+1 per decision across the whole ledger, never reused) and the announcement lease.
    - The ledger decides, not the cursor: a claim without boot evidence (boot ``-``) or without an
      instance id (``name:...``), or any claim for an instance whose VM was already reaped, returns
      the instance's existing decision (``won=False``). A poller with a fresh cursor dir that finds
      a reaped VM gone gets ``already_decided``, never a second decision.
    - ``take_announcement`` / ``mark_announced``: a claimed decision is announced by its claimer,
      or, if the claimer died first (its lease ran out), by exactly one later poller.
    """

    # The fleet-wide brake (None: off) and the size of the fleet it is a share of; the poller's
    # loop sets both (``fleet_size`` as an instance attribute).
    brake: BrakeRule | None = None
    fleet_size: Callable[[], int] = staticmethod(lambda: 0)

    def __init__(self, db: SqlDb, announce_lease_s: float = ANNOUNCE_LEASE_S) -> None:
        self.db = db
        self.announce_lease_s = announce_lease_s

    @property
    def owner(self) -> str:
        return self.db.owner

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        return self.db.errors

    @locked
    def claim(
        self,
        instance_id: str,
        boot: str,
        verdict: str,
        reason: str,
        instance: str = "",
        now: float | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> Decision:
        """Record a FAILOVER decision for (instance_id, boot) unless one exists.

        Returns the new decision with ``won=True`` and a fresh fencing token, or the existing one
        with ``won=False`` ("already decided"), whoever and whenever decided it. ``details``
        (``labels``, ``job``, ``evidence``) go in ``decision_details``, and its ``cost`` (the
        boot's facts, poller/cost.py) in ``decision_costs``, in the same transaction.
        With the brake on and its share of the window taken, nothing is decided: the failover is
        held (``held=True``) until released.
        """
        decided_at = time.time() if now is None else now
        try:
            self.db.begin_write()  # inside: a lock timeout here must not leave a transaction open
            d = self._claim(instance_id, boot, verdict, reason, instance, decided_at, details)
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return d

    @locked
    def claim_many(self, claims: Sequence[ClaimArgs], now: float | None = None) -> list[Decision]:
        """``claim`` for several (instance id, boot, verdict, reason, instance) in one
        transaction (a Pub/Sub worker's pull): the claim lock taken once, every decision durable
        at its one commit, each as ``claim`` would have decided it, in order."""
        decided_at = time.time() if now is None else now
        if not claims:
            return []
        try:
            self.db.begin_write()
            out = [self._claim(*c, decided_at, None) for c in claims]
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return out

    def _claim(
        self,
        instance_id: str,
        boot: str,
        verdict: str,
        reason: str,
        instance: str,
        decided_at: float,
        details: Mapping[str, Any] | None,
    ) -> Decision:
        """One claim inside the caller's ``begin_write`` transaction (committed by the caller)."""
        row = self._get(instance_id, boot)
        if row is None:
            row = self._settled(instance_id, boot, instance)
        if row is not None:
            return row
        if self.brake is not None and not self._brake_passes(
            instance_id, boot, verdict, reason, instance, details or {}, decided_at
        ):
            return Decision(
                instance_id, boot, 0, verdict, reason, instance, self.owner, decided_at,
                False, held=True,
            )  # fmt: skip
        (last,) = self.db.exec("SELECT last_token FROM fence WHERE id = 1")[0]
        token = int(last) + 1  # type: ignore[call-overload]
        self.db.exec("UPDATE fence SET last_token = ? WHERE id = 1", (token,))
        self.db.exec(
            "INSERT INTO decisions (instance_id, boot, token, verdict, reason, instance,"
            " owner, decided_at, announce_owner, announce_until)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                instance_id,
                boot,
                token,
                verdict,
                reason,
                instance,
                self.owner,
                decided_at,
                self.owner,
                decided_at + self.announce_lease_s,
            ),
        )
        d = details or {}
        self.db.exec(
            "INSERT INTO decision_details (token, labels, job, evidence) VALUES (?, ?, ?, ?)",
            (
                token,
                json.dumps(dict(d.get("labels") or {}), sort_keys=True),
                d.get("job"),
                json.dumps(list(d.get("evidence") or [])),
            ),
        )
        if isinstance(d.get("cost"), Mapping):
            self.db.exec(
                "INSERT INTO decision_costs (token, facts) VALUES (?, ?)",
                (token, json.dumps(dict(d["cost"]), sort_keys=True)),
            )
        return Decision(
            instance_id, boot, token, verdict, reason, instance, self.owner, decided_at, True
        )

    def _brake_passes(
        self,
        instance_id: str,
        boot: str,
        verdict: str,
        reason: str,
        instance: str,
        details: Mapping[str, Any],
        now: float,
    ) -> bool:
        """Inside the claim's transaction (its lock serialises every claimer): a released hold
        passes; a held one stays held; else the brake's rule over the window's decisions."""
        assert self.brake is not None
        held = self.db.exec(
            "SELECT released_at FROM brake_holds WHERE instance_id = ? AND boot = ?",
            (instance_id, boot),
        )
        if held:
            return held[0][0] is not None
        # released holds do not count: an operator let them through, and a real failover after
        # a release must not be held for it
        ((recent,),) = self.db.exec(
            "SELECT count(*) FROM decisions d WHERE d.decided_at > ? AND NOT EXISTS"
            " (SELECT 1 FROM brake_holds h WHERE h.instance_id = d.instance_id"
            " AND h.boot = d.boot)",
            (now - self.brake.window_s,),
        )
        if self.brake.admits(int(recent), int(self.fleet_size())):  # type: ignore[call-overload]
            return True
        self.db.exec(
            "INSERT INTO brake_holds (instance_id, boot, verdict, reason, instance, details,"
            " held_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                instance_id, boot, verdict, reason, instance,
                json.dumps(dict(details), sort_keys=True, default=list), now,
            ),
        )  # fmt: skip
        return False

    @locked
    def holds(self) -> list[Hold]:
        """The failovers the brake holds now, oldest first: not released, and not decided since
        (by a poller with the brake off)."""
        rows = self.db.exec(
            "SELECT instance_id, boot, verdict, reason, instance, details, held_at"
            " FROM brake_holds h WHERE released_at IS NULL AND NOT EXISTS"
            " (SELECT 1 FROM decisions d WHERE d.instance_id = h.instance_id AND d.boot = h.boot)"
            " ORDER BY held_at, instance_id"
        )
        return [
            Hold(str(a), str(b), str(c), str(d), str(e), json.loads(str(f)), float(g))  # type: ignore[arg-type]
            for a, b, c, d, e, f, g in rows
        ]

    @locked
    def release(self, hold: Hold, by: str, now: float | None = None) -> Decision:
        """Release one held failover: mark it released, then claim it past the brake (two
        transactions: a release that dies between them is claimed by the next poll)."""
        at = time.time() if now is None else now
        self.db.rowcount(
            "UPDATE brake_holds SET released_at = ?, released_by = ?"
            " WHERE instance_id = ? AND boot = ? AND released_at IS NULL",
            (at, by, hold.instance_id, hold.boot),
        )
        return self.claim(
            hold.instance_id, hold.boot, hold.verdict, hold.reason, hold.instance, at,
            hold.details,
        )  # fmt: skip

    @locked
    def details_after(self, after: int, limit: int = 500) -> list[tuple[Decision, dict[str, Any]]]:
        """Decisions with a token above ``after``, in token order, with their details."""
        rows = self.db.exec(
            f"SELECT {_COLUMNS_D}, x.labels, x.job, x.evidence, c.facts"  # noqa: S608
            " FROM decisions d LEFT JOIN decision_details x ON x.token = d.token"
            " LEFT JOIN decision_costs c ON c.token = d.token"
            " WHERE d.token > ? ORDER BY d.token LIMIT ?",
            (after, limit),
        )
        out = []
        for r in rows:
            labels, job, evidence, cost = r[_NCOLS : _NCOLS + 4]
            out.append(
                (
                    _row(r[:_NCOLS]),
                    {
                        "labels": json.loads(str(labels)) if labels is not None else {},
                        "job": None if job is None else str(job),
                        "evidence": json.loads(str(evidence)) if evidence is not None else [],
                        "cost": json.loads(str(cost)) if cost is not None else None,
                    },
                )
            )
        return out

    def _settled(self, instance_id: str, boot: str, instance: str) -> Decision | None:
        """The instance's decision that rules out a new one (see the class docstring)."""
        latest = self.find_instance(instance_id, instance)
        if latest is None:
            return None
        if boot == NO_BOOT or instance_id.startswith("name:") or latest.reaped_at is not None:
            return latest
        return None

    @locked
    def find_instance(self, instance_id: str, instance: str = "") -> Decision | None:
        """The latest decision for this instance, by id, or by name when it has none."""
        if instance_id and not instance_id.startswith("name:"):
            rows = self._select("WHERE instance_id = ? ORDER BY token DESC LIMIT 1", (instance_id,))
        else:
            rows = self._select(
                "WHERE instance = ? OR instance_id = ? ORDER BY token DESC LIMIT 1",
                (instance, instance_id),
            )
        return _row(rows[0]) if rows else None

    @locked
    def get(self, instance_id: str, boot: str) -> Decision | None:
        return self._get(instance_id, boot)

    def _get(self, instance_id: str, boot: str) -> Decision | None:
        rows = self._select("WHERE instance_id = ? AND boot = ?", (instance_id, boot))
        return _row(rows[0]) if rows else None

    @locked
    def take_announcement(self, instance_id: str, boot: str, now: float | None = None) -> bool:
        """Take over announcing a decision nobody announced and whose lease has run out.

        True for exactly one caller per lapse; that caller announces, then ``mark_announced``.
        """
        at = time.time() if now is None else now
        n = self.db.rowcount(
            "UPDATE decisions SET announce_owner = ?, announce_until = ?"
            " WHERE instance_id = ? AND boot = ? AND announced_at IS NULL"
            " AND (announce_until IS NULL OR announce_until <= ?)",
            (self.owner, at + self.announce_lease_s, instance_id, boot, at),
        )
        return n == 1

    @locked
    def hold_announcement(self, instance_id: str, boot: str, now: float | None = None) -> bool:
        """Renew this owner's announcement lease (from now, for ``announce_lease_s``) just before
        a delivery runs: True if the announcement is still pending and this owner's (or lapsed,
        and so taken now); False if another owner holds a live lease or it was announced."""
        at = time.time() if now is None else now
        n = self.db.rowcount(
            "UPDATE decisions SET announce_owner = ?, announce_until = ?"
            " WHERE instance_id = ? AND boot = ? AND announced_at IS NULL"
            " AND (announce_owner = ? OR announce_until IS NULL OR announce_until <= ?)",
            (self.owner, at + self.announce_lease_s, instance_id, boot, self.owner, at),
        )
        return n == 1

    @locked
    def mark_announced(self, instance_id: str, boot: str, now: float | None = None) -> bool:
        """Record that this owner printed the announcement; False if it was announced before."""
        at = time.time() if now is None else now
        n = self.db.rowcount(
            "UPDATE decisions SET announced_at = ?, announced_by = ?"
            " WHERE instance_id = ? AND boot = ? AND announced_at IS NULL",
            (at, self.owner, instance_id, boot),
        )
        return n == 1

    @locked
    def mark_announced_many(self, keys: Sequence[tuple[str, str]], now: float | None = None) -> int:
        """``mark_announced`` for several (instance id, boot) in one transaction (the
        announcements a Pub/Sub worker printed for one pull); how many it marked."""
        at = time.time() if now is None else now
        if not keys:
            return 0
        marked = 0
        try:
            self.db.begin_plain()
            for iid, boot in sorted(set(keys)):
                marked += self.db.rowcount(
                    "UPDATE decisions SET announced_at = ?, announced_by = ?"
                    " WHERE instance_id = ? AND boot = ? AND announced_at IS NULL",
                    (at, self.owner, iid, boot),
                )
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return marked

    @locked
    def pending_announcements(self) -> list[Decision]:
        """Decisions claimed but never announced (their claimer died, or is announcing now)."""
        rows = self._select("WHERE announced_at IS NULL ORDER BY token")
        return [_row(r) for r in rows]

    @locked
    def mark_reaped(
        self, instance_id: str, boot: str, result: str, now: float | None = None
    ) -> None:
        """Record that the instance of this decision was deleted (``result``: operation name)."""
        at = time.time() if now is None else now
        self.db.rowcount(
            "UPDATE decisions SET reaped_at = ?, reap_result = ?"
            " WHERE instance_id = ? AND boot = ?",
            (at, result, instance_id, boot),
        )

    @locked
    def all(self) -> list[Decision]:
        return [_row(r) for r in self._select("ORDER BY token")]

    def _select(self, tail: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        # Only constants are joined here (_COLUMNS and literal clauses); values are parameters.
        return self.db.exec(f"SELECT {_COLUMNS} FROM decisions {tail}", params)  # noqa: S608

    @locked
    def record_delivery(
        self, token: int, attempts: int, error: str | None, now: float | None = None
    ) -> None:
        """Count ``attempts`` more delivery attempts of the decision with this token and keep
        ``error``, the last one's (None: it succeeded; the caller then marks it announced).
        A failure also ends this owner's announcement lease now: the decision is ``failed``,
        and the next poll (or announcement sweep) of any poller takes it over and retries it."""
        at = time.time() if now is None else now
        if error is None:
            self.db.rowcount(
                "UPDATE decisions SET delivery_attempts = delivery_attempts + ?,"
                " delivery_error = NULL WHERE token = ?",
                (attempts, token),
            )
            return
        self.db.rowcount(
            "UPDATE decisions SET delivery_attempts = delivery_attempts + ?, delivery_error = ?,"
            " announce_until = CASE WHEN announce_owner = ? THEN ? ELSE announce_until END"
            " WHERE token = ? AND announced_at IS NULL",
            (attempts, error[:DELIVERY_ERROR_MAX], self.owner, at, token),
        )

    @locked
    def delivery_counts(self) -> dict[str, int]:
        """How many decisions are in each delivery state (every state present, 0 if none)."""
        rows = self.db.exec(
            "SELECT CASE WHEN announced_at IS NOT NULL THEN 'delivered'"
            " WHEN delivery_error IS NOT NULL THEN 'failed' ELSE 'pending' END, COUNT(*)"
            " FROM decisions GROUP BY 1"
        )
        out = dict.fromkeys(DELIVERY_STATES, 0)
        out.update((str(k), int(n)) for k, n in rows)  # type: ignore[call-overload]
        return out

    @locked
    def raise_alarm(
        self,
        instance_id: str,
        alarm: str,
        instance: str,
        status: str,
        labels: Mapping[str, str],
        now: float | None = None,
    ) -> bool:
        """Raise ``alarm`` about the instance, or note that it still holds (``seen_at``, its
        status). True when this call raised it (it was not raised, or had been cleared)."""
        at = time.time() if now is None else now
        text = json.dumps(dict(labels), sort_keys=True)
        try:
            self.db.begin_write()
            rows = self.db.exec(
                "SELECT cleared_at FROM instance_alarms WHERE instance_id = ? AND alarm = ?",
                (instance_id, alarm),
            )
            raised = not rows or rows[0][0] is not None
            if not rows:
                self.db.exec(
                    "INSERT INTO instance_alarms (instance_id, alarm, instance, status, labels,"
                    " raised_at, raised_by, seen_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (instance_id, alarm, instance, status, text, at, self.db.owner, at),
                )
            elif raised:
                self.db.exec(
                    "UPDATE instance_alarms SET instance = ?, status = ?, labels = ?,"
                    " raised_at = ?, raised_by = ?, seen_at = ?, cleared_at = NULL,"
                    " cleared_why = NULL WHERE instance_id = ? AND alarm = ?",
                    (instance, status, text, at, self.db.owner, at, instance_id, alarm),
                )
            else:
                self.db.exec(
                    "UPDATE instance_alarms SET instance = ?, status = ?, labels = ?,"
                    " seen_at = ? WHERE instance_id = ? AND alarm = ?",
                    (instance, status, text, at, instance_id, alarm),
                )
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return raised

    @locked
    def clear_alarm(self, instance_id: str, alarm: str, why: str, now: float | None = None) -> bool:
        """Clear a raised alarm (``why``: deleted, ended, selected again). True when it was
        raised."""
        at = time.time() if now is None else now
        n = self.db.rowcount(
            "UPDATE instance_alarms SET cleared_at = ?, cleared_why = ?"
            " WHERE instance_id = ? AND alarm = ? AND cleared_at IS NULL",
            (at, why, instance_id, alarm),
        )
        return n > 0

    @locked
    def alarms(self) -> list[InstanceAlarm]:
        """The raised alarms, oldest first."""
        rows = self.db.exec(
            "SELECT instance_id, alarm, instance, status, labels, raised_at, raised_by, seen_at"
            " FROM instance_alarms WHERE cleared_at IS NULL ORDER BY raised_at, instance_id"
        )
        out = []
        for a, b, c, d, e, f, g, h in rows:
            raised_at, seen_at = float(f), float(h)  # type: ignore[arg-type]
            out.append(
                InstanceAlarm(str(a), str(b), str(c), str(d), json.loads(str(e)), raised_at,
                              str(g), seen_at)
            )  # fmt: skip
        return out
