"""``open_ledger``: the ledger ``--ledger`` names, SQLite or PostgreSQL, behind one interface.

Apart from both backends so that neither imports the other: ``ledger_pg`` builds on
``ledger.BaseLedger``, and this factory picks one of them. The PostgreSQL backend is imported only
when a URL asks for it (psycopg is the ``[postgres]`` extra).
"""

from __future__ import annotations

import re
from pathlib import Path

from gce_watchdog.poller.ledger import ANNOUNCE_LEASE_S, BaseLedger, Ledger

# The URI schemes libpq accepts (PostgreSQL docs, "Connection URIs": postgresql:// or
# postgres://). Any other scheme://... is refused, never taken for a SQLite file name.
POSTGRES_SCHEMES = ("postgresql", "postgres")
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def ledger_backend(spec: str | Path) -> str:
    """``"postgresql"`` or ``"sqlite"`` for a ``--ledger`` value; ValueError for a URL of any other
    scheme (``mysql://``, ``postgresql+psycopg://``, ``sqlite:///``). A SQLite path there would
    give each host a private ledger, and exactly-once across hosts would be lost without a word.
    The message names only the scheme: the URL may carry a password."""
    if isinstance(spec, Path):
        return "sqlite"
    m = _SCHEME_RE.match(spec)
    if m is None:
        return "sqlite"
    if m.group(1) in POSTGRES_SCHEMES:
        return "postgresql"
    raise ValueError(
        f"unknown URL scheme {m.group(1)!r}: want a postgresql:// URL or a SQLite file path"
    )


def open_ledger(
    spec: str | Path, owner: str = "", announce_lease_s: float = ANNOUNCE_LEASE_S
) -> BaseLedger:
    """A ledger from ``--ledger``: a ``postgresql://`` URL (psycopg 3, the [postgres] extra) or a
    SQLite file path; ValueError for a URL of another scheme (:func:`ledger_backend`)."""
    if ledger_backend(spec) == "postgresql":
        from gce_watchdog.poller.ledger_pg import PostgresLedger

        return PostgresLedger(str(spec), owner, announce_lease_s=announce_lease_s)
    return Ledger(spec, owner, announce_lease_s=announce_lease_s)
