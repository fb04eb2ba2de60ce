"""``open_ledger``: the ledger ``--ledger`` names, SQLite or PostgreSQL, as its stores.

A ledger is one database (a SQLite file or a PostgreSQL database) holding four stores, each one
concern behind its own protocol: the decisions (:class:`~gce_watchdog.poller.ledger.DecisionStore`),
the pins (:class:`~gce_watchdog.poller.pin_store.PinStore`), the Pub/Sub workers' assembly
state (:class:`~gce_watchdog.poller.assembly_store.AssemblyStore`) and each boot's freshness
(:class:`~gce_watchdog.poller.freshness_store.FreshnessStore`). They share one connection
(:mod:`~gce_watchdog.poller.ledger_db`), so a caller holding a :class:`Ledger` closes it once.

Apart from both backends so that neither imports the other; the PostgreSQL backend is imported only
when a URL asks for it (psycopg is the ``[postgres]`` extra).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gce_watchdog.poller.assembly_store import SqlAssembly
from gce_watchdog.poller.freshness_store import SqlFreshness
from gce_watchdog.poller.ledger import ANNOUNCE_LEASE_S, SqlDecisions
from gce_watchdog.poller.ledger_db import SqlDb, SqliteDb
from gce_watchdog.poller.pin_store import SqlPins
from gce_watchdog.poller.settings import ledger_backend


class Ledger:
    """One open ledger: ``decisions``, ``pins``, ``assembly`` and ``freshness`` over one
    connection. A context
    manager, or call close()."""

    def __init__(self, db: SqlDb, announce_lease_s: float = ANNOUNCE_LEASE_S) -> None:
        self.db = db
        self.decisions = SqlDecisions(db, announce_lease_s)
        self.pins = SqlPins(db)
        self.assembly = SqlAssembly(db)
        self.freshness = SqlFreshness(db)

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """What the backend raises when the ledger fails (the CLI's exit 74)."""
        return self.db.errors

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_ledger(
    spec: str | Path,
    owner: str = "",
    announce_lease_s: float = ANNOUNCE_LEASE_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Ledger:
    """A ledger from ``--ledger``: a ``postgresql://`` URL (psycopg 3, the [postgres] extra) or a
    SQLite file path; ValueError for a URL of another scheme (:func:`ledger_backend`).
    ``sleep``/``clock``: the SQLite open's retry of a locked fresh file waits on these."""
    if ledger_backend(spec) == "postgresql":
        from gce_watchdog.poller.ledger_pg import PostgresDb

        return Ledger(PostgresDb(str(spec), owner), announce_lease_s)
    return Ledger(SqliteDb(spec, owner, sleep=sleep, clock=clock), announce_lease_s)
