"""The failover ledger: exactly one winner per (instance, boot), proven with real processes."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.poller.ledger import Ledger

RACERS = 8
WAIT_S = 60  # every process/barrier wait is bounded


def _race(path: str, barrier: Any, results: Any, keys: list[tuple[str, str]]) -> None:
    """One poller process: open its own ledger, wait for the others, claim every key."""
    with Ledger(path, owner=f"racer-{mp.current_process().pid}") as led:
        barrier.wait(timeout=WAIT_S)
        for iid, boot in keys:
            d = led.claim(iid, boot, "self_shutdown", "ladder 10/10", "vm")
            results.put((iid, boot, d.won, d.token, d.owner))


def _run_racers(path: Path, keys: list[tuple[str, str]]) -> list[tuple[str, str, bool, int, str]]:
    ctx = mp.get_context("spawn")  # a fresh interpreter per racer, like separate pollers
    barrier = ctx.Barrier(RACERS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=(str(path), barrier, results, keys)) for _ in range(RACERS)
    ]
    try:
        for p in procs:
            p.start()
        out = [results.get(timeout=WAIT_S) for _ in range(RACERS * len(keys))]
        for p in procs:
            p.join(timeout=WAIT_S)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return out


def test_eight_processes_racing_one_key_one_winner(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    out = _run_racers(db, [("4000000000000000001", "aaaa0001")])
    winners = [r for r in out if r[2]]
    assert len(winners) == 1
    assert {r[3] for r in out} == {winners[0][3]}  # everyone sees the winner's token
    assert {r[4] for r in out} == {winners[0][4]}  # and the winner's name
    with Ledger(db) as led:
        rows = led.all()
    assert len(rows) == 1 and rows[0].token == 1


def test_racing_many_keys_gives_unique_increasing_tokens(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    keys = [(f"id-{i}", f"{i:08x}") for i in range(12)]
    out = _run_racers(db, keys)
    per_key: dict[tuple[str, str], list[tuple[bool, int]]] = {}
    for iid, boot, won, token, _ in out:
        per_key.setdefault((iid, boot), []).append((won, token))
    assert len(per_key) == len(keys)
    for claims in per_key.values():
        assert sum(w for w, _ in claims) == 1
        assert len({t for _, t in claims}) == 1
    with Ledger(db) as led:
        tokens = [d.token for d in led.all()]
    assert tokens == list(range(1, len(keys) + 1))  # one token per decision, no holes


def test_claim_is_durable_and_a_second_run_is_already_decided(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "ledger.sqlite"
    with Ledger(db, owner="first") as led:
        d1 = led.claim("id-1", "aaaa0001", "suspected_wedge", "silent 901s", "vm-1", now=100.0)
        assert d1.won and d1.token == 1 and d1.decided_at == 100.0
    with Ledger(db, owner="second") as led:
        d2 = led.claim("id-1", "aaaa0001", "self_shutdown", "other reason", "vm-1", now=200.0)
        assert not d2.won
        assert (d2.token, d2.owner, d2.verdict, d2.decided_at) == (
            1,
            "first",
            "suspected_wedge",
            100.0,
        )
        assert d2.request_id == d1.request_id  # a retried reap uses the same requestId
        # a new boot of the same instance is a new incarnation: its own decision
        d3 = led.claim("id-1", "bbbb0002", "preempted", "spot", "vm-1", now=300.0)
        assert d3.won and d3.token == 2 and d3.request_id != d1.request_id
        led.mark_reaped("id-1", "aaaa0001", "operation-1", now=400.0)
        got = led.get("id-1", "aaaa0001")
        assert got is not None and got.reaped_at == 400.0 and got.reap_result == "operation-1"
        assert led.get("id-9", "x") is None
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_unique_constraint_is_the_second_line_of_defence(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with Ledger(db) as led:
        led.claim("id-1", "b", "self_shutdown", "r")
    raw = sqlite3.connect(db)
    with pytest.raises(sqlite3.IntegrityError):
        raw.execute(
            "INSERT INTO decisions (instance_id, boot, token, verdict, reason, instance, owner,"
            " decided_at) VALUES ('id-1', 'b', 99, 'x', 'y', '', 'z', 0)"
        )
    raw.close()


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
        with Ledger(db, sleep=sleep) as led:
            assert led.claim("id-1", "b", "self_shutdown", "r").won
    finally:
        holder.close()
    assert waits, "the open never met the lock: the test did not exercise the retry"
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


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
            Ledger(db, sleep=sleep, clock=lambda: now[0])
    finally:
        holder.close()
    assert 29 < now[0] <= 30  # waited out the whole busy timeout, then stopped


def _open_many(path: str, barrier: Any, results: Any) -> None:
    barrier.wait(timeout=WAIT_S)
    try:
        with Ledger(path) as led:
            d = led.claim(f"id-{mp.current_process().pid}", "b", "self_shutdown", "r")
        results.put(("ok", d.token))
    except Exception as e:  # reported to the parent, which fails the test with it
        results.put(("error", repr(e)))


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
        try:
            for p in procs:
                p.start()
            out = [results.get(timeout=WAIT_S) for _ in range(n)]
            for p in procs:
                p.join(timeout=WAIT_S)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        errors = [e for kind, e in out if kind == "error"]
        assert errors == []
        assert sorted(t for _, t in out) == list(range(1, n + 1))
