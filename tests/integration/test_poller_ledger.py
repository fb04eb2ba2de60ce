"""The failover ledger: exactly one winner per (instance, boot), proven with real processes."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.poller.ledgers import open_ledger
from kit.procs import gather

WAIT_S = 60  # every process/barrier wait is bounded

# The semantics (one winner, tokens, announcements, the ledger deciding) are the contract suite,
# tests/contract/test_ledger_contract.py, run on SQLite and PostgreSQL. Here: what only SQLite has.


@pytest.mark.pure
def test_sqlite_ledger_is_wal_and_upgrades_an_older_file(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "ledger.sqlite"
    db.parent.mkdir()
    old = sqlite3.connect(db)  # the schema of the first release: no announcement columns
    old.executescript(
        "CREATE TABLE decisions (instance_id TEXT NOT NULL, boot TEXT NOT NULL,"
        " token INTEGER NOT NULL UNIQUE, verdict TEXT NOT NULL, reason TEXT NOT NULL,"
        " instance TEXT NOT NULL, owner TEXT NOT NULL, decided_at REAL NOT NULL,"
        " reaped_at REAL, reap_result TEXT, PRIMARY KEY (instance_id, boot));"
        "CREATE TABLE fence (id INTEGER PRIMARY KEY CHECK (id = 1), last_token INTEGER NOT NULL);"
        "INSERT INTO fence VALUES (1, 1);"
        "INSERT INTO decisions VALUES ('id-1', 'b', 1, 'self_shutdown', 'r', 'vm', 'old', 5.0,"
        " NULL, NULL);"
    )
    old.close()
    with open_ledger(db, owner="new") as led:
        got = led.decisions.get("id-1", "b")
        assert got is not None and got.announced_at == 5.0  # printed by the old poller
        assert (got.delivery, got.delivery_attempts, got.delivery_error) == ("delivered", 0, None)
        assert led.decisions.pending_announcements() == []
        assert led.decisions.claim("id-2", "b", "self_shutdown", "r").token == 2
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


@pytest.mark.pure
def test_open_waits_out_a_writer_that_sqlite_would_not_wait_for(tmp_path: Path) -> None:
    """A fresh (rollback-journal) file with another connection holding its write lock: switching
    to WAL needs our shared lock promoted, and SQLite answers "database is locked" at once instead
    of calling the busy handler. The open must retry until the writer is done, not fail."""
    db = tmp_path / "ledger.sqlite"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("CREATE TABLE other (x)")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO other VALUES (1)")
    waits: list[float] = []

    def sleep(s: float) -> None:  # the first backoff is the moment the writer lets go
        waits.append(s)
        if holder.in_transaction:
            holder.execute("COMMIT")

    try:
        with open_ledger(db, sleep=sleep) as led:
            assert led.decisions.claim("id-1", "b", "self_shutdown", "r").won
    finally:
        holder.close()
    assert waits, "the open never met the lock: the test did not exercise the retry"
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


@pytest.mark.pure
def test_open_gives_up_after_the_busy_timeout_with_a_clear_error(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("CREATE TABLE other (x)")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO other VALUES (1)")
    now = [0.0]

    def sleep(s: float) -> None:  # a fake clock: no real waiting
        now[0] += s

    try:
        with pytest.raises(sqlite3.OperationalError, match="gave up opening"):
            open_ledger(db, sleep=sleep, clock=lambda: now[0])
    finally:
        holder.close()
    assert 29 < now[0] <= 30  # waited out the whole busy timeout, then stopped


def _open_many(path: str, barrier: Any, results: Any) -> None:
    barrier.wait(timeout=WAIT_S)
    try:
        with open_ledger(path) as led:
            d = led.decisions.claim(f"id-{mp.current_process().pid}", "b", "self_shutdown", "r")
        results.put(("ok", d.token))
    except Exception as e:  # reported to the parent, which fails the test with it
        results.put(("error", repr(e)))


@pytest.mark.process
def test_many_processes_opening_a_fresh_ledger_at_once(tmp_path: Path) -> None:
    """The CI failure: pollers started together on a new ledger. 16 processes behind a barrier,
    three fresh files: every open succeeds and every claim gets its own token."""
    ctx = mp.get_context("spawn")
    n = 16
    for trial in range(3):
        db = tmp_path / f"ledger-{trial}.sqlite"
        barrier = ctx.Barrier(n)
        results = ctx.Queue()
        procs = [ctx.Process(target=_open_many, args=(str(db), barrier, results)) for _ in range(n)]
        out = gather(procs, results, n, WAIT_S)
        errors = [e for kind, e in out if kind == "error"]
        assert errors == []
        assert sorted(t for _, t in out) == list(range(1, n + 1))
