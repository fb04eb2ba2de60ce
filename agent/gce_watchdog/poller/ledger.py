"""The failover ledger: the first FAILOVER decision for (instance id, boot) wins, durably.

One SQLite file shared by every poller process (on one host or a shared local disk; SQLite
locking is not safe on NFS). Each claim runs in a ``BEGIN IMMEDIATE`` transaction, which takes
the database's write lock before reading, so two processes cannot both see "no decision yet".
The primary key on (instance_id, boot) is a second line of defence: a duplicate insert fails.

The winner gets a fencing token: an integer that increases with every decision across the whole
ledger. Downstream systems (the dispatcher starting the job elsewhere) can reject any action that
carries a token lower than one they have already seen, which keeps a slow, stale poller from
acting after a newer decision.

Reaping (deleting the instance after a failover) is recorded here too, with a ``requestId`` that
is derived from the decision, so any poller that finds a decision not yet reaped can retry the
delete and GCE treats the retries as one request.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

if TYPE_CHECKING:
    from gce_watchdog.poller.brake import BrakeRule

import tenacity

from gce_watchdog.lib.retry import Backoff, tenacity_wait
from gce_watchdog.poller.assemble import Received
from gce_watchdog.poller.verdict import terminal_kind
from gce_watchdog.wire.protocol import MAX_RETIRED, Event, Retired, Retirees

# A claim holds the write lock for a few milliseconds; 30 s covers a busy disk and many pollers.
BUSY_TIMEOUT_MS = 30_000
# Opening retries "database is locked" that SQLite returns without calling its busy handler (the
# deadlock case: several processes switching a fresh file to WAL at once each hold a shared lock
# and want an exclusive one). Backoff from 10 ms doubling to 250 ms, for BUSY_TIMEOUT_MS in all;
# no jitter: each open's own timing spreads the processes out.
_OPEN_BACKOFF = Backoff(initial=0.01, multiplier=2.0, max_wait=0.25, jitter=0.0)
# Namespace for requestIds derived from decisions (any fixed UUID works; this one is ours).
_REQUEST_NS = uuid.UUID("6b0f2a4e-8a1d-4c1e-9a55-0d1f3c2b7e11")

# A decision is announced (the poller prints ``action=failover``) by whoever holds its
# announcement lease: the claimer first. Only if the lease runs out unannounced (the claimer died
# between its claim and its announcement) does another poller take it over. The lease covers a
# slow DELETE (--reap runs before the announcement line is printed): 5 attempts of at most 30 s
# read timeout each plus their waits stay under 5 min.
ANNOUNCE_LEASE_S = 300.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    instance_id TEXT NOT NULL,
    boot        TEXT NOT NULL,
    token       INTEGER NOT NULL UNIQUE,
    verdict     TEXT NOT NULL,
    reason      TEXT NOT NULL,
    instance    TEXT NOT NULL,
    owner       TEXT NOT NULL,
    decided_at  REAL NOT NULL,
    reaped_at   REAL,
    reap_result TEXT,
    PRIMARY KEY (instance_id, boot)
);
CREATE TABLE IF NOT EXISTS fence (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    last_token INTEGER NOT NULL
);
INSERT OR IGNORE INTO fence (id, last_token) VALUES (1, 0);
CREATE TABLE IF NOT EXISTS pins (
    instance_id TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    public      TEXT,
    source      TEXT NOT NULL,
    pinned_at   REAL NOT NULL,
    pinned_by   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pin_rekeys (
    instance_id TEXT NOT NULL,
    old_public  TEXT NOT NULL,
    boot        TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    rekeyed_at  REAL NOT NULL,
    rekeyed_by  TEXT NOT NULL,
    PRIMARY KEY (instance_id, old_public)
)
"""
# The rotations of each instance's pin (``rekey`` lines: docs/serial-protocol.md, "Key
# rotation"): the key each replaced and its rekey line's boot and seq. Both backends.
PIN_REKEYS_TABLE = """CREATE TABLE IF NOT EXISTS pin_rekeys (
    instance_id TEXT NOT NULL,
    old_public  TEXT NOT NULL,
    boot        TEXT NOT NULL,
    seq         BIGINT NOT NULL,
    rekeyed_at  DOUBLE PRECISION NOT NULL,
    rekeyed_by  TEXT NOT NULL,
    PRIMARY KEY (instance_id, old_public)
)"""
# The Pub/Sub workers' shared assembly state (poller/pubsub.py, poller/assemble.py): the same
# tables in both backends (ledger_pg has its copy). Kept apart from the decisions so that the
# ledger's other users never read them.
ASSEMBLY_SCHEMA = (
    # per (instance, boot): open (lines being gathered), or a tombstone once decided, ended
    # (its verdict is final and no failover) or gapped (left to the Compute API sweep)
    """CREATE TABLE IF NOT EXISTS assembly_boots (
        instance_id TEXT NOT NULL,
        boot        TEXT NOT NULL,
        state       TEXT NOT NULL,
        project     TEXT NOT NULL,
        zone        TEXT NOT NULL,
        name        TEXT NOT NULL,
        last_line   DOUBLE PRECISION NOT NULL,
        gap_since   DOUBLE PRECISION,
        terminal    BIGINT,
        floor       BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (instance_id, boot)
    )""",
    # the verified lines of open boots, from every worker
    """CREATE TABLE IF NOT EXISTS assembly_lines (
        instance_id TEXT NOT NULL,
        boot        TEXT NOT NULL,
        seq         BIGINT NOT NULL,
        event       TEXT NOT NULL,
        ts_ms       BIGINT NOT NULL,
        fields      TEXT NOT NULL,
        text        TEXT NOT NULL,
        received_at DOUBLE PRECISION NOT NULL,
        published   DOUBLE PRECISION,
        PRIMARY KEY (instance_id, boot, seq)
    )""",
    # lines received before their instance's key was pinned (raw: verified once it is)
    """CREATE TABLE IF NOT EXISTS assembly_unverified (
        instance_id TEXT NOT NULL,
        line        TEXT NOT NULL,
        project     TEXT NOT NULL,
        zone        TEXT NOT NULL,
        name        TEXT NOT NULL,
        received_at DOUBLE PRECISION NOT NULL,
        published   DOUBLE PRECISION,
        PRIMARY KEY (instance_id, line)
    )""",
    "CREATE INDEX IF NOT EXISTS assembly_boots_gap ON assembly_boots (gap_since)"
    " WHERE gap_since IS NOT NULL",
    # last: its existence means the whole assembly schema is there
    "CREATE INDEX IF NOT EXISTS assembly_boots_ended ON assembly_boots (last_line)"
    " WHERE state <> 'open'",
)
# Boot states in assembly_boots.
OPEN, DECIDED, ENDED, GAPPED = "open", "decided", "ended", "gapped"
# Unverified lines kept per instance while its key announcement has not arrived (about a day of
# one healthy boot's lines); past that they are dropped, and the boot ends up gapped (the sweep).
UNVERIFIED_MAX = 4096


@dataclass(frozen=True)
class StoredLine:
    """A verified line of ours, as a worker stores it (``published``: Pub/Sub publish time)."""

    instance_id: str
    project: str
    zone: str
    name: str
    event: Event
    received_at: float
    published: float | None


@dataclass(frozen=True)
class RawLine:
    """A line that names a boot and seq but whose instance has no pinned key yet."""

    instance_id: str
    project: str
    zone: str
    name: str
    text: str
    received_at: float
    published: float | None


@dataclass(frozen=True)
class BootLines:
    """An open boot's stored lines and identity, read under its row lock."""

    instance_id: str
    boot: str
    project: str
    zone: str
    name: str
    floor: int
    lines: list[tuple[Received, float | None]]  # (line, publish time)


@dataclass(frozen=True)
class BootUpdate:
    """What the worker makes of a boot: its new state, gap hint, and compaction."""

    state: str
    gap_since: float | None
    drop: tuple[int, ...] = ()
    floor: int = 0


# Columns added after the first release: (name, SQL type). A ledger written by an older poller
# gets them on open; its decisions were printed when they were made, so they count as announced.
_ADDED_COLUMNS = (
    ("announced_at", "REAL"),
    ("announced_by", "TEXT"),
    ("announce_owner", "TEXT"),
    ("announce_until", "REAL"),
)
# Decisions as an interface (docs/poller.md): what a dispatcher needs beyond the decision (the
# instance's labels, its job, the verdict's evidence), one row per token, written in the claim's
# transaction; and the fleet-wide brake's holds: failovers it did not let through, one per
# (instance id, boot), until an operator releases them. Tables of their own, in both backends.
DISPATCH_TABLES = (
    """CREATE TABLE IF NOT EXISTS decision_details (
        token    BIGINT PRIMARY KEY,
        labels   TEXT NOT NULL,
        job      TEXT,
        evidence TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS brake_holds (
        instance_id TEXT NOT NULL,
        boot        TEXT NOT NULL,
        verdict     TEXT NOT NULL,
        reason      TEXT NOT NULL,
        instance    TEXT NOT NULL,
        details     TEXT NOT NULL,
        held_at     DOUBLE PRECISION NOT NULL,
        released_at DOUBLE PRECISION,
        released_by TEXT,
        PRIMARY KEY (instance_id, boot)
    )""",
)
_COLUMNS = (
    "instance_id, boot, token, verdict, reason, instance, owner, decided_at, reaped_at,"
    " reap_result, announced_at, announced_by"
)


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


@dataclass(frozen=True)
class Pin:
    """An instance id's v3 line key, shared by every reader (docs/serial-protocol.md, "Pins").

    ``public``: the Ed25519 public key, or None for a hand pin whose key no reader has seen yet
    (an announcement with ``fingerprint`` fills it in). ``source``: ``placed`` (from the first
    line of the instance's first boot, read from byte 0), ``hand`` (``gce-watchdog pin``) or
    ``rekey`` (moved by a rotation line signed with the previous pin; ``retired``: the keys
    rotations replaced and where, oldest first)."""

    instance_id: str
    fingerprint: str
    public: bytes | None
    source: str
    pinned_at: float
    pinned_by: str
    retired: Retirees = ()


class PinStore(Protocol):
    """Where readers share protocol v3 pins (``BaseLedger.get_pin``/``place_pin``/``rekey_pin``):
    the poll path (poller/reader.py) places a pin from byte 0 of the port, an operator by hand;
    a Pub/Sub worker (poller/pubsub.py) never places one itself, and both move a pin only through
    a ``rekey`` line that verifies under it."""

    def get_pin(self, instance_id: str) -> Pin | None: ...

    def place_pin(
        self, instance_id: str, public: bytes, fingerprint: str, now: float | None = None
    ) -> Pin: ...

    def rekey_pin(
        self,
        instance_id: str,
        old: bytes,
        new: bytes,
        fingerprint: str,
        boot: str,
        seq: int,
        now: float | None = None,
    ) -> Pin | None: ...


PIN_PLACED = "placed"
PIN_HAND = "hand"
PIN_REKEY = "rekey"
_PIN_COLUMNS = "instance_id, fingerprint, public, source, pinned_at, pinned_by"


def _pin_row(row: tuple[object, ...]) -> Pin:
    import base64

    iid, fp, public, source, at, by = row
    raw = base64.urlsafe_b64decode(str(public) + "=" * (-len(str(public)) % 4)) if public else None
    return Pin(str(iid), str(fp), raw, str(source), float(at), str(by))  # type: ignore[arg-type]


def _b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# Keys without a boot: the verdict came from no line of ours ("-"), or without an instance id
# ("name:..."). Such a claim is an opinion about the instance, not about one boot of it.
NO_BOOT = "-"


def _row(row: tuple[object, ...], won: bool = False) -> Decision:
    iid, boot, token, verdict, reason, inst, owner, at, reaped_at, reap_result, ann_at, ann_by = row
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
    )


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(fn: _F) -> _F:
    @functools.wraps(fn)
    def wrapper(self: BaseLedger, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kwargs)

    return cast(_F, wrapper)


class BaseLedger:
    """The ledger's semantics over a SQL connection; backends supply transactions and dialect.

    - ``claim``: one decision per (instance id, boot); the winner gets the next fencing token
      (+1 per decision across the whole ledger, never reused) and the announcement lease.
    - The ledger decides, not the cursor: a claim without boot evidence (boot ``-``) or without an
      instance id (``name:...``), or any claim for an instance whose VM was already reaped, returns
      the instance's existing decision (``won=False``). A poller with a fresh cursor dir that finds
      a reaped VM gone gets ``already_decided``, never a second decision.
    - ``take_announcement`` / ``mark_announced``: a claimed decision is announced by its claimer,
      or, if the claimer died first (its lease ran out), by exactly one later poller.
    """

    owner: str
    announce_lease_s: float
    # One connection serves every thread of a poller (the fleet's pool): each public method holds
    # this lock, so a transaction never interleaves with another thread's statements.
    _lock: threading.RLock
    # The driver's exception types: the CLI treats these as "ledger unavailable" (exit 74).
    errors: tuple[type[BaseException], ...] = ()
    # The fleet-wide brake (None: off) and the size of the fleet it is a share of; the poller's
    # loop sets both (``fleet_size`` as an instance attribute).
    brake: BrakeRule | None = None
    fleet_size: Callable[[], int] = staticmethod(lambda: 0)

    # -- what a backend supplies -----------------------------------------------------------

    def _begin_write(self) -> None:
        """Start a transaction that holds the ledger's claim lock until commit/rollback."""
        raise NotImplementedError

    def _exec(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        """Run one statement (``?`` placeholders); rows for a SELECT/RETURNING, else []."""
        raise NotImplementedError

    def _execmany(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        """One statement (``?`` placeholders) for each row, in one round trip where it can."""
        for r in rows:
            self._exec(sql, r)

    def _rowcount(self, sql: str, params: tuple[object, ...]) -> int:
        raise NotImplementedError

    def _begin_plain(self) -> None:
        """Start a transaction for the assembly state (row locks, not the claim lock)."""
        self._begin_write()

    # appended to the SELECT that locks one assembly_boots row ("" where a transaction holds
    # the whole database, as SQLite's BEGIN IMMEDIATE does)
    _for_update = ""

    def _commit(self) -> None:
        self._exec("COMMIT")

    def _rollback(self) -> None:
        self._exec("ROLLBACK")

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> BaseLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the semantics ---------------------------------------------------------------------

    @_locked
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
        (``labels``, ``job``, ``evidence``) go in ``decision_details`` in the same transaction.
        With the brake on and its share of the window taken, nothing is decided: the failover is
        held (``held=True``) until released.
        """
        decided_at = time.time() if now is None else now
        try:
            self._begin_write()  # inside: a lock timeout here must not leave a transaction open
            row = self._get(instance_id, boot)
            if row is None:
                row = self._settled(instance_id, boot, instance)
            if row is not None:
                self._commit()
                return row
            if self.brake is not None and not self._brake_passes(
                instance_id, boot, verdict, reason, instance, details or {}, decided_at
            ):
                self._commit()
                return Decision(
                    instance_id, boot, 0, verdict, reason, instance, self.owner, decided_at,
                    False, held=True,
                )  # fmt: skip
            (last,) = self._exec("SELECT last_token FROM fence WHERE id = 1")[0]
            token = int(last) + 1  # type: ignore[call-overload]
            self._exec("UPDATE fence SET last_token = ? WHERE id = 1", (token,))
            self._exec(
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
            self._exec(
                "INSERT INTO decision_details (token, labels, job, evidence) VALUES (?, ?, ?, ?)",
                (
                    token,
                    json.dumps(dict(d.get("labels") or {}), sort_keys=True),
                    d.get("job"),
                    json.dumps(list(d.get("evidence") or [])),
                ),
            )
            self._commit()
        except BaseException:
            self._rollback()
            raise
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
        held = self._exec(
            "SELECT released_at FROM brake_holds WHERE instance_id = ? AND boot = ?",
            (instance_id, boot),
        )
        if held:
            return held[0][0] is not None
        # released holds do not count: an operator let them through, and a real failover after
        # a release must not be held for it
        ((recent,),) = self._exec(
            "SELECT count(*) FROM decisions d WHERE d.decided_at > ? AND NOT EXISTS"
            " (SELECT 1 FROM brake_holds h WHERE h.instance_id = d.instance_id"
            " AND h.boot = d.boot)",
            (now - self.brake.window_s,),
        )
        if self.brake.admits(int(recent), int(self.fleet_size())):  # type: ignore[call-overload]
            return True
        self._exec(
            "INSERT INTO brake_holds (instance_id, boot, verdict, reason, instance, details,"
            " held_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                instance_id, boot, verdict, reason, instance,
                json.dumps(dict(details), sort_keys=True, default=list), now,
            ),
        )  # fmt: skip
        return False

    @_locked
    def holds(self) -> list[Hold]:
        """The failovers the brake holds now, oldest first: not released, and not decided since
        (by a poller with the brake off)."""
        rows = self._exec(
            "SELECT instance_id, boot, verdict, reason, instance, details, held_at"
            " FROM brake_holds h WHERE released_at IS NULL AND NOT EXISTS"
            " (SELECT 1 FROM decisions d WHERE d.instance_id = h.instance_id AND d.boot = h.boot)"
            " ORDER BY held_at, instance_id"
        )
        return [
            Hold(str(a), str(b), str(c), str(d), str(e), json.loads(str(f)), float(g))  # type: ignore[arg-type]
            for a, b, c, d, e, f, g in rows
        ]

    @_locked
    def release(self, hold: Hold, by: str, now: float | None = None) -> Decision:
        """Release one held failover: mark it released, then claim it past the brake (two
        transactions: a release that dies between them is claimed by the next poll)."""
        at = time.time() if now is None else now
        self._rowcount(
            "UPDATE brake_holds SET released_at = ?, released_by = ?"
            " WHERE instance_id = ? AND boot = ? AND released_at IS NULL",
            (at, by, hold.instance_id, hold.boot),
        )
        return self.claim(
            hold.instance_id, hold.boot, hold.verdict, hold.reason, hold.instance, at,
            hold.details,
        )  # fmt: skip

    @_locked
    def details_after(self, after: int, limit: int = 500) -> list[tuple[Decision, dict[str, Any]]]:
        """Decisions with a token above ``after``, in token order, with their details."""
        rows = self._exec(
            f"SELECT {_COLUMNS_D}, x.labels, x.job, x.evidence FROM decisions d"  # noqa: S608
            " LEFT JOIN decision_details x ON x.token = d.token"
            " WHERE d.token > ? ORDER BY d.token LIMIT ?",
            (after, limit),
        )
        out = []
        for r in rows:
            labels, job, evidence = r[12:15]
            out.append(
                (
                    _row(r[:12]),
                    {
                        "labels": json.loads(str(labels)) if labels is not None else {},
                        "job": None if job is None else str(job),
                        "evidence": json.loads(str(evidence)) if evidence is not None else [],
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

    @_locked
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

    @_locked
    def get(self, instance_id: str, boot: str) -> Decision | None:
        return self._get(instance_id, boot)

    def _get(self, instance_id: str, boot: str) -> Decision | None:
        rows = self._select("WHERE instance_id = ? AND boot = ?", (instance_id, boot))
        return _row(rows[0]) if rows else None

    @_locked
    def take_announcement(self, instance_id: str, boot: str, now: float | None = None) -> bool:
        """Take over announcing a decision nobody announced and whose lease has run out.

        True for exactly one caller per lapse; that caller announces, then ``mark_announced``.
        """
        at = time.time() if now is None else now
        n = self._rowcount(
            "UPDATE decisions SET announce_owner = ?, announce_until = ?"
            " WHERE instance_id = ? AND boot = ? AND announced_at IS NULL"
            " AND (announce_until IS NULL OR announce_until <= ?)",
            (self.owner, at + self.announce_lease_s, instance_id, boot, at),
        )
        return n == 1

    @_locked
    def hold_announcement(self, instance_id: str, boot: str, now: float | None = None) -> bool:
        """Renew this owner's announcement lease (from now, for ``announce_lease_s``) just before
        a delivery runs: True if the announcement is still pending and this owner's (or lapsed,
        and so taken now); False if another owner holds a live lease or it was announced."""
        at = time.time() if now is None else now
        n = self._rowcount(
            "UPDATE decisions SET announce_owner = ?, announce_until = ?"
            " WHERE instance_id = ? AND boot = ? AND announced_at IS NULL"
            " AND (announce_owner = ? OR announce_until IS NULL OR announce_until <= ?)",
            (self.owner, at + self.announce_lease_s, instance_id, boot, self.owner, at),
        )
        return n == 1

    @_locked
    def mark_announced(self, instance_id: str, boot: str, now: float | None = None) -> bool:
        """Record that this owner printed the announcement; False if it was announced before."""
        at = time.time() if now is None else now
        n = self._rowcount(
            "UPDATE decisions SET announced_at = ?, announced_by = ?"
            " WHERE instance_id = ? AND boot = ? AND announced_at IS NULL",
            (at, self.owner, instance_id, boot),
        )
        return n == 1

    @_locked
    def pending_announcements(self) -> list[Decision]:
        """Decisions claimed but never announced (their claimer died, or is announcing now)."""
        rows = self._select("WHERE announced_at IS NULL ORDER BY token")
        return [_row(r) for r in rows]

    @_locked
    def mark_reaped(
        self, instance_id: str, boot: str, result: str, now: float | None = None
    ) -> None:
        """Record that the instance of this decision was deleted (``result``: operation name)."""
        at = time.time() if now is None else now
        self._rowcount(
            "UPDATE decisions SET reaped_at = ?, reap_result = ?"
            " WHERE instance_id = ? AND boot = ?",
            (at, result, instance_id, boot),
        )

    @_locked
    def all(self) -> list[Decision]:
        return [_row(r) for r in self._select("ORDER BY token")]

    # -- pins (protocol v3) -------------------------------------------------------------------

    @_locked
    def get_pin(self, instance_id: str) -> Pin | None:
        rows = self._exec(
            f"SELECT {_PIN_COLUMNS} FROM pins WHERE instance_id = ?",  # noqa: S608 (constants)
            (instance_id,),
        )
        if not rows:
            return None
        pin = _pin_row(rows[0])
        if pin.source != PIN_REKEY:
            return pin
        rk = self._exec(
            "SELECT old_public, boot, seq FROM pin_rekeys WHERE instance_id = ?"
            " ORDER BY rekeyed_at, seq",
            (instance_id,),
        )
        chain = tuple(Retired(_unb64(str(o)), str(b), int(str(q))) for o, b, q in rk)
        return replace(pin, retired=chain[-MAX_RETIRED:])

    @_locked
    def rekey_pin(
        self,
        instance_id: str,
        old: bytes,
        new: bytes,
        fingerprint: str,
        boot: str,
        seq: int,
        now: float | None = None,
    ) -> Pin | None:
        """Move the instance's pin from ``old`` to ``new``: a ``rekey`` line signed with ``old``
        (a reader verified it) at ``boot``/``seq``. Compare-and-set: only while ``old`` is the
        pin, so readers that decoded the same rotation move it once, and a stale one moves
        nothing. Returns the pin as stored afterwards (None: the instance has no pin)."""
        at = time.time() if now is None else now
        try:
            self._begin_write()
            n = self._rowcount(
                "UPDATE pins SET fingerprint = ?, public = ?, source = ?, pinned_at = ?,"
                " pinned_by = ? WHERE instance_id = ? AND public = ?",
                (fingerprint, _b64(new), PIN_REKEY, at, self.owner, instance_id, _b64(old)),
            )
            if n:
                self._exec(
                    "DELETE FROM pin_rekeys WHERE instance_id = ? AND old_public = ?",
                    (instance_id, _b64(old)),
                )
                self._exec(
                    "INSERT INTO pin_rekeys (instance_id, old_public, boot, seq, rekeyed_at,"
                    " rekeyed_by) VALUES (?, ?, ?, ?, ?, ?)",
                    (instance_id, _b64(old), boot, seq, at, self.owner),
                )
            self._commit()
        except BaseException:
            self._rollback()
            raise
        return self.get_pin(instance_id)

    @_locked
    def place_pin(
        self, instance_id: str, public: bytes, fingerprint: str, now: float | None = None
    ) -> Pin:
        """Store the key a reader placed, unless the instance has a pin already; returns the
        stored pin (the first one wins: every reader then uses it). A hand pin of the same
        fingerprint that lacked the public key gets it."""
        at = time.time() if now is None else now
        try:
            self._begin_write()
            self._exec(
                "INSERT INTO pins (instance_id, fingerprint, public, source, pinned_at, pinned_by)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (instance_id) DO NOTHING",
                (instance_id, fingerprint, _b64(public), PIN_PLACED, at, self.owner),
            )
            self._exec(
                "UPDATE pins SET public = ? WHERE instance_id = ? AND fingerprint = ?"
                " AND public IS NULL",
                (_b64(public), instance_id, fingerprint),
            )
            rows = self._exec(
                f"SELECT {_PIN_COLUMNS} FROM pins WHERE instance_id = ?",  # noqa: S608
                (instance_id,),
            )
            self._commit()
        except BaseException:
            self._rollback()
            raise
        return _pin_row(rows[0])

    @_locked
    def hand_pin(self, instance_id: str, fingerprint: str, now: float | None = None) -> Pin | None:
        """An operator's pin (``gce-watchdog pin``): replaces any pin of the instance. Returns
        the pin it replaced, or None."""
        at = time.time() if now is None else now
        try:
            self._begin_write()
            rows = self._exec(
                f"SELECT {_PIN_COLUMNS} FROM pins WHERE instance_id = ?",  # noqa: S608
                (instance_id,),
            )
            self._exec("DELETE FROM pins WHERE instance_id = ?", (instance_id,))
            self._exec("DELETE FROM pin_rekeys WHERE instance_id = ?", (instance_id,))
            self._exec(
                "INSERT INTO pins (instance_id, fingerprint, public, source, pinned_at, pinned_by)"
                " VALUES (?, ?, NULL, ?, ?, ?)",
                (instance_id, fingerprint, PIN_HAND, at, self.owner),
            )
            self._commit()
        except BaseException:
            self._rollback()
            raise
        return _pin_row(rows[0]) if rows else None

    def _select(self, tail: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        # Only constants are joined here (_COLUMNS and literal clauses); values are parameters.
        return self._exec(f"SELECT {_COLUMNS} FROM decisions {tail}", params)  # noqa: S608

    # -- the Pub/Sub workers' shared assembly state ----------------------------------------
    # Every method is one transaction: a worker acks a message only after the method that stored
    # its line returned (committed). docs/poller.md "Many workers" has the protocol.

    @_locked
    def assembly_store(
        self, lines: list[StoredLine], raw: list[RawLine]
    ) -> tuple[set[tuple[str, str]], int]:
        """Store received lines (duplicates ignored), durably when it returns.

        Returns the open boots among them that have a terminal line stored (by anyone: the
        caller looks at those again) and the count of raw lines dropped past UNVERIFIED_MAX.
        """
        order = sorted(lines, key=lambda x: (x.instance_id, x.event.boot, x.event.seq))
        # per boot: (identity, latest receipt, earliest receipt, lowest terminal seq)
        boots: dict[tuple[str, str], tuple[StoredLine, float, float, int | None]] = {}
        for ln in order:
            key = (ln.instance_id, ln.event.boot)
            term = ln.event.seq if terminal_kind(ln.event) is not None else None
            prev = boots.get(key)
            if prev is None:
                boots[key] = (ln, ln.received_at, ln.received_at, term)
            else:
                t = prev[3] if term is None or (prev[3] is not None and prev[3] < term) else term
                boots[key] = (ln, max(prev[1], ln.received_at), min(prev[2], ln.received_at), t)
        dropped = 0
        try:
            self._begin_plain()
            # rows in one order (sorted) in every worker: no two transactions wait on each other.
            # gap_since: "look again by then" (the look sets it right); terminal: the lowest
            # seq of a terminal line stored, so whoever stores a boot's last missing line knows
            # to look at it.
            self._execmany(
                "INSERT INTO assembly_boots (instance_id, boot, state, project, zone, name,"
                " last_line, gap_since, terminal) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (instance_id, boot) DO UPDATE SET"
                " last_line = CASE WHEN excluded.last_line > assembly_boots.last_line"
                " THEN excluded.last_line ELSE assembly_boots.last_line END,"
                " gap_since = COALESCE(assembly_boots.gap_since, excluded.gap_since),"
                " terminal = CASE WHEN assembly_boots.terminal IS NULL OR"
                " (excluded.terminal IS NOT NULL AND excluded.terminal < assembly_boots.terminal)"
                " THEN excluded.terminal ELSE assembly_boots.terminal END",
                [
                    (iid, boot, OPEN, ln.project, ln.zone, ln.name, last, first, term)
                    for (iid, boot), (ln, last, first, term) in sorted(boots.items())
                ],
            )
            states: dict[tuple[str, str], tuple[str, object]] = {}
            ids = sorted({iid for iid, _ in boots})
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                marks = ", ".join("?" * len(chunk))
                for iid, boot, state, stored_term in self._exec(
                    "SELECT instance_id, boot, state, terminal FROM assembly_boots"  # noqa: S608
                    f" WHERE instance_id IN ({marks})",
                    tuple(chunk),
                ):
                    states[(str(iid), str(boot))] = (str(state), stored_term)
            open_boots = {k for k in boots if states[k][0] == OPEN}
            self._execmany(
                "INSERT INTO assembly_lines (instance_id, boot, seq, event, ts_ms, fields,"
                " text, received_at, published) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (instance_id, boot, seq) DO NOTHING",
                [
                    (ln.instance_id, ln.event.boot, ln.event.seq, ln.event.event,
                     ln.event.ts_ms, json.dumps(ln.event.fields), ln.event.text,
                     ln.received_at, ln.published)
                    for ln in order
                    if (ln.instance_id, ln.event.boot) in open_boots
                ],  # decided, ended or gapped boots: their lines change nothing
            )  # fmt: skip
            by_iid: dict[str, list[RawLine]] = {}
            for r in sorted(raw, key=lambda x: (x.instance_id, x.text)):
                by_iid.setdefault(r.instance_id, []).append(r)
            keep: list[RawLine] = []
            for iid, rs in by_iid.items():
                ((n,),) = self._exec(
                    "SELECT COUNT(*) FROM assembly_unverified WHERE instance_id = ?", (iid,)
                )
                room = max(0, UNVERIFIED_MAX - int(n))  # type: ignore[call-overload]
                keep += rs[:room]
                dropped += len(rs) - len(rs[:room])
            self._execmany(
                "INSERT INTO assembly_unverified (instance_id, line, project, zone, name,"
                " received_at, published) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (instance_id, line) DO NOTHING",
                [(r.instance_id, r.text, r.project, r.zone, r.name, r.received_at, r.published)
                 for r in keep],
            )  # fmt: skip
            self._commit()
        except BaseException:
            self._rollback()
            raise
        # only a boot with a terminal line stored can be decided or ended now; the others are
        # looked at when their gap hint is due (assembly_gaps_due)
        return {k for k in open_boots if states[k][1] is not None}, dropped

    @_locked
    def assembly_unverified(self, instance_id: str) -> list[RawLine]:
        rows = self._exec(
            "SELECT line, project, zone, name, received_at, published FROM assembly_unverified"
            " WHERE instance_id = ?",
            (instance_id,),
        )
        return [
            RawLine(instance_id, str(p), str(z), str(n), str(t), float(at), _opt_float(pub))  # type: ignore[arg-type]
            for t, p, z, n, at, pub in rows
        ]

    @_locked
    def assembly_raw_instances(self) -> list[str]:
        """Instances with raw lines stored (waiting for their pin), at most 1,000."""
        rows = self._exec("SELECT DISTINCT instance_id FROM assembly_unverified LIMIT 1000")
        return [str(r[0]) for r in rows]

    @_locked
    def assembly_drop_unverified(self, instance_id: str, texts: list[str]) -> None:
        for t in texts:
            self._exec(
                "DELETE FROM assembly_unverified WHERE instance_id = ? AND line = ?",
                (instance_id, t),
            )

    @_locked
    def assembly_update(
        self, instance_id: str, boot: str, fn: Callable[[BootLines], BootUpdate]
    ) -> tuple[BootLines, BootUpdate] | None:
        """Look at one boot under its row lock: ``fn`` gets every line any worker stored and says
        what follows; its update is committed before this returns. None if the boot is not open
        (decided, ended or gapped by another worker): its stray lines are dropped."""
        try:
            self._begin_plain()
            rows = self._exec(  # only a constant is joined (the backend's row-lock clause)
                "SELECT state, project, zone, name, floor FROM assembly_boots"  # noqa: S608
                f" WHERE instance_id = ? AND boot = ?{self._for_update}",
                (instance_id, boot),
            )
            if not rows or rows[0][0] != OPEN:
                self._exec(
                    "DELETE FROM assembly_lines WHERE instance_id = ? AND boot = ?",
                    (instance_id, boot),
                )
                self._commit()
                return None
            _, project, zone, name, floor = rows[0]
            got = self._exec(
                "SELECT seq, event, ts_ms, fields, text, received_at, published"
                " FROM assembly_lines WHERE instance_id = ? AND boot = ?",
                (instance_id, boot),
            )
            lines = [
                (
                    Received(
                        Event(str(ev), boot, int(seq), int(ts),  # type: ignore[call-overload]
                              tuple((str(k), str(v)) for k, v in json.loads(str(fields))),
                              str(text)),
                        float(at),  # type: ignore[arg-type]
                    ),
                    _opt_float(pub),
                )
                for seq, ev, ts, fields, text, at, pub in got
            ]  # fmt: skip
            seen = BootLines(
                instance_id,
                boot,
                str(project),
                str(zone),
                str(name),
                int(floor),  # type: ignore[call-overload]
                lines,
            )
            upd = fn(seen)
            self._exec(
                "UPDATE assembly_boots SET state = ?, gap_since = ?,"
                " floor = CASE WHEN ? > floor THEN ? ELSE floor END"
                " WHERE instance_id = ? AND boot = ?",
                (upd.state, upd.gap_since, upd.floor, upd.floor, instance_id, boot),
            )
            if upd.state != OPEN:
                self._exec(
                    "DELETE FROM assembly_lines WHERE instance_id = ? AND boot = ?",
                    (instance_id, boot),
                )
            for seq in upd.drop:
                self._exec(
                    "DELETE FROM assembly_lines WHERE instance_id = ? AND boot = ? AND seq = ?",
                    (instance_id, boot, seq),
                )
            self._commit()
        except BaseException:
            self._rollback()
            raise
        return seen, upd

    @_locked
    def assembly_set_state(self, instance_id: str, boot: str, state: str) -> None:
        """Close a boot (decided): its lines go, its row stays as a tombstone."""
        try:
            self._begin_plain()
            self._exec(
                "UPDATE assembly_boots SET state = ?, gap_since = NULL"
                " WHERE instance_id = ? AND boot = ?",
                (state, instance_id, boot),
            )
            self._exec(
                "DELETE FROM assembly_lines WHERE instance_id = ? AND boot = ?",
                (instance_id, boot),
            )
            self._commit()
        except BaseException:
            self._rollback()
            raise

    @_locked
    def assembly_gaps_due(self, before: float) -> list[tuple[str, str]]:
        """Open boots whose gap hint is older than ``before`` (a worker looks at them again)."""
        rows = self._exec(
            "SELECT instance_id, boot FROM assembly_boots"
            " WHERE gap_since IS NOT NULL AND gap_since <= ? AND state = ? ORDER BY gap_since"
            " LIMIT 1000",
            (before, OPEN),
        )
        return [(str(a), str(b)) for a, b in rows]

    @_locked
    def assembly_next_gap(self) -> float | None:
        """When the oldest gap hint was set (a worker looks again ``settle_s`` after)."""
        rows = self._exec(
            "SELECT MIN(gap_since) FROM assembly_boots WHERE gap_since IS NOT NULL AND state = ?",
            (OPEN,),
        )
        return _opt_float(rows[0][0]) if rows else None

    @_locked
    def assembly_heard(self, instance_id: str) -> tuple[float | None, bool]:
        """(when any worker last received a line of the instance, whether a boot of it is
        gapped): what the Compute API sweep needs to pick the VMs it polls."""
        rows = self._exec(
            "SELECT MAX(last_line), SUM(CASE WHEN state = ? THEN 1 ELSE 0 END)"
            " FROM assembly_boots WHERE instance_id = ?",
            (GAPPED, instance_id),
        )
        last, gapped = rows[0] if rows else (None, 0)
        return _opt_float(last), bool(gapped)

    @_locked
    def assembly_boots(self, state: str | None = None) -> list[tuple[str, str, str]]:
        """(instance, boot, state) of every boot (or of those in ``state``)."""
        if state is None:
            rows = self._exec("SELECT instance_id, boot, state FROM assembly_boots")
        else:
            rows = self._exec(
                "SELECT instance_id, boot, state FROM assembly_boots WHERE state = ?", (state,)
            )
        return [(str(a), str(b), str(c)) for a, b, c in rows]

    @_locked
    def assembly_instances(self) -> int:
        """How many instances any worker has stored a line of (tombstones included)."""
        rows = self._exec("SELECT COUNT(DISTINCT instance_id) FROM assembly_boots")
        return int(rows[0][0]) if rows else 0  # type: ignore[call-overload]

    @_locked
    def assembly_prune(self, before: float) -> int:
        """Drop tombstones (decided, ended, gapped boots) whose last line is older than
        ``before``: no delivery of theirs can still come (past the subscription's retention)."""
        return self._rowcount(
            "DELETE FROM assembly_boots WHERE state <> ? AND last_line < ?", (OPEN, before)
        )


def _is_busy(e: BaseException) -> bool:
    """SQLite's "database is locked" / "busy", the errors an open retries."""
    return isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e))


def default_owner() -> str:
    """A ledger owner's default name: host and pid, and a random part, since replicas of one
    container image often share both (pid 1, a fixed hostname) and leases go by owner."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def _opt_float(v: object) -> float | None:
    return None if v is None else float(v)  # type: ignore[arg-type]


class Ledger(BaseLedger):
    """The SQLite ledger at ``path`` (created if missing). A context manager, or call close()."""

    errors = (sqlite3.Error,)

    def __init__(
        self,
        path: str | Path,
        owner: str = "",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        announce_lease_s: float = ANNOUNCE_LEASE_S,
    ) -> None:
        self.path = Path(path)
        self.announce_lease_s = announce_lease_s
        self._lock = threading.RLock()
        self.owner = owner or default_owner()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; we issue BEGIN IMMEDIATE ourselves.
        self._db = sqlite3.connect(
            str(self.path),
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
            check_same_thread=False,  # shared by the fleet's threads under self._lock
        )
        try:
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._db.execute("PRAGMA synchronous = FULL")  # a won claim survives power loss
            self._open_retrying(sleep, clock)
        except BaseException:
            self._db.close()
            raise

    def _open_retrying(self, sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
        """Switch to WAL and create the schema, retrying SQLITE_BUSY up to BUSY_TIMEOUT_MS.

        The busy timeout covers plain waits, but SQLite answers "database is locked" at once,
        without waiting, where waiting could deadlock: a connection that holds a shared lock and
        needs a write lock while another connection holds one. ``PRAGMA journal_mode = WAL`` on
        a fresh file does exactly that, so pollers started together failed there.
        """
        deadline = clock() + BUSY_TIMEOUT_MS / 1000
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_is_busy),
            wait=tenacity_wait(_OPEN_BACKOFF),
            # stop when the next wait would cross the deadline (computed here, not read from
            # tenacity's upcoming_sleep: tenacity < 8.3 runs the stop rule before the wait)
            stop=lambda rs: clock() + _OPEN_BACKOFF.wait(rs.attempt_number, 0.0) > deadline,
            sleep=sleep,
        )
        try:
            retrying(self._init_schema)
        except tenacity.RetryError as e:
            last = e.last_attempt.exception()
            raise sqlite3.OperationalError(
                f"{last} (gave up opening {self.path} after {e.last_attempt.attempt_number}"
                " attempts)"
            ) from last

    def _init_schema(self) -> None:
        db = self._db
        # Read first: a ledger already in WAL (every open but the first) needs no write lock.
        (mode,) = db.execute("PRAGMA journal_mode").fetchone()
        if str(mode).lower() != "wal":
            db.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
        db.execute("BEGIN IMMEDIATE")
        try:
            for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                db.execute(stmt)
            for stmt in DISPATCH_TABLES:
                db.execute(stmt)
            for stmt in ASSEMBLY_SCHEMA:
                db.execute(stmt)
            have = {str(r[1]) for r in db.execute("PRAGMA table_info(decisions)")}
            missing = [(n, t) for n, t in _ADDED_COLUMNS if n not in have]
            for name, sqltype in missing:
                db.execute(f"ALTER TABLE decisions ADD COLUMN {name} {sqltype}")
            if missing:  # an older ledger: what it holds was announced when it was decided
                db.execute(
                    "UPDATE decisions SET announced_at = decided_at, announced_by = owner"
                    " WHERE announced_at IS NULL"
                )
            # the lookups of a claim without boot or id, and of the pending announcements
            db.execute("CREATE INDEX IF NOT EXISTS decisions_instance ON decisions (instance)")
            db.execute(
                "CREATE INDEX IF NOT EXISTS decisions_pending ON decisions (token)"
                " WHERE announced_at IS NULL"
            )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def _begin_write(self) -> None:
        # IMMEDIATE takes the write lock before reading: two processes cannot both see
        # "no decision yet".
        self._db.execute("BEGIN IMMEDIATE")

    def _rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def _exec(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        return [tuple(r) for r in self._db.execute(sql, params).fetchall()]

    def _execmany(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        if rows:
            self._db.executemany(sql, rows)

    def _rowcount(self, sql: str, params: tuple[object, ...]) -> int:
        return int(self._db.execute(sql, params).rowcount)
