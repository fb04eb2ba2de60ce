"""The assembly store: the Pub/Sub workers' shared assembly state (poller/pubsub.py,
poller/assemble.py), in the ledger's database (tables of their own, the same in both backends)
so that no worker keeps any of its own (docs/poller.md, "Many workers")."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gce_watchdog.poller.assemble import MAX_PREFIX, Received
from gce_watchdog.poller.ledger_db import SqlDb, locked
from gce_watchdog.poller.verdict import terminal_kind
from gce_watchdog.wire.protocol import Event

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


class AssemblyStore(Protocol):
    """What the workers share: every method is one transaction, committed when it returns."""

    def store(
        self, lines: list[StoredLine], raw: list[RawLine]
    ) -> tuple[set[tuple[str, str]], int]: ...

    def unverified(self, instance_id: str) -> list[RawLine]: ...

    def raw_instances(self) -> list[str]: ...

    def drop_unverified(self, instance_id: str, texts: list[str]) -> None: ...

    def update(
        self, instance_id: str, boot: str, fn: Callable[[BootLines], BootUpdate]
    ) -> tuple[BootLines, BootUpdate] | None: ...

    def update_many(
        self, boots: list[tuple[str, str]], fn: Callable[[BootLines], BootUpdate]
    ) -> dict[tuple[str, str], tuple[BootLines, BootUpdate]]: ...

    def set_state(self, instance_id: str, boot: str, state: str) -> None: ...

    def set_states(self, boots: list[tuple[str, str]], state: str) -> None: ...

    def gaps_due(self, before: float) -> list[tuple[str, str]]: ...

    def next_gap(self) -> float | None: ...

    def heard(self, instance_id: str) -> tuple[float | None, bool]: ...

    def boots(self, state: str | None = None) -> list[tuple[str, str, str]]: ...

    def instances(self) -> int: ...

    def prune(self, before: float) -> int: ...


class SqlAssembly:
    """The assembly state over a ledger database (SQLite or PostgreSQL: the backend's ``SqlDb``).

    Every method is one transaction: a worker acks a message only after the method that stored
    its line returned (committed). docs/poller.md "Many workers" has the protocol.
    """

    def __init__(self, db: SqlDb) -> None:
        self.db = db

    @locked
    def store(
        self, lines: list[StoredLine], raw: list[RawLine]
    ) -> tuple[set[tuple[str, str]], int]:
        """Store received lines (duplicates ignored), durably when it returns.

        Returns the open boots among them that have a terminal line stored (by anyone: the
        caller looks at those again) and the count of raw lines dropped past UNVERIFIED_MAX.
        """
        order = sorted(lines, key=lambda x: (x.instance_id, x.event.boot, x.event.seq))
        boots = _per_boot(order)
        try:
            self.db.begin_plain()
            # rows in one order (sorted) in every worker: no two transactions wait on each other.
            # gap_since: "look again by then", set below where a look is due; terminal: the
            # lowest seq of a terminal line stored, so whoever stores a boot's last missing line
            # knows to look at it.
            self.db.execvalues(  # one row per boot: a multi-row upsert may touch each once
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
                    (iid, boot, OPEN, ln.project, ln.zone, ln.name, last, None, term)
                    for (iid, boot), (ln, last, _first, term) in sorted(boots.items())
                ],
            )
            # per boot: (state, lowest terminal seq stored, floor)
            states: dict[tuple[str, str], tuple[str, object, int]] = {}
            ids = sorted({iid for iid, _ in boots})
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                marks = ", ".join("?" * len(chunk))
                for iid, boot, state, stored_term, floor in self.db.exec(
                    "SELECT instance_id, boot, state, terminal, floor"  # noqa: S608
                    f" FROM assembly_boots WHERE instance_id IN ({marks})",
                    tuple(chunk),
                ):
                    states[(str(iid), str(boot))] = (str(state), stored_term, int(floor))  # type: ignore[call-overload]
            open_boots = {k for k in boots if states[k][0] == OPEN}
            firsts: dict[tuple[str, str, int], StoredLine] = {}
            for ln in order:  # a seq's first copy in the batch: the one a row per line kept
                if (ln.instance_id, ln.event.boot) in open_boots:
                    firsts.setdefault((ln.instance_id, ln.event.boot, ln.event.seq), ln)
            self.db.execvalues(
                "INSERT INTO assembly_lines (instance_id, boot, seq, event, ts_ms, fields,"
                " text, received_at, published) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (instance_id, boot, seq) DO NOTHING",
                [
                    (ln.instance_id, ln.event.boot, ln.event.seq, ln.event.event,
                     ln.event.ts_ms, json.dumps(ln.event.fields), ln.event.text,
                     ln.received_at, ln.published)
                    for ln in firsts.values()
                ],  # decided, ended or gapped boots: their lines change nothing
            )  # fmt: skip
            self._hint(
                {k: (boots[k][2], states[k][2]) for k in open_boots if states[k][1] is None}
            )  # a terminal's boot is looked at now (the caller), the others only where due
            dropped = self._store_unverified(raw)
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        # only a boot with a terminal line stored can be decided or ended now; the others are
        # looked at when their gap hint is due (gaps_due)
        return {k for k in open_boots if states[k][1] is not None}, dropped

    def _store_unverified(self, raw: list[RawLine]) -> int:
        """Store the raw lines no key verified yet, up to UNVERIFIED_MAX per instance (in the
        caller's transaction); the count of those dropped past it."""
        dropped = 0
        by_iid: dict[str, list[RawLine]] = {}
        for r in sorted(raw, key=lambda x: (x.instance_id, x.text)):
            by_iid.setdefault(r.instance_id, []).append(r)
        keep: list[RawLine] = []
        for iid, rs in by_iid.items():
            ((n,),) = self.db.exec(
                "SELECT COUNT(*) FROM assembly_unverified WHERE instance_id = ?", (iid,)
            )
            room = max(0, UNVERIFIED_MAX - int(n))  # type: ignore[call-overload]
            keep += rs[:room]
            dropped += len(rs) - len(rs[:room])
        self.db.execvalues(
            "INSERT INTO assembly_unverified (instance_id, line, project, zone, name,"
            " received_at, published) VALUES (?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (instance_id, line) DO NOTHING",
            [(r.instance_id, r.text, r.project, r.zone, r.name, r.received_at, r.published)
             for r in keep],
        )  # fmt: skip
        return dropped

    def _hint(self, first: dict[tuple[str, str], tuple[float, int]]) -> None:
        """Set the look-again hint (``gap_since``, kept where set) of those open boots whose
        stored lines have a gap, or exceed ``MAX_PREFIX`` (compaction): at their earliest receipt
        in this batch (``first``: per boot, that receipt and the boot's floor). A boot with
        neither needs no look until its terminal line is stored (the store returns it then); a
        hint set for a gap that another worker has filled since costs one look. A gap no worker
        fills has its lines past it stored by someone, who sees it.

        The seqs are read by instance (the lines' primary key) and counted here: a join with
        ``assembly_boots`` made PostgreSQL hash the whole table on every pull (docs/poller.md)."""
        due: list[tuple[object, ...]] = []
        # per boot: (lines, lines at or above the floor, highest seq)
        counts: dict[tuple[str, str], list[int]] = {}
        ids = sorted({iid for iid, _ in first})
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ", ".join("?" * len(chunk))
            for iid, boot, seq in self.db.exec(
                "SELECT instance_id, boot, seq FROM assembly_lines"  # noqa: S608
                f" WHERE instance_id IN ({marks})",
                tuple(chunk),
            ):
                key = (str(iid), str(boot))
                if key not in first:
                    continue
                n = int(seq)  # type: ignore[call-overload]
                c = counts.setdefault(key, [0, 0, n])
                c[0] += 1
                c[1] += n >= first[key][1]
                c[2] = max(c[2], n)
        for key, (n, above, hi) in counts.items():
            at, lo = first[key]
            gap = hi >= lo and above < hi - lo + 1
            if gap or n > MAX_PREFIX:
                due.append((at, *key))
        self.db.execmany(
            "UPDATE assembly_boots SET gap_since = COALESCE(gap_since, ?)"
            " WHERE instance_id = ? AND boot = ?",
            sorted(due, key=lambda r: (str(r[1]), str(r[2]))),
        )

    @locked
    def unverified(self, instance_id: str) -> list[RawLine]:
        rows = self.db.exec(
            "SELECT line, project, zone, name, received_at, published FROM assembly_unverified"
            " WHERE instance_id = ?",
            (instance_id,),
        )
        return [
            RawLine(instance_id, str(p), str(z), str(n), str(t), float(at), _opt_float(pub))  # type: ignore[arg-type]
            for t, p, z, n, at, pub in rows
        ]

    @locked
    def raw_instances(self) -> list[str]:
        """Instances with raw lines stored (waiting for their pin), at most 1,000."""
        rows = self.db.exec("SELECT DISTINCT instance_id FROM assembly_unverified LIMIT 1000")
        return [str(r[0]) for r in rows]

    @locked
    def drop_unverified(self, instance_id: str, texts: list[str]) -> None:
        for t in texts:
            self.db.exec(
                "DELETE FROM assembly_unverified WHERE instance_id = ? AND line = ?",
                (instance_id, t),
            )

    @locked
    def update(
        self, instance_id: str, boot: str, fn: Callable[[BootLines], BootUpdate]
    ) -> tuple[BootLines, BootUpdate] | None:
        """Look at one boot under its row lock: ``fn`` gets every line any worker stored and says
        what follows; its update is committed before this returns. None if the boot is not open
        (decided, ended or gapped by another worker): its stray lines are dropped."""
        return self.update_many([(instance_id, boot)], fn).get((instance_id, boot))

    @locked
    def update_many(
        self, boots: list[tuple[str, str]], fn: Callable[[BootLines], BootUpdate]
    ) -> dict[tuple[str, str], tuple[BootLines, BootUpdate]]:
        """``update`` for several boots in one transaction (a worker's pull): their rows locked
        in one order (sorted, as the store locks them), their lines read in one query per 500
        instances, ``fn`` called per open boot, every update committed before this returns.
        Boots that are not open are left out (their stray lines dropped)."""
        keys = sorted(set(boots))
        out: dict[tuple[str, str], tuple[BootLines, BootUpdate]] = {}
        if not keys:
            return out
        try:
            self.db.begin_plain()
            heads, lines = self._locked_rows(keys)
            dead = [k for k in keys if k not in heads]  # not open: their stray lines go
            for key in keys:
                if key not in heads:
                    continue
                project, zone, name, floor = heads[key]
                seen = BootLines(*key, project, zone, name, floor, lines.get(key, []))
                out[key] = (seen, fn(seen))
            self.db.execmany(
                "UPDATE assembly_boots SET state = ?, gap_since = ?,"
                " floor = CASE WHEN ? > floor THEN ? ELSE floor END"
                " WHERE instance_id = ? AND boot = ?",
                [(u.state, u.gap_since, u.floor, u.floor, *k) for k, (_, u) in out.items()],
            )
            dead += [k for k, (_, u) in out.items() if u.state != OPEN]
            self.db.execmany(
                "DELETE FROM assembly_lines WHERE instance_id = ? AND boot = ?", sorted(dead)
            )
            self.db.execmany(
                "DELETE FROM assembly_lines WHERE instance_id = ? AND boot = ? AND seq = ?",
                [(*k, seq) for k, (_, u) in out.items() if u.state == OPEN for seq in u.drop],
            )
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return out

    def _locked_rows(
        self, keys: list[tuple[str, str]]
    ) -> tuple[
        dict[tuple[str, str], tuple[str, str, str, int]],
        dict[tuple[str, str], list[tuple[Received, float | None]]],
    ]:
        """Inside a transaction: the open boots among ``keys`` (their rows locked, in sorted
        order: the row-lock clause applies after ORDER BY) and every line stored for them."""
        want = set(keys)
        heads: dict[tuple[str, str], tuple[str, str, str, int]] = {}
        lines: dict[tuple[str, str], list[tuple[Received, float | None]]] = {}
        ids = sorted({iid for iid, _ in keys})
        for i in range(0, len(ids), 500):
            chunk = tuple(ids[i : i + 500])
            marks = ", ".join("?" * len(chunk))
            rows = self.db.exec(  # only constants are joined (marks, the row-lock clause)
                "SELECT instance_id, boot, state, project, zone, name, floor"  # noqa: S608
                f" FROM assembly_boots WHERE instance_id IN ({marks})"
                f" ORDER BY instance_id, boot{self.db.for_update}",
                chunk,
            )
            for iid, boot, state, project, zone, name, floor in rows:
                key = (str(iid), str(boot))
                if key in want and state == OPEN:
                    heads[key] = (str(project), str(zone), str(name), int(floor))  # type: ignore[call-overload]
            got = self.db.exec(
                "SELECT instance_id, boot, seq, event, ts_ms, fields, text,"  # noqa: S608
                f" received_at, published FROM assembly_lines WHERE instance_id IN ({marks})",
                chunk,
            )
            for iid, boot, seq, ev, ts, fields, text, at, pub in got:
                key = (str(iid), str(boot))
                if key not in heads:
                    continue
                lines.setdefault(key, []).append((
                    Received(
                        Event(str(ev), key[1], int(seq), int(ts),  # type: ignore[call-overload]
                              tuple((str(k), str(v)) for k, v in json.loads(str(fields))),
                              str(text)),
                        float(at),  # type: ignore[arg-type]
                    ),
                    _opt_float(pub),
                ))  # fmt: skip
        return heads, lines

    @locked
    def set_states(self, boots: list[tuple[str, str]], state: str) -> None:
        """``set_state`` for several boots in one transaction (the decisions of one pull)."""
        keys: list[tuple[object, ...]] = sorted(set(boots))
        if not keys:
            return
        try:
            self.db.begin_plain()
            self.db.execmany(
                "UPDATE assembly_boots SET state = ?, gap_since = NULL"
                " WHERE instance_id = ? AND boot = ?",
                [(state, *k) for k in keys],
            )
            self.db.execmany(
                "DELETE FROM assembly_lines WHERE instance_id = ? AND boot = ?", [*keys]
            )
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    @locked
    def set_state(self, instance_id: str, boot: str, state: str) -> None:
        """Close a boot (decided): its lines go, its row stays as a tombstone."""
        try:
            self.db.begin_plain()
            self.db.exec(
                "UPDATE assembly_boots SET state = ?, gap_since = NULL"
                " WHERE instance_id = ? AND boot = ?",
                (state, instance_id, boot),
            )
            self.db.exec(
                "DELETE FROM assembly_lines WHERE instance_id = ? AND boot = ?",
                (instance_id, boot),
            )
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    @locked
    def gaps_due(self, before: float) -> list[tuple[str, str]]:
        """Open boots whose gap hint is older than ``before`` (a worker looks at them again)."""
        rows = self.db.exec(
            "SELECT instance_id, boot FROM assembly_boots"
            " WHERE gap_since IS NOT NULL AND gap_since <= ? AND state = ? ORDER BY gap_since"
            " LIMIT 1000",
            (before, OPEN),
        )
        return [(str(a), str(b)) for a, b in rows]

    @locked
    def next_gap(self) -> float | None:
        """When the oldest gap hint was set (a worker looks again ``settle_s`` after)."""
        rows = self.db.exec(
            "SELECT MIN(gap_since) FROM assembly_boots WHERE gap_since IS NOT NULL AND state = ?",
            (OPEN,),
        )
        return _opt_float(rows[0][0]) if rows else None

    @locked
    def heard(self, instance_id: str) -> tuple[float | None, bool]:
        """(when any worker last received a line of the instance, whether a boot of it is
        gapped): what the Compute API sweep needs to pick the VMs it polls."""
        rows = self.db.exec(
            "SELECT MAX(last_line), SUM(CASE WHEN state = ? THEN 1 ELSE 0 END)"
            " FROM assembly_boots WHERE instance_id = ?",
            (GAPPED, instance_id),
        )
        last, gapped = rows[0] if rows else (None, 0)
        return _opt_float(last), bool(gapped)

    @locked
    def boots(self, state: str | None = None) -> list[tuple[str, str, str]]:
        """(instance, boot, state) of every boot (or of those in ``state``)."""
        if state is None:
            rows = self.db.exec("SELECT instance_id, boot, state FROM assembly_boots")
        else:
            rows = self.db.exec(
                "SELECT instance_id, boot, state FROM assembly_boots WHERE state = ?", (state,)
            )
        return [(str(a), str(b), str(c)) for a, b, c in rows]

    @locked
    def instances(self) -> int:
        """How many instances any worker has stored a line of (tombstones included)."""
        rows = self.db.exec("SELECT COUNT(DISTINCT instance_id) FROM assembly_boots")
        return int(rows[0][0]) if rows else 0  # type: ignore[call-overload]

    @locked
    def prune(self, before: float) -> int:
        """Drop tombstones (decided, ended, gapped boots) whose last line is older than
        ``before``: no delivery of theirs can still come (past the subscription's retention)."""
        return self.db.rowcount(
            "DELETE FROM assembly_boots WHERE state <> ? AND last_line < ?", (OPEN, before)
        )


def _opt_float(v: object) -> float | None:
    return None if v is None else float(v)  # type: ignore[arg-type]


def _per_boot(
    order: list[StoredLine],
) -> dict[tuple[str, str], tuple[StoredLine, float, float, int | None]]:
    """Per boot of ``order`` (sorted by instance, boot, seq): (its last line, for the identity;
    the latest receipt, the earliest receipt, the lowest terminal seq)."""
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
    return boots
