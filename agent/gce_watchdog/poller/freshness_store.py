"""The freshness store: per (instance id, boot), the newest verified seq any reader received
and when it was first received, on that reader's clock (docs/poller.md, "Freshness"), in the
ledger's database beside the decisions, shared by every poller on every host; and per
instance the highest boot counter any reader saw (``boot_record``, ``raise_boot``: the boot
order's record, poller/boots.py, docs/poller.md "Boot order").

Silence is measured from this record, not from when *this* reader first read the line: a
poller that starts with no cursors (the Cloud Run job form) reads every VM's retained output
again, and its own receive time of a line written hours ago would call a wedged VM healthy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gce_watchdog.poller.boots import Record
from gce_watchdog.poller.ledger_db import SqlDb, locked


@dataclass(frozen=True)
class Fresh:
    """The newest verified line of a boot any reader received: its ``seq``, and ``rx``, when
    a reader first received it (that reader's clock). ``known``: the line arrived after an
    earlier record of the boot (this reader's previous read, or a lower seq in the ledger), so
    it was written between that record and ``rx``; False: found by a reader's first read with
    no record at all, its age is not known (it may be hours old)."""

    seq: int
    rx: float
    known: bool


class FreshnessStore(Protocol):
    """Where readers share each boot's freshness (``note``: one call per read)."""

    def note(self, instance_id: str, boot: str, seq: int, rx: float, known: bool) -> Fresh: ...

    def boot_record(self, instance_id: str) -> Record | None: ...

    def raise_boot(self, instance_id: str, record: Record) -> Record: ...


class SqlFreshness:
    """The freshness records over a ledger database (SQLite or PostgreSQL: ``SqlDb``)."""

    def __init__(self, db: SqlDb) -> None:
        self.db = db

    @locked
    def note(self, instance_id: str, boot: str, seq: int, rx: float, known: bool) -> Fresh:
        """A reader's newest verified line of ``boot``: ``seq``, first received by it at ``rx``
        (``known`` as in :class:`Fresh`). Returns the record that stands afterwards: the stored
        one when it has this seq or a newer one (its time is the first receipt: readers that
        read the same line later use it); else this line, now stored, ``known`` when a lower
        seq was on record (the line came after it). A read with nothing newer writes nothing."""
        q = "SELECT seq, rx, known FROM freshness WHERE instance_id = ? AND boot = ?"
        rows = self.db.exec(q, (instance_id, boot))
        if rows and int(str(rows[0][0])) >= seq:
            return _fresh(rows[0])
        row = self._rise(
            q,
            (instance_id, boot),
            seq,
            (
                "INSERT INTO freshness (instance_id, boot, seq, rx, known, noted_by)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (instance_id, boot) DO NOTHING",
                (instance_id, boot, seq, rx, int(known), self.db.owner),
            ),
            (
                "UPDATE freshness SET seq = ?, rx = ?, known = 1, noted_by = ?"
                " WHERE instance_id = ? AND boot = ? AND seq < ?",
                (seq, rx, self.db.owner, instance_id, boot, seq),
            ),
        )
        return _fresh(row)

    @locked
    def boot_record(self, instance_id: str) -> Record | None:
        """The instance's highest boot counter on record, its boot and when it began (None: no
        reader saw a counter of it yet)."""
        rows = self.db.exec(
            "SELECT counter, boot, began FROM boot_counters WHERE instance_id = ?", (instance_id,)
        )
        return _record(rows[0]) if rows else None

    @locked
    def raise_boot(self, instance_id: str, record: Record) -> Record:
        """Store ``record`` if its counter is above the one on record (it only rises; equal
        counters keep the first boot stored); returns the record that stands afterwards."""
        q = "SELECT counter, boot, began FROM boot_counters WHERE instance_id = ?"
        c, owner = record.counter, self.db.owner
        row = self._rise(
            q,
            (instance_id,),
            c,
            (
                "INSERT INTO boot_counters (instance_id, counter, boot, began, noted_by)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (instance_id) DO NOTHING",
                (instance_id, c, record.boot, record.began, owner),
            ),
            (
                "UPDATE boot_counters SET counter = ?, boot = ?, began = ?, noted_by = ?"
                " WHERE instance_id = ? AND counter < ?",
                (c, record.boot, record.began, owner, instance_id, c),
            ),
        )
        return _record(row)

    def _rise(
        self,
        q: str,
        key: tuple[object, ...],
        value: int,
        insert: tuple[str, tuple[object, ...]],
        update: tuple[str, tuple[object, ...]],
    ) -> tuple[object, ...]:
        """A record that only rises, in one transaction: the row ``q`` selects by ``key``
        (first column: the number compared) locked; ``insert`` when there is none, ``update``
        when it holds less than ``value``; the row that stands afterwards."""
        try:
            self.db.begin_plain()
            rows = self.db.exec(q + self.db.for_update, key)
            if not rows:
                self.db.exec(*insert)
            elif int(str(rows[0][0])) < value:
                self.db.exec(*update)
            rows = self.db.exec(q, key)
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return rows[0]


def _record(row: tuple[object, ...]) -> Record:
    counter, boot, began = row
    return Record(int(str(counter)), str(boot), float(str(began)))


def _fresh(row: tuple[object, ...]) -> Fresh:
    seq, rx, known = row
    return Fresh(int(str(seq)), float(str(rx)), bool(int(str(known))))
