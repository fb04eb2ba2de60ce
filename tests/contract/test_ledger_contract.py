"""The ledger contract, run against both backends: SQLite (a file) and PostgreSQL (a real server
started from Debian's packages, tests/kit/pgserver.py). Every test here must pass on both."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.poller.ledgers import open_ledger
from kit.procs import gather

pytestmark = pytest.mark.process

RACERS = 8
WAIT_S = 60  # every process/barrier wait is bounded


@pytest.fixture(params=["sqlite", "postgres"])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a ledger lives: a SQLite path, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.sqlite")
    return str(request.getfixturevalue("pg_database"))


def _race(spec: str, barrier: Any, results: Any, keys: list[tuple[str, str]]) -> None:
    """One poller process: open its own ledger, wait for the others, claim every key."""
    with open_ledger(spec, owner=f"racer-{mp.current_process().pid}") as led:
        barrier.wait(timeout=WAIT_S)
        for iid, boot in keys:
            d = led.decisions.claim(iid, boot, "self_shutdown", "ladder 10/10", "vm")
            results.put((iid, boot, d.won, d.token, d.owner))


def _run_racers(spec: str, keys: list[tuple[str, str]]) -> list[tuple[str, str, bool, int, str]]:
    ctx = mp.get_context("spawn")  # a fresh interpreter per racer, like separate pollers
    barrier = ctx.Barrier(RACERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(spec, barrier, results, keys)) for _ in range(RACERS)]
    return gather(procs, results, RACERS * len(keys), WAIT_S)


def test_eight_processes_racing_one_key_one_winner(spec: str) -> None:
    out = _run_racers(spec, [("4000000000000000001", "aaaa0001")])
    winners = [r for r in out if r[2]]
    assert len(winners) == 1
    assert {r[3] for r in out} == {winners[0][3]}  # everyone sees the winner's token
    assert {r[4] for r in out} == {winners[0][4]}  # and the winner's name
    with open_ledger(spec) as led:
        rows = led.decisions.all()
    assert len(rows) == 1 and rows[0].token == 1


def test_racing_many_keys_gives_unique_increasing_tokens(spec: str) -> None:
    keys = [(f"id-{i}", f"{i:08x}") for i in range(12)]
    out = _run_racers(spec, keys)
    per_key: dict[tuple[str, str], list[tuple[bool, int]]] = {}
    for iid, boot, won, token, _ in out:
        per_key.setdefault((iid, boot), []).append((won, token))
    assert len(per_key) == len(keys)
    for claims in per_key.values():
        assert sum(w for w, _ in claims) == 1
        assert len({t for _, t in claims}) == 1
    with open_ledger(spec) as led:
        tokens = [d.token for d in led.decisions.all()]
    assert tokens == list(range(1, len(keys) + 1))  # one token per decision, no holes


def test_claim_is_durable_and_a_second_run_is_already_decided(spec: str) -> None:
    with open_ledger(spec, owner="first") as led:
        d1 = led.decisions.claim(
            "id-1", "aaaa0001", "suspected_wedge", "silent 901s", "vm-1", now=100.0
        )
        assert d1.won and d1.token == 1 and d1.decided_at == 100.0
    with open_ledger(spec, owner="second") as led:
        d2 = led.decisions.claim(
            "id-1", "aaaa0001", "self_shutdown", "other reason", "vm-1", now=200.0
        )
        assert not d2.won
        assert (d2.token, d2.owner, d2.verdict, d2.decided_at) == (
            1,
            "first",
            "suspected_wedge",
            100.0,
        )
        assert d2.request_id == d1.request_id  # a retried reap uses the same requestId
        # a new boot of the same instance is a new incarnation: its own decision
        d3 = led.decisions.claim("id-1", "bbbb0002", "preempted", "spot", "vm-1", now=300.0)
        assert d3.won and d3.token == 2 and d3.request_id != d1.request_id
        led.decisions.mark_reaped("id-1", "aaaa0001", "operation-1", now=400.0)
        got = led.decisions.get("id-1", "aaaa0001")
        assert got is not None and got.reaped_at == 400.0 and got.reap_result == "operation-1"
        assert led.decisions.get("id-9", "x") is None


def test_tokens_only_increase_across_reopen_and_owners(spec: str) -> None:
    seen = []
    for i in range(5):
        with open_ledger(spec, owner=f"p{i}") as led:
            seen.append(led.decisions.claim(f"id-{i}", "b", "self_shutdown", "r").token)
            seen.append(
                led.decisions.claim(f"id-{i}", "b", "self_shutdown", "r").token
            )  # same key again
    assert seen == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_the_ledger_decides_not_the_cursor(spec: str) -> None:
    """Issue 15 item 4b: a poller with a fresh cursor knows no boot (``-``) or, the VM gone, no
    id (``name:...``). Its claim returns the instance's existing decision, never a second one;
    and once an instance was reaped, no boot of it gets a new decision."""
    with open_ledger(spec, owner="a") as led:
        first = led.decisions.claim(
            "id-1", "aaaa0001", "self_shutdown", "ladder", "p/z/vm-1", now=1.0
        )
        assert first.won
        no_boot = led.decisions.claim(
            "id-1", "-", "terminated_unexplained", "off", "p/z/vm-1", now=2.0
        )
        assert not no_boot.won and no_boot.token == first.token
        by_name = led.decisions.claim(
            "name:vm-1", "-", "terminated_unexplained", "gone", "p/z/vm-1"
        )
        assert not by_name.won and by_name.token == first.token
        led.decisions.mark_reaped("id-1", "aaaa0001", "operation-9")
        late = led.decisions.claim("id-1", "cccc0003", "suspected_wedge", "silent", "p/z/vm-1")
        assert not late.won and late.token == first.token and late.reaped_at is not None
        # another instance (other id and name) is unaffected
        other = led.decisions.claim("name:vm-2", "-", "terminated_unexplained", "gone", "p/z/vm-2")
        assert other.won and other.token == first.token + 1
        found = led.decisions.find_instance("", "p/z/vm-1")
        assert found is not None and found.token == first.token
    with open_ledger(spec) as again:
        assert [d.token for d in again.decisions.all()] == [1, 2]


def test_claimer_holds_the_announcement_and_a_lapsed_one_is_taken_once(spec: str) -> None:
    with open_ledger(spec, owner="claimer", announce_lease_s=60) as a:
        d = a.decisions.claim("id-1", "b1", "self_shutdown", "ladder", "vm-1", now=1000.0)
        assert d.won and d.announced_at is None
        # the claimer dies here: nothing announced
    with (
        open_ledger(spec, owner="late-1", announce_lease_s=60) as b,
        open_ledger(spec, owner="late-2", announce_lease_s=60) as c,
    ):
        assert [p.token for p in b.decisions.pending_announcements()] == [d.token]
        assert not b.decisions.take_announcement(
            "id-1", "b1", now=1059.0
        )  # the claimer's lease is live
        assert b.decisions.take_announcement("id-1", "b1", now=1060.0)  # lapsed: b takes it
        assert not c.decisions.take_announcement("id-1", "b1", now=1061.0)  # b's lease is live now
        assert b.decisions.mark_announced("id-1", "b1", now=1061.0)
        assert not c.decisions.mark_announced("id-1", "b1", now=1062.0)  # once
        assert not c.decisions.take_announcement("id-1", "b1", now=9999.0)  # announced: never again
        assert b.decisions.pending_announcements() == []
        got = c.decisions.get("id-1", "b1")
        assert got is not None and (got.announced_at, got.announced_by) == (1061.0, "late-1")


def test_a_delivery_renews_its_own_lease_and_never_anothers(spec: str) -> None:
    """``hold_announcement`` (before a --pubsub worker runs --on-failover): the lease holder
    renews it; a live lease of another owner is not taken; a lapsed one is; never once marked."""
    with (
        open_ledger(spec, owner="claimer", announce_lease_s=60) as a,
        open_ledger(spec, owner="other", announce_lease_s=60) as b,
    ):
        a.decisions.claim("id-1", "b1", "self_shutdown", "ladder", "vm-1", now=1000.0)
        assert not b.decisions.hold_announcement("id-1", "b1", now=1030.0)  # the claimer's, live
        assert a.decisions.hold_announcement("id-1", "b1", now=1050.0)  # renewed: until 1110
        assert not b.decisions.take_announcement("id-1", "b1", now=1100.0)  # not lapsed: renewed
        assert b.decisions.hold_announcement("id-1", "b1", now=1110.0)  # lapsed: b holds it now
        assert not a.decisions.hold_announcement(
            "id-1", "b1", now=1120.0
        )  # b's: a skips its delivery
        assert b.decisions.mark_announced("id-1", "b1", now=1121.0)
        assert not b.decisions.hold_announcement(
            "id-1", "b1", now=1122.0
        )  # announced: nothing to hold
        assert not a.decisions.hold_announcement("id-1", "b1", now=99_999.0)
        assert not a.decisions.hold_announcement("id-2", "b1", now=1000.0)  # no such decision


def test_default_owners_differ_between_ledgers_of_one_process(spec: str) -> None:
    """Leases go by owner: two replicas with one hostname and pid 1 must not share one."""
    with open_ledger(spec) as a, open_ledger(spec) as b:
        assert a.db.owner != b.db.owner


def _take(spec: str, barrier: Any, results: Any) -> None:
    with open_ledger(spec, owner=f"taker-{mp.current_process().pid}") as led:
        barrier.wait(timeout=WAIT_S)
        took = led.decisions.take_announcement("id-1", "b1", now=10_000.0)
        results.put(took and led.decisions.mark_announced("id-1", "b1", now=10_000.0))


def test_eight_processes_racing_for_a_lapsed_announcement_one_takes_it(spec: str) -> None:
    with open_ledger(spec, owner="dead", announce_lease_s=1) as led:
        led.decisions.claim("id-1", "b1", "self_shutdown", "ladder", "vm-1", now=1.0)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(RACERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_take, args=(spec, barrier, results)) for _ in range(RACERS)]
    try:
        for p in procs:
            p.start()
        out = [results.get(timeout=WAIT_S) for _ in range(RACERS)]
    finally:
        for p in procs:
            p.join(timeout=WAIT_S)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    assert sorted(out) == [False] * (RACERS - 1) + [True]


def test_primary_key_is_the_second_line_of_defence(spec: str) -> None:
    with open_ledger(spec) as led:
        led.decisions.claim("id-1", "b", "self_shutdown", "r")
        with pytest.raises(led.errors):
            led.db.exec(
                "INSERT INTO decisions (instance_id, boot, token, verdict, reason, instance,"
                " owner, decided_at) VALUES ('id-1', 'b', 99, 'x', 'y', '', 'z', 0)"
            )


def test_postgres_claim_behind_a_stuck_lock_fails_cleanly_and_the_ledger_stays_usable(
    pg_database: str,
) -> None:
    """A session that holds the claim lock forever (a stuck peer) makes a claim fail after the
    lock timeout with the driver's error, not hang; no transaction is left open, so the next
    claim works once the lock is gone."""
    import psycopg
    from gce_watchdog.poller.ledger_pg import PostgresDb
    from gce_watchdog.poller.ledgers import Ledger

    with Ledger(PostgresDb(pg_database, owner="me", lock_timeout_ms=300)) as led:
        stuck = psycopg.connect(pg_database)
        try:
            stuck.execute("SELECT last_token FROM fence WHERE id = 1 FOR UPDATE")
            with pytest.raises(led.errors, match="lock timeout"):
                led.decisions.claim("id-1", "b", "self_shutdown", "r")
        finally:
            stuck.rollback()
            stuck.close()
        d = led.decisions.claim("id-1", "b", "self_shutdown", "r")
        assert d.won and d.token == 1


# -- protocol v3 pins: one key per instance id, shared by every reader on every host ----------


def _place(spec: str, barrier: Any, results: Any, n: int) -> None:
    """One reader process that placed its own key for the same instance (only one is real)."""
    public = bytes([n]) * 32
    with open_ledger(spec, owner=f"reader-{n}") as led:
        barrier.wait(timeout=WAIT_S)
        pin = led.pins.place_pin("4000000000000000001", public, f"fp{n}")
        results.put((n, pin.fingerprint, pin.public))


def test_racing_readers_placing_pins_all_get_the_first_one(spec: str) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(RACERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_place, args=(spec, barrier, results, n)) for n in range(RACERS)]
    out = gather(procs, results, RACERS, WAIT_S)
    assert len({(fp, pub) for _, fp, pub in out}) == 1  # every reader uses the same pin
    (_, fp, pub), *_ = out
    assert pub == bytes([int(fp[2:])]) * 32  # and it is one reader's whole key
    with open_ledger(spec) as led:  # a reader started later (another host, a restart)
        pin = led.pins.get_pin("4000000000000000001")
    assert pin is not None and (pin.fingerprint, pin.public, pin.source) == (fp, pub, "placed")


def test_a_hand_pin_replaces_and_the_first_matching_key_fills_it_in(spec: str) -> None:
    with open_ledger(spec, owner="host-a") as a, open_ledger(spec, owner="host-b") as b:
        assert a.pins.get_pin("42") is None
        placed = a.pins.place_pin("42", b"\x01" * 32, "fp-first", now=10.0)
        assert placed.source == "placed" and placed.pinned_by == "host-a"
        old = b.pins.hand_pin("42", "fp-operator", now=20.0)  # the operator's pin wins
        assert old is not None and old.fingerprint == "fp-first"
        pin = a.pins.get_pin("42")
        assert pin is not None and (pin.fingerprint, pin.public, pin.source) == (
            "fp-operator",
            None,
            "hand",
        )
        # a key placed with another fingerprint does not replace it...
        assert a.pins.place_pin("42", b"\x02" * 32, "fp-other").fingerprint == "fp-operator"
        assert b.pins.get_pin("42").public is None  # type: ignore[union-attr]
        # ...the key with the operator's fingerprint fills it in, for every reader
        assert b.pins.place_pin("42", b"\x03" * 32, "fp-operator").public == b"\x03" * 32
        assert a.pins.get_pin("42").public == b"\x03" * 32  # type: ignore[union-attr]
        assert a.pins.get_pin("43") is None


def test_a_late_poller_and_a_second_host_use_the_ledgers_pin(spec: str, tmp_path: Path) -> None:
    """Issue 25: a poller that first reads an instance after its first lines left the API's
    window cannot place a key; with no pin it alarms (`no_pin`) and no line decides, so a
    forger's self-signed key there pins nothing. A poller that read from byte 0 stored the pin
    in the ledger: a fresh cursor dir on another host uses it and judges the real lines."""
    import secrets

    from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
    from gce_watchdog.poller.reader import CursorStore, SerialReader
    from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind
    from gce_watchdog.testing.simcompute import FakeComputeAPI
    from gce_watchdog.testing.synth import SYNTH_KEY, Writer
    from gce_watchdog.wire import protocol
    from google.oauth2.credentials import Credentials

    p, z = "test-project", "us-central1-a"
    with FakeComputeAPI(token="tok", window=4000) as api:
        inst = api.add_instance("vm-1", project=p, zone=z)

        def reader(cursors: str, led: Any) -> SerialReader:
            client = ComputeClient.create(
                Credentials("tok"), api.base_url, timeout=(2.0, 2.0),
                retry=ComputeRetry(attempts=2, sleep=lambda s: None),
            )  # fmt: skip
            return SerialReader(client, CursorStore(tmp_path / cursors), pins=led.pins)

        w = Writer(boot="aaaa0001", inst=inst.id)
        api.append_serial("vm-1", w.line("start", {"v": "3"}) + w.line("phase", {"ph": "workload"}))
        with open_ledger(spec, owner="host-a") as a:
            reader("a", a).read(p, z, "vm-1", inst.id)  # from byte 0: places and stores
            pin = a.pins.get_pin(inst.id)
            assert pin is not None and pin.public == SYNTH_KEY.public and pin.source == "placed"
        # hours of workload output push the first lines out of the window; a forger prints a
        # key of its own and a shutdown signed with it; then the real agent's exit rc=0
        evil = protocol.LineKey(secrets.token_bytes(32))
        api.append_serial("vm-1", b"noise\n" * 900)
        forged = protocol.key_line("aaaa0001", 0, w.ts_ms, evil).encode() + b"\n"
        fake = protocol.make_event("shutdown", "aaaa0001", 90, w.ts_ms, {"reason": "ladder"})
        api.append_serial("vm-1", forged + protocol.encode(fake, evil).encode() + b"\n")
        api.append_serial("vm-1", w.line("exit", {"rc": 0, "sig": "-", "dur": 5}))
        off = InstanceState("TERMINATED")
        # a poller with no ledger pin (its own empty ledger): cannot place, decides from nothing
        with open_ledger(str(tmp_path / "empty.sqlite")) as empty:
            r = reader("late", empty)
            res = r.read(p, z, "vm-1", inst.id)
            assert res.lost > 0  # it started after the window moved
            tl = r.cursor(p, z, "vm-1").timeline
            assert (
                tl.pin is None and "no_pin" in tl.key_alarm and empty.pins.get_pin(inst.id) is None
            )
            v = tl.judge(off, 1e10, Policy())  # not even the status decides: the job finished
            assert not v.failover and v.reason.startswith("ALARM")
        # a second host with a fresh cursor dir and the shared ledger: the pinned key decides
        with open_ledger(spec, owner="host-b") as b:
            r = reader("b", b)
            r.read(p, z, "vm-1", inst.id)
            tl = r.cursor(p, z, "vm-1").timeline
            assert tl.pin == SYNTH_KEY.public and tl.unplaced == [evil.fingerprint]
            v = tl.judge(off, 1e10, Policy())
            assert v.kind is VerdictKind.WORKLOAD_OK and not v.failover  # the forgery: nothing


def test_an_instance_alarm_is_raised_once_seen_again_cleared_and_raised_anew(spec: str) -> None:
    inst = "p/z/vm"
    with open_ledger(spec, owner="host-a") as a, open_ledger(spec, owner="host-b") as b:
        assert a.decisions.alarms() == []
        assert a.decisions.raise_alarm("42", "vm_untracked", inst, "RUNNING", {"k": "v"}, 10.0)
        # another poller sees it still hold: not raised again, seen later, status updated
        assert not b.decisions.raise_alarm("42", "vm_untracked", inst, "STOPPING", {}, 20.0)
        [al] = b.decisions.alarms()
        assert (al.instance_id, al.instance, al.status, al.labels) == ("42", inst, "STOPPING", {})
        assert (al.raised_at, al.raised_by, al.seen_at) == (10.0, "host-a", 20.0)
        assert b.decisions.clear_alarm("42", "vm_untracked", "deleted", 30.0)
        assert not a.decisions.clear_alarm("42", "vm_untracked", "deleted", 31.0)  # once
        assert a.decisions.alarms() == []
        assert b.decisions.raise_alarm("42", "vm_untracked", inst, "RUNNING", {}, 40.0)
        [al] = a.decisions.alarms()
        assert (al.raised_at, al.raised_by) == (40.0, "host-b")


def test_freshness_first_receipt_stands_and_a_newer_seq_is_known(spec: str) -> None:
    """docs/poller.md, "Freshness": the first receipt of a boot's newest seq is shared; a
    reader with the same seq later gets that time; a newer seq replaces it and is known."""
    with open_ledger(spec, owner="a") as a, open_ledger(spec, owner="b") as b:
        first = a.freshness.note("42", "b1", 7, 100.0, known=False)
        assert (first.seq, first.rx, first.known) == (7, 100.0, False)
        same = b.freshness.note("42", "b1", 7, 500.0, known=False)  # a later, cursorless read
        assert (same.seq, same.rx, same.known) == (7, 100.0, False)
        behind = b.freshness.note("42", "b1", 5, 600.0, known=True)  # a lagging reader
        assert (behind.seq, behind.rx) == (7, 100.0)
        newer = b.freshness.note("42", "b1", 9, 700.0, known=False)  # came after seq 7
        assert (newer.seq, newer.rx, newer.known) == (9, 700.0, True)
        assert a.freshness.note("42", "b1", 9, 800.0, known=True).rx == 700.0
        other = a.freshness.note("42", "b2", 0, 900.0, known=True)  # each boot its own record
        assert (other.seq, other.rx, other.known) == (0, 900.0, True)
        assert a.freshness.note("43", "b1", 7, 950.0, known=False).rx == 950.0


def _note_racer(spec: str, barrier: Any, results: Any, rx: float) -> None:
    with open_ledger(spec, owner=f"racer-{rx}") as led:
        barrier.wait(timeout=WAIT_S)
        rec = led.freshness.note("77", "b1", 3, rx, known=False)
        results.put((rec.seq, rec.rx))


def test_racing_first_readers_all_get_one_freshness_record(spec: str) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(RACERS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_note_racer, args=(spec, barrier, results, 1000.0 + i))
        for i in range(RACERS)
    ]
    out = gather(procs, results, RACERS, WAIT_S)
    assert len(out) == RACERS and len(set(out)) == 1  # one record stands, every reader sees it
