"""The pins store: each instance id's protocol v3 line key, shared by every reader
(docs/serial-protocol.md, "Pins"), in the ledger's database beside the decisions."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, replace
from typing import Protocol

from gce_watchdog.poller.ledger_db import SqlDb, locked
from gce_watchdog.wire.protocol import MAX_RETIRED, Retired, Retirees


@dataclass(frozen=True)
class Pin:
    """An instance id's v3 line key, shared by every reader (docs/serial-protocol.md, "Pins").

    ``public``: the Ed25519 public key, or None for a hand pin whose key no reader has seen yet
    (an announcement with ``fingerprint`` fills it in). ``source``: ``placed`` (from the first
    line of the instance's first boot, read from byte 0, once its start
    is settled), ``hand`` (``gce-watchdog pin``) or
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
    """Where readers share protocol v3 pins (``get_pin``/``place_pin``/``rekey_pin``;
    ``hand_pin`` for operators):
    the poll path (poller/reader.py) places a pin from byte 0 of the port, an operator by hand;
    a Pub/Sub worker (poller/pubsub.py) never places one itself, and both move a pin only through
    a ``rekey`` line that verifies under it."""

    def get_pin(self, instance_id: str) -> Pin | None: ...

    def get_pins(self, instance_ids: list[str]) -> dict[str, Pin]: ...

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

    def hand_pin(
        self, instance_id: str, fingerprint: str, now: float | None = None, *, replace: bool = True
    ) -> Pin | None: ...


PIN_PLACED = "placed"
PIN_HAND = "hand"
PIN_REKEY = "rekey"
_PIN_COLUMNS = "instance_id, fingerprint, public, source, pinned_at, pinned_by"


def _pin_row(row: tuple[object, ...]) -> Pin:
    iid, fp, public, source, at, by = row
    raw = _unb64(str(public)) if public else None
    return Pin(str(iid), str(fp), raw, str(source), float(at), str(by))  # type: ignore[arg-type]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SqlPins:
    """The pins over a ledger database (SQLite or PostgreSQL: the backend's ``SqlDb``)."""

    def __init__(self, db: SqlDb) -> None:
        self.db = db

    @locked
    def get_pin(self, instance_id: str) -> Pin | None:
        rows = self.db.exec(
            f"SELECT {_PIN_COLUMNS} FROM pins WHERE instance_id = ?",  # noqa: S608 (constants)
            (instance_id,),
        )
        if not rows:
            return None
        pin = _pin_row(rows[0])
        if pin.source != PIN_REKEY:
            return pin
        rk = self.db.exec(
            "SELECT old_public, boot, seq FROM pin_rekeys WHERE instance_id = ?"
            " ORDER BY rekeyed_at, seq",
            (instance_id,),
        )
        chain = tuple(Retired(_unb64(str(o)), str(b), int(str(q))) for o, b, q in rk)
        return replace(pin, retired=chain[-MAX_RETIRED:])

    @locked
    def get_pins(self, instance_ids: list[str]) -> dict[str, Pin]:
        """The pins of those instances that have one: one query per 500 ids (a Pub/Sub worker's
        batch), the rotation chain read only for a pin a rekey moved."""
        out: dict[str, Pin] = {}
        ids = sorted(set(instance_ids))
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ", ".join("?" * len(chunk))
            for row in self.db.exec(
                f"SELECT {_PIN_COLUMNS} FROM pins WHERE instance_id IN ({marks})",  # noqa: S608
                tuple(chunk),
            ):
                pin = _pin_row(row)
                out[pin.instance_id] = pin
        for iid, pin in list(out.items()):
            if pin.source == PIN_REKEY:
                again = self.get_pin(iid)
                if again is not None:
                    out[iid] = again
        return out

    @locked
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
            self.db.begin_write()
            n = self.db.rowcount(
                "UPDATE pins SET fingerprint = ?, public = ?, source = ?, pinned_at = ?,"
                " pinned_by = ? WHERE instance_id = ? AND public = ?",
                (fingerprint, _b64(new), PIN_REKEY, at, self.db.owner, instance_id, _b64(old)),
            )
            if n:
                self.db.exec(
                    "DELETE FROM pin_rekeys WHERE instance_id = ? AND old_public = ?",
                    (instance_id, _b64(old)),
                )
                self.db.exec(
                    "INSERT INTO pin_rekeys (instance_id, old_public, boot, seq, rekeyed_at,"
                    " rekeyed_by) VALUES (?, ?, ?, ?, ?, ?)",
                    (instance_id, _b64(old), boot, seq, at, self.db.owner),
                )
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return self.get_pin(instance_id)

    @locked
    def place_pin(
        self, instance_id: str, public: bytes, fingerprint: str, now: float | None = None
    ) -> Pin:
        """Store the key a reader placed, unless the instance has a pin already; returns the
        stored pin (the first one wins: every reader then uses it). A hand pin of the same
        fingerprint that lacked the public key gets it."""
        at = time.time() if now is None else now
        try:
            self.db.begin_write()
            self.db.exec(
                "INSERT INTO pins (instance_id, fingerprint, public, source, pinned_at, pinned_by)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (instance_id) DO NOTHING",
                (instance_id, fingerprint, _b64(public), PIN_PLACED, at, self.db.owner),
            )
            self.db.exec(
                "UPDATE pins SET public = ? WHERE instance_id = ? AND fingerprint = ?"
                " AND public IS NULL",
                (_b64(public), instance_id, fingerprint),
            )
            rows = self.db.exec(
                f"SELECT {_PIN_COLUMNS} FROM pins WHERE instance_id = ?",  # noqa: S608
                (instance_id,),
            )
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return _pin_row(rows[0])

    @locked
    def hand_pin(
        self, instance_id: str, fingerprint: str, now: float | None = None, *, replace: bool = True
    ) -> Pin | None:
        """An operator's pin (``gce-watchdog pin``). Returns the pin the instance had before,
        or None. The store changes only when the instance had no pin, or ``replace`` and its pin
        has another fingerprint: a pin of the same fingerprint is kept as it is (its public key,
        its rotations), and without ``replace`` another pin is never overwritten (the caller
        compares the returned pin's fingerprint to tell). One transaction: two operators racing
        cannot both see "no pin"."""
        at = time.time() if now is None else now
        try:
            self.db.begin_write()
            rows = self.db.exec(
                f"SELECT {_PIN_COLUMNS} FROM pins WHERE instance_id = ?",  # noqa: S608
                (instance_id,),
            )
            old = _pin_row(rows[0]) if rows else None
            if old is None or (replace and old.fingerprint != fingerprint):
                self.db.exec("DELETE FROM pins WHERE instance_id = ?", (instance_id,))
                self.db.exec("DELETE FROM pin_rekeys WHERE instance_id = ?", (instance_id,))
                self.db.exec(
                    "INSERT INTO pins (instance_id, fingerprint, public, source, pinned_at,"
                    " pinned_by) VALUES (?, ?, NULL, ?, ?, ?)",
                    (instance_id, fingerprint, PIN_HAND, at, self.db.owner),
                )
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return old
