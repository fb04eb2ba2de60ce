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

import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# A claim holds the write lock for a few milliseconds; 30 s covers a busy disk and many pollers.
BUSY_TIMEOUT_MS = 30_000
# Opening retries "database is locked" that SQLite returns without calling its busy handler (the
# deadlock case: several processes switching a fresh file to WAL at once each hold a shared lock
# and want an exclusive one). Backoff from 10 ms doubling to 250 ms, for BUSY_TIMEOUT_MS in all.
_OPEN_BACKOFF_S = (0.01, 0.25)
# Namespace for requestIds derived from decisions (any fixed UUID works; this one is ours).
_REQUEST_NS = uuid.UUID("6b0f2a4e-8a1d-4c1e-9a55-0d1f3c2b7e11")

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
"""


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

    @property
    def request_id(self) -> str:
        """The requestId for reaping this decision's instance: the same for every retry."""
        return str(uuid.uuid5(_REQUEST_NS, f"{self.instance_id}/{self.boot}/{self.token}"))


class Ledger:
    """Open (and create) the ledger at ``path``. Use as a context manager or call close()."""

    def __init__(
        self,
        path: str | Path,
        owner: str = "",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; we issue BEGIN IMMEDIATE ourselves.
        self._db = sqlite3.connect(
            str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None
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
        wait, cap = _OPEN_BACKOFF_S
        attempt = 0
        while True:
            attempt += 1
            try:
                self._init_schema()
                return
            except sqlite3.OperationalError as e:
                msg = str(e)
                if "locked" not in msg and "busy" not in msg:
                    raise
                if clock() + wait > deadline:
                    raise sqlite3.OperationalError(
                        f"{msg} (gave up opening {self.path} after {attempt} attempts)"
                    ) from e
            sleep(wait)
            wait = min(wait * 2, cap)

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
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def claim(
        self,
        instance_id: str,
        boot: str,
        verdict: str,
        reason: str,
        instance: str = "",
        now: float | None = None,
    ) -> Decision:
        """Record a FAILOVER decision for (instance_id, boot) unless one exists.

        Returns the new decision with ``won=True`` and a fresh fencing token, or the existing one
        with ``won=False`` ("already decided"), whoever and whenever decided it.
        """
        decided_at = time.time() if now is None else now
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            row = self._get(instance_id, boot)
            if row is not None:
                db.execute("COMMIT")
                return row
            (last,) = db.execute("SELECT last_token FROM fence WHERE id = 1").fetchone()
            token = int(last) + 1
            db.execute("UPDATE fence SET last_token = ? WHERE id = 1", (token,))
            db.execute(
                "INSERT INTO decisions (instance_id, boot, token, verdict, reason, instance,"
                " owner, decided_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (instance_id, boot, token, verdict, reason, instance, self.owner, decided_at),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return Decision(
            instance_id, boot, token, verdict, reason, instance, self.owner, decided_at, True
        )

    def get(self, instance_id: str, boot: str) -> Decision | None:
        return self._get(instance_id, boot)

    def _get(self, instance_id: str, boot: str) -> Decision | None:
        row = self._db.execute(
            "SELECT token, verdict, reason, instance, owner, decided_at, reaped_at, reap_result"
            " FROM decisions WHERE instance_id = ? AND boot = ?",
            (instance_id, boot),
        ).fetchone()
        if row is None:
            return None
        token, verdict, reason, instance, owner, decided_at, reaped_at, reap_result = row
        return Decision(
            instance_id,
            boot,
            int(token),
            verdict,
            reason,
            instance,
            owner,
            float(decided_at),
            False,
            reaped_at,
            reap_result,
        )

    def mark_reaped(
        self, instance_id: str, boot: str, result: str, now: float | None = None
    ) -> None:
        """Record that the instance of this decision was deleted (``result``: operation name)."""
        at = time.time() if now is None else now
        self._db.execute(
            "UPDATE decisions SET reaped_at = ?, reap_result = ?"
            " WHERE instance_id = ? AND boot = ?",
            (at, result, instance_id, boot),
        )

    def all(self) -> list[Decision]:
        rows = self._db.execute("SELECT instance_id, boot FROM decisions ORDER BY token").fetchall()
        out = []
        for iid, boot in rows:
            d = self._get(iid, boot)
            if d is not None:
                out.append(d)
        return out
