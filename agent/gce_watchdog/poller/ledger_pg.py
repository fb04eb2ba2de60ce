"""The PostgreSQL ledger database: the stores' semantics as in SQLite, shared by pollers on many
hosts.

``--ledger postgresql://user@host/db`` (psycopg 3, the ``[postgres]`` extra). The connection runs
in autocommit mode and every write that must be atomic is an explicit transaction:

- a claim takes ``SELECT ... FROM fence WHERE id = 1 FOR UPDATE`` first. That row lock plays the
  part of SQLite's ``BEGIN IMMEDIATE``: claims are serialised across every host, so two pollers
  cannot both see "no decision yet", and the fencing token (``fence.last_token + 1`` in the same
  transaction) has no holes and never goes back. Claims are rare (one per failover), so one lock
  for all of them costs nothing measurable; reads never take it.
- the primary key on ``(instance_id, boot)`` is the second line of defence, as in SQLite;
- the announcement lease and the "announced" mark are single conditional ``UPDATE``s, atomic
  under PostgreSQL's row locking at READ COMMITTED.

A claim returns only after ``COMMIT`` returned, i.e. after the server made it durable
(``synchronous_commit`` as configured on the server; keep the default ``on``).
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from gce_watchdog.poller.ledger_db import (
    ALARMS_TABLE,
    ASSEMBLY_SCHEMA,
    BOOT_COUNTERS_TABLE,
    COST_TABLE,
    DELIVERY_COLUMNS,
    DISPATCH_TABLES,
    FRESHNESS_TABLE,
    PIN_REKEYS_TABLE,
    SqlDb,
    default_owner,
)

# Rows per multi-row INSERT (execvalues): 9 columns x 500 rows stays far below the protocol's
# 65,535 parameters, and a pull's lines fit in one or two statements.
VALUES_ROWS = 500
# A statement that waits this long for a lock is cancelled, so a stuck peer cannot hold every
# poller forever (the same bound as SQLite's busy timeout).
LOCK_TIMEOUT_MS = 30_000
# psycopg prepares a statement run 5 times; PostgreSQL then may run a generic plan, made
# without the parameters' values. For the Pub/Sub store's "instance_id IN (...)" reads that plan
# was a whole-table scan (planned while the tables were small), 5-7 ms a pull instead of 0.2;
# every statement is still parsed once but planned with its values (PostgreSQL 12 or later).
PLAN_CACHE_MODE = "force_custom_plan"
# Connecting to the database: a poller that cannot reach it exits 74 rather than hang.
CONNECT_TIMEOUT_S = 10

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS decisions (
        instance_id    TEXT NOT NULL,
        boot           TEXT NOT NULL,
        token          BIGINT NOT NULL UNIQUE,
        verdict        TEXT NOT NULL,
        reason         TEXT NOT NULL,
        instance       TEXT NOT NULL,
        owner          TEXT NOT NULL,
        decided_at     DOUBLE PRECISION NOT NULL,
        reaped_at      DOUBLE PRECISION,
        reap_result    TEXT,
        announced_at   DOUBLE PRECISION,
        announced_by   TEXT,
        announce_owner TEXT,
        announce_until DOUBLE PRECISION,
        PRIMARY KEY (instance_id, boot)
    )""",
    """CREATE TABLE IF NOT EXISTS fence (
        id         INTEGER PRIMARY KEY CHECK (id = 1),
        last_token BIGINT NOT NULL
    )""",
    "INSERT INTO fence (id, last_token) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
    "CREATE INDEX IF NOT EXISTS decisions_instance ON decisions (instance)",
    """CREATE TABLE IF NOT EXISTS pins (
        instance_id TEXT PRIMARY KEY,
        fingerprint TEXT NOT NULL,
        public      TEXT,
        source      TEXT NOT NULL,
        pinned_at   DOUBLE PRECISION NOT NULL,
        pinned_by   TEXT NOT NULL
    )""",
    # DDL is transactional: this index and the pins table existing mean the schema is committed.
    "CREATE INDEX IF NOT EXISTS decisions_pending ON decisions (token) WHERE announced_at IS NULL",
)
# Serialises schema creation when pollers start together (CREATE TABLE IF NOT EXISTS alone can
# fail with a unique violation on pg_type when two sessions create the same table at once). The
# DDL runs only when the schema is missing: CREATE INDEX IF NOT EXISTS still takes a SHARE lock
# on its table, which deadlocks against a running claim (seen with 8 pollers starting at once).
_SCHEMA_LOCK_KEY = 0x6763_6577_6400  # "gcewd" as an advisory lock key


class PostgresDb(SqlDb):
    """The ledger in the PostgreSQL database at ``url``."""

    errors = (psycopg.Error,)

    def __init__(
        self,
        url: str,
        owner: str = "",
        lock_timeout_ms: int = LOCK_TIMEOUT_MS,
    ) -> None:
        self.url = url
        self.owner = owner or default_owner()
        self.lock = threading.RLock()
        self._db: psycopg.Connection[Any] = psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name="gce-watchdog-poller",
            options=f"-c lock_timeout={int(lock_timeout_ms)} -c plan_cache_mode={PLAN_CACHE_MODE}",
        )
        try:
            if not self._schema_ready():
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    if not self._schema_ready():
                        for stmt in _SCHEMA:
                            self._db.execute(stmt)
            if not self._ready("brake_holds"):  # the decisions interface's tables (later)
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    if not self._ready("brake_holds"):
                        for stmt in DISPATCH_TABLES:
                            self._db.execute(stmt)
            if not self._ready("instance_alarms"):  # vm_untracked (later)
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    self._db.execute(ALARMS_TABLE)  # (IF NOT EXISTS: idempotent)
            if not self._ready("pin_rekeys"):  # key rotations (later)
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    if not self._ready("pin_rekeys"):
                        self._db.execute(PIN_REKEYS_TABLE)
            if not self._has_column("decisions", "delivery_error"):  # delivery state, later
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    for name, sqltype in DELIVERY_COLUMNS:  # (IF NOT EXISTS: idempotent)
                        self._db.execute(
                            f"ALTER TABLE decisions ADD COLUMN IF NOT EXISTS {name} {sqltype}"
                        )
            if not self._ready("decision_costs"):  # what a decided boot cost (later)
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    if not self._ready("decision_costs"):
                        self._db.execute(COST_TABLE)
            if not self._ready("freshness"):  # each boot's freshness (later)
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    if not self._ready("freshness"):
                        self._db.execute(FRESHNESS_TABLE)
            if not self._ready("boot_counters"):  # the boot counter record (later)
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    self._db.execute(BOOT_COUNTERS_TABLE)  # (IF NOT EXISTS: idempotent)
            if not self._ready("assembly_boots_ended"):  # the Pub/Sub workers' shared state
                with self._db.transaction():
                    self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    if not self._ready("assembly_boots_ended"):
                        for stmt in ASSEMBLY_SCHEMA:
                            self._db.execute(stmt)
        except BaseException:
            self._db.close()
            raise

    def _schema_ready(self) -> bool:
        # pins came after the first release: a database without it gets the (idempotent) DDL
        row = self._db.execute(
            "SELECT to_regclass('decisions_pending') IS NOT NULL"
            " AND to_regclass('pins') IS NOT NULL"
        ).fetchone()
        return bool(row and row[0])

    def _has_column(self, table: str, column: str) -> bool:
        row = self._db.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s)"
            " AND attname = %s AND NOT attisdropped)",
            (table, column),
        ).fetchone()
        return bool(row and row[0])

    def _ready(self, table: str) -> bool:
        row = self._db.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
        return bool(row and row[0])

    def close(self) -> None:
        self._db.close()

    def begin_write(self) -> None:
        self._db.execute("BEGIN")
        self._db.execute("SELECT last_token FROM fence WHERE id = 1 FOR UPDATE")

    # the assembly state locks one boot's row, never the claim lock (fence)
    for_update = " FOR UPDATE"

    def begin_plain(self) -> None:
        self._db.execute("BEGIN")

    def rollback(self) -> None:
        # Only inside a transaction (a failed BEGIN leaves none) and on a live connection: a
        # ROLLBACK that raises would hide the error being handled.
        if self._db.closed or self._db.info.transaction_status == TransactionStatus.IDLE:
            return
        self._db.execute("ROLLBACK")

    def exec(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        cur = self._db.execute(sql.replace("?", "%s"), params)
        return [tuple(r) for r in cur.fetchall()] if cur.description else []

    def execmany(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        if rows:  # psycopg 3 pipelines executemany: one round trip for the batch
            with self._db.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), rows)

    def execvalues(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        """One multi-row ``VALUES`` statement per ``VALUES_ROWS`` rows, in the rows' order (the
        order rows are locked in): PostgreSQL plans and runs one statement for the chunk where
        ``execmany`` had it run one per row (the Pub/Sub store's lines and boots, per pull)."""
        if not rows:
            return
        head, sep, rest = sql.partition("VALUES (")
        group, close, tail = rest.partition(")")
        assert sep and close and set(group.replace(" ", "")) <= {"?", ","}, sql
        assert "?" not in head + tail, sql
        one = f"({group.replace('?', '%s')})"
        for i in range(0, len(rows), VALUES_ROWS):
            chunk = rows[i : i + VALUES_ROWS]
            params = tuple(v for r in chunk for v in r)
            self._db.execute(f"{head}VALUES {', '.join([one] * len(chunk))}{tail}", params)

    def rowcount(self, sql: str, params: tuple[object, ...]) -> int:
        cur = self._db.execute(sql.replace("?", "%s"), params)
        return int(cur.rowcount)
