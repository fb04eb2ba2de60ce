"""The ledger's database: one connection and one schema that the stores share.

The stores (:mod:`~gce_watchdog.poller.ledger` the decisions,
:mod:`~gce_watchdog.poller.pin_store` the pins, :mod:`~gce_watchdog.poller.assembly_store` the
Pub/Sub workers' assembly state, :mod:`~gce_watchdog.poller.freshness_store` each boot's
freshness) hold their semantics as SQL over a :class:`SqlDb`; a backend
supplies the connection, its transactions and its dialect: :class:`SqliteDb` here, ``PostgresDb``
in :mod:`~gce_watchdog.poller.ledger_pg`. ``open_ledger`` (:mod:`~gce_watchdog.poller.ledgers`)
opens one and hands out the stores.

One SQLite file is shared by every poller process (on one host or a shared local disk; SQLite
locking is not safe on NFS). A claim runs in a ``BEGIN IMMEDIATE`` transaction, which takes the
database's write lock before reading, so two processes cannot both see "no decision yet".
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from gce_watchdog.lib.retry import Backoff, retry_call

# A claim holds the write lock for a few milliseconds; 30 s covers a busy disk and many pollers.
BUSY_TIMEOUT_MS = 30_000
# Opening retries "database is locked" that SQLite returns without calling its busy handler (the
# deadlock case: several processes switching a fresh file to WAL at once each hold a shared lock
# and want an exclusive one). Backoff from 10 ms doubling to 250 ms, for BUSY_TIMEOUT_MS in all;
# no jitter: each open's own timing spreads the processes out.
_OPEN_BACKOFF = Backoff(initial=0.01, multiplier=2.0, max_wait=0.25, jitter=0.0)

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
# What a decided boot cost (poller/cost.py): its facts as JSON, one row per token, written in the
# claim's transaction; the decisions view adds the reap (docs/poller.md, "What it cost"). A table
# of its own, so a ledger of an older version gains it without touching its other tables.
COST_TABLE = """CREATE TABLE IF NOT EXISTS decision_costs (
    token BIGINT PRIMARY KEY,
    facts TEXT NOT NULL
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
# Columns added after the first release: (name, SQL type). A ledger written by an older poller
# gets them on open; its decisions were printed when they were made, so they count as announced.
_ADDED_COLUMNS = (
    ("announced_at", "REAL"),
    ("announced_by", "TEXT"),
    ("announce_owner", "TEXT"),
    ("announce_until", "REAL"),
)
# The delivery state's columns (docs/poller.md, "Delivery"), added to an older ledger on open:
# its decisions then read as never attempted (announced ones are delivered all the same).
DELIVERY_COLUMNS = (
    ("delivery_attempts", "BIGINT NOT NULL DEFAULT 0"),
    ("delivery_error", "TEXT"),
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

# Freshness (poller/freshness_store.py): one row per (instance id, boot), in both backends.
# Not pruned, like the decisions: a few dozen bytes per boot.
FRESHNESS_TABLE = """CREATE TABLE IF NOT EXISTS freshness (
    instance_id TEXT NOT NULL,
    boot        TEXT NOT NULL,
    seq         BIGINT NOT NULL,
    rx          DOUBLE PRECISION NOT NULL,
    known       INTEGER NOT NULL,
    noted_by    TEXT NOT NULL,
    PRIMARY KEY (instance_id, boot)
)"""

# The boot counter record (poller/boots.py, docs/poller.md "Boot order"): per instance the
# highest boot counter any reader saw, its boot, and when (a reader's clock) its first line was
# first received. It only ever rises (``raise_boot``), in both backends.
BOOT_COUNTERS_TABLE = """CREATE TABLE IF NOT EXISTS boot_counters (
    instance_id TEXT NOT NULL PRIMARY KEY,
    counter     BIGINT NOT NULL,
    boot        TEXT NOT NULL,
    began       DOUBLE PRECISION NOT NULL,
    noted_by    TEXT NOT NULL
)"""


# Alarms about an instance as a whole, raised by a poller and shown in the decisions view
# (``decisions alarms``; docs/poller.md, "Untracked VMs"): ``vm_untracked``, a VM that left the
# fleet's label selection while it still ran. One row per (instance id, alarm); a cleared one
# keeps its row (``cleared_at``, why) until it is raised again.
ALARMS_TABLE = """CREATE TABLE IF NOT EXISTS instance_alarms (
    instance_id TEXT NOT NULL,
    alarm       TEXT NOT NULL,
    instance    TEXT NOT NULL,
    status      TEXT NOT NULL,
    labels      TEXT NOT NULL,
    raised_at   DOUBLE PRECISION NOT NULL,
    raised_by   TEXT NOT NULL,
    seen_at     DOUBLE PRECISION NOT NULL,
    cleared_at  DOUBLE PRECISION,
    cleared_why TEXT,
    PRIMARY KEY (instance_id, alarm)
)"""


class SqlDb:
    """A ledger's connection: what every store needs from a backend.

    ``owner`` names this poller in the rows it writes (decisions, leases, pins). One connection
    serves every thread of a poller (the fleet's pool) and every store: each store's public
    method holds ``lock``, so a transaction never interleaves with another thread's statements.
    """

    owner: str
    lock: threading.RLock
    # The driver's exception types: the CLI treats these as "ledger unavailable" (exit 74).
    errors: tuple[type[BaseException], ...] = ()
    # appended to the SELECT that locks one assembly_boots row ("" where a transaction holds
    # the whole database, as SQLite's BEGIN IMMEDIATE does)
    for_update = ""

    def begin_write(self) -> None:
        """Start a transaction that holds the ledger's claim lock until commit/rollback."""
        raise NotImplementedError

    def begin_plain(self) -> None:
        """Start a transaction for the assembly state (row locks, not the claim lock)."""
        self.begin_write()

    def exec(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        """Run one statement (``?`` placeholders); rows for a SELECT/RETURNING, else []."""
        raise NotImplementedError

    def execmany(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        """One statement (``?`` placeholders) for each row, in one round trip where it can."""
        for r in rows:
            self.exec(sql, r)

    def execvalues(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        """An ``INSERT ... VALUES (?, ...) [ON CONFLICT ...]`` for every row, in order: as
        ``execmany`` here (SQLite runs in process: a statement costs no round trip); PostgreSQL
        sends one statement per chunk of rows (a multi-row ``VALUES``). No two rows may be
        the same row of the table where the statement updates on conflict."""
        self.execmany(sql, rows)

    def rowcount(self, sql: str, params: tuple[object, ...]) -> int:
        """Run one statement; the number of rows it changed."""
        raise NotImplementedError

    def commit(self) -> None:
        self.exec("COMMIT")

    def rollback(self) -> None:
        self.exec("ROLLBACK")

    def close(self) -> None:
        raise NotImplementedError


class _HasDb(Protocol):
    db: SqlDb


_F = TypeVar("_F", bound=Callable[..., Any])


def locked(fn: _F) -> _F:
    """A store's public method: holds its connection's lock for the whole call."""

    @functools.wraps(fn)
    def wrapper(self: _HasDb, *args: Any, **kwargs: Any) -> Any:
        with self.db.lock:
            return fn(self, *args, **kwargs)

    return cast(_F, wrapper)


def _is_busy(e: BaseException) -> bool:
    """SQLite's "database is locked" / "busy", the errors an open retries."""
    return isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e))


def default_owner() -> str:
    """A ledger owner's default name: host and pid, and a random part, since replicas of one
    container image often share both (pid 1, a fixed hostname) and leases go by owner."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class SqliteDb(SqlDb):
    """The SQLite ledger file at ``path`` (created if missing)."""

    errors = (sqlite3.Error,)

    def __init__(
        self,
        path: str | Path,
        owner: str = "",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.lock = threading.RLock()
        self.owner = owner or default_owner()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; we issue BEGIN IMMEDIATE ourselves.
        self._db = sqlite3.connect(
            str(self.path),
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
            check_same_thread=False,  # shared by the fleet's threads under self.lock
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
        made = [0]

        def one(n: int) -> None:
            made[0] = n
            self._init_schema()

        def next_wait(n: int, _e: BaseException) -> float | None:
            wait = _OPEN_BACKOFF.wait(n, 0.0)
            return None if clock() + wait > deadline else wait  # never past the deadline

        try:
            retry_call(one, next_wait, retry_on=_is_busy, sleep=sleep)
        except sqlite3.OperationalError as e:
            if not _is_busy(e):
                raise
            raise sqlite3.OperationalError(
                f"{e} (gave up opening {self.path} after {made[0]} attempts)"
            ) from e

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
            db.execute(ALARMS_TABLE)
            for stmt in ASSEMBLY_SCHEMA:
                db.execute(stmt)
            db.execute(COST_TABLE)
            db.execute(FRESHNESS_TABLE)
            db.execute(BOOT_COUNTERS_TABLE)  # (IF NOT EXISTS: an older ledger gets it here)
            have = {str(r[1]) for r in db.execute("PRAGMA table_info(decisions)")}
            missing = [(n, t) for n, t in _ADDED_COLUMNS if n not in have]
            for name, sqltype in missing:
                db.execute(f"ALTER TABLE decisions ADD COLUMN {name} {sqltype}")
            if missing:  # an older ledger: what it holds was announced when it was decided
                db.execute(
                    "UPDATE decisions SET announced_at = decided_at, announced_by = owner"
                    " WHERE announced_at IS NULL"
                )
            for name, sqltype in DELIVERY_COLUMNS:
                if name not in have:
                    db.execute(f"ALTER TABLE decisions ADD COLUMN {name} {sqltype}")
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

    def begin_write(self) -> None:
        # IMMEDIATE takes the write lock before reading: two processes cannot both see
        # "no decision yet".
        self._db.execute("BEGIN IMMEDIATE")

    def rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def exec(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        return [tuple(r) for r in self._db.execute(sql, params).fetchall()]

    def execmany(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        if rows:
            self._db.executemany(sql, rows)

    def rowcount(self, sql: str, params: tuple[object, ...]) -> int:
        return int(self._db.execute(sql, params).rowcount)
