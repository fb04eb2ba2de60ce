"""``open_ledger``: the ledger ``--ledger`` names, SQLite or PostgreSQL, behind one interface.

Apart from both backends so that neither imports the other: ``ledger_pg`` builds on
``ledger.BaseLedger``, and this factory picks one of them. The PostgreSQL backend is imported only
when a URL asks for it (psycopg is the ``[postgres]`` extra).
"""

from __future__ import annotations

from pathlib import Path

from gce_watchdog.poller.ledger import ANNOUNCE_LEASE_S, BaseLedger, Ledger
from gce_watchdog.poller.settings import ledger_backend


def open_ledger(
    spec: str | Path, owner: str = "", announce_lease_s: float = ANNOUNCE_LEASE_S
) -> BaseLedger:
    """A ledger from ``--ledger``: a ``postgresql://`` URL (psycopg 3, the [postgres] extra) or a
    SQLite file path; ValueError for a URL of another scheme (:func:`ledger_backend`)."""
    if ledger_backend(spec) == "postgresql":
        from gce_watchdog.poller.ledger_pg import PostgresLedger

        return PostgresLedger(str(spec), owner, announce_lease_s=announce_lease_s)
    return Ledger(spec, owner, announce_lease_s=announce_lease_s)
