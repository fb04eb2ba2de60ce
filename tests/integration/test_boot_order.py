"""Boots have an order no replay can reverse (issue 35, items 1 and 7): the attacks, against the
real CLI (``parse`` as a process, ``poll`` with a new cursor dir every time and one ledger).

Every line carries the boot counter ``bc`` (the agent's side writes it; here the library's own
encoder writes it as an ordinary signed field). A local process can only replay bytes it read:
it cannot change a line's ``bc`` without the key. Lines without ``bc`` (older agents, the
corpus) keep the order by stream position (tests/integration/test_forgery.py).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.poller.boots import Record
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI
from kit.bootcount import BcWriter
from kit.poll import P, Z, outputs, parse_json, poll_args
from kit.schemas import validate

pytestmark = pytest.mark.process

HOUR_MS = 3600 * 1000
DRAIN = 1.5  # the drain timeout, scaled down only through its setting
MAX_POLLS = 40  # every loop is bounded


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _boots(now_ms: int) -> tuple[BcWriter, BcWriter]:
    """The previous boot (bc=1) and the current one (bc=2), an hour later by the guest clock."""
    a = BcWriter(boot="aaaa0001", bc="1", ts_ms=now_ms - 2 * HOUR_MS)
    b = BcWriter(boot="bbbb0002", bc="2", ts_ms=now_ms - HOUR_MS)
    return a, b


def _announce_of(lines: bytes) -> bytes:
    """The first line (a boot's announcement at seq 0): what a replayer copies."""
    return lines.split(b"\n", 1)[0] + b"\n"


def _last(lines: bytes) -> bytes:
    return lines.rstrip(b"\n").rsplit(b"\n", 1)[-1] + b"\n"


def _parse(data: bytes, *args: str) -> dict[str, object]:
    doc = parse_json(data, *args)
    validate("parse", doc)  # each boot's counter is in the schema
    assert all(b["counter"] in (1, 2) for b in doc["boots"]), doc["boots"]
    v = doc["verdict"]
    assert isinstance(v, dict)
    return v


# -- (a) replay of the previous boot's announcement and heartbeat ---------------------------


def test_parse_keeps_the_current_boot_when_the_previous_one_is_replayed() -> None:
    a, b = _boots(int(time.time() * 1000))
    old = a.line("phase", {"ph": "workload"}) + a.line("heartbeat", {"ph": "workload"})
    new = b.line("phase", {"ph": "workload"}) + b.line("heartbeat", {"ph": "workload"})
    replay = _announce_of(old) + _last(old)
    # the whole window, and a window the replayer rolled (the previous boot's lines gone)
    for data in (old + new + replay, new + replay):
        v = _parse(data)
        assert v["boot"] == "bbbb0002" and not v["failover"], v


def test_a_fresh_poller_keeps_the_current_boot_and_never_fails_it_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: the window rolled, the previous boot's announcement and a heartbeat
    printed after the current boot's lines; the current boot goes on writing. Every poll with
    a new cursor dir (and the shared ledger) keeps the current boot, never a failover."""
    a, b = _boots(int(time.time() * 1000))
    old = a.line("phase", {"ph": "workload"}) + a.line("heartbeat", {"ph": "workload"})
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-1", project=P, zone=Z)
        api.append_serial("vm-1", b.line("phase", {"ph": "workload"}))
        api.append_serial("vm-1", _announce_of(old) + _last(old))
        first_done = None
        for run in range(MAX_POLLS):
            args = _drain(poll_args(api, tmp_path, "--once", "--reap", "vm-1"))
            args[args.index("--cursor-dir") + 1] = str(tmp_path / f"cursors-{run}")
            assert main(args) == 0
            got = outputs(capsys)["vm-1"]
            assert got["boot"] == "bbbb0002" and got["action"] != "failover", got
            first_done = first_done or time.time()
            if time.time() > first_done + 2 * DRAIN:
                assert got["verdict"] == "healthy", got
                break
            api.append_serial("vm-1", b.line("heartbeat", {"ph": "workload"}))
            time.sleep(0.3)
        assert api.instance("vm-1").status == "RUNNING"


def _drain(args: list[str]) -> list[str]:
    return [*args, "--drain-timeout", f"{DRAIN}s"]


# -- (b) a replayed exit rc=0 of an earlier boot -------------------------------------------------


def test_a_replayed_exit_of_an_earlier_boot_never_makes_a_wedged_vm_finished() -> None:
    now = time.time()
    a, b = _boots(int(now * 1000))
    old = a.line("phase", {"ph": "workload"}) + a.line("exit", {"rc": "0"})
    new = b.line("phase", {"ph": "workload"})  # then silent: wedged
    replay = _announce_of(old) + _last(old)
    when = ("--received", _iso(now - 7200), "--now", _iso(now), "--status", "RUNNING")
    for data in (old + new + replay, new + replay):
        v = _parse(data, *when)
        assert v["kind"] == "suspected_wedge" and v["boot"] == "bbbb0002", v
        assert v["failover"], v


# -- (c) one replayed older-boot key line printed last -------------------------------------------


def test_one_replayed_older_key_line_never_becomes_current() -> None:
    a, b = _boots(int(time.time() * 1000))
    old = a.line("phase", {"ph": "workload"})
    new = b.line("phase", {"ph": "workload"}) + b.line("shutdown", {"reason": "ladder"})
    for data in (old + new + _announce_of(old), new + _announce_of(old)):
        v = _parse(data)
        assert v["kind"] == "self_shutdown" and v["boot"] == "bbbb0002", v


# -- (d) a restarted VM whose guest clock is two days behind -------------------------------------


def test_a_restart_with_the_guest_clock_two_days_behind_is_current_and_never_reaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    now_ms = int(time.time() * 1000)
    a = BcWriter(boot="aaaa0001", bc="1", ts_ms=now_ms - HOUR_MS)
    b = BcWriter(boot="bbbb0002", bc="2", ts_ms=now_ms - 49 * HOUR_MS)  # clock 2 days back
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-1", project=P, zone=Z)
        window = a.line("phase", {"ph": "workload"}) + a.line("shutdown", {"reason": "ladder"})
        window += b.line("phase", {"ph": "workload"})
        api.append_serial("vm-1", window)
        assert _parse(window)["boot"] == "bbbb0002"  # and parse, with no ledger
        for run in range(3):
            args = poll_args(api, tmp_path, "--once", "--reap", "vm-1")
            args[args.index("--cursor-dir") + 1] = str(tmp_path / f"cursors-{run}")
            assert main(args) == 0
            got = outputs(capsys)["vm-1"]
            assert got["boot"] == "bbbb0002" and got["action"] != "failover", got
            assert not got["reaped"], got
            api.append_serial("vm-1", b.line("heartbeat", {"ph": "workload"}))
        assert api.calls_to("delete") == [] and api.instance("vm-1").status == "RUNNING"


# -- (e) a boot at or below the ledger's highest, never seen: boot_regressed ---------------------


@pytest.mark.parametrize("bc", ["1", "2"])
def test_a_boot_at_or_below_the_ledgers_highest_is_regressed_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bc: str
) -> None:
    now_ms = int(time.time() * 1000)
    b = BcWriter(boot="bbbb0002", bc="2", ts_ms=now_ms - HOUR_MS)
    x = BcWriter(boot="cccc0003", bc=bc, ts_ms=now_ms - HOUR_MS // 2)  # a replay or lost counter
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-1", project=P, zone=Z)
        api.append_serial("vm-1", b.line("phase", {"ph": "workload"}))

        def poll(run: str) -> dict[str, object]:
            args = poll_args(api, tmp_path, "--once", "vm-1")
            args[args.index("--cursor-dir") + 1] = str(tmp_path / f"cursors-{run}")
            assert main(args) == 0
            return outputs(capsys)["vm-1"]

        poll("0")
        before = poll("1")
        assert before["alarms"] == [], before
        api.append_serial("vm-1", x.line("phase", {"ph": "workload"}))
        api.append_serial("vm-1", x.line("shutdown", {"reason": "ladder"}))
        after = poll("2")
        assert after["boot"] == before["boot"] == "bbbb0002", after
        assert after["verdict"] == before["verdict"] and after["action"] == before["action"]
        assert after["alarms"] == ["boot_regressed"], after
        validate("poll", after)
        led = str(tmp_path / "ledger.sqlite")
        assert main(["decisions", "alarms", "--ledger", led, "--json"]) == 0
        alarms = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
        assert [a["alarm"] for a in alarms] == ["boot_regressed"], alarms
        validate("decisions-alarms", alarms[0])


# -- the ledger's record ---------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "ledger.sqlite")
    return str(request.getfixturevalue("pg_database"))


def test_the_ledgers_boot_record_only_rises_and_older_ledgers_get_it(ledger_url: str) -> None:
    with open_ledger(ledger_url, owner="r1") as led:
        f = led.freshness
        assert f.boot_record("1") is None
        assert f.raise_boot("1", Record(3, "bbbb0003", 5.0)) == Record(3, "bbbb0003", 5.0)
        # lower or equal: the record stands (the first boot stored keeps an equal counter)
        assert f.raise_boot("1", Record(2, "bbbb0002", 6.0)) == Record(3, "bbbb0003", 5.0)
        assert f.raise_boot("1", Record(3, "cccc0003", 7.0)) == Record(3, "bbbb0003", 5.0)
        assert f.raise_boot("1", Record(4, "dddd0004", 8.0)) == Record(4, "dddd0004", 8.0)
        assert f.boot_record("2") is None and f.boot_record("1") == Record(4, "dddd0004", 8.0)
        led.db.exec("DROP TABLE boot_counters")  # a ledger from before the record
    with open_ledger(ledger_url, owner="r2") as led:  # opening it adds the table
        assert led.freshness.boot_record("1") is None
        assert led.freshness.raise_boot("1", Record(1, "aaaa0001")).counter == 1


# -- the writer and the reader together ---------------------------------------------------------


def test_the_real_writers_counter_orders_the_boots_for_parse(tmp_path: Path) -> None:
    """The agent's own Emitter writes two boots (bc 1, then 2, from ``boot.count``); the first
    boot's bytes printed again after the second's never make it current for ``parse``, and
    each boot's counter is the one its writer put on every line."""
    from gce_watchdog.vm.console import open_emitter

    state, run, serial = tmp_path / "state", tmp_path / "run", tmp_path / "ttyS0"
    serial.touch()
    for bid in ("a" * 32, "b" * 32):
        em, port = open_emitter(str(serial), None, str(state), str(run), bid[:8], boot_id=bid)
        em.emit("phase", {"ph": "workload"})
        em.emit("heartbeat", {"ph": "workload"})
        port.close()
    data = serial.read_bytes()
    cut = data.index(b"GCEWD3 bbbbbbbb")
    # the window rolled past the first boot, which is then printed again: by position alone
    # (lines without bc) it would be the newest boot
    doc = parse_json(data[cut:] + data[:cut])
    assert {b["boot"]: b["counter"] for b in doc["boots"]} == {"aaaaaaaa": 1, "bbbbbbbb": 2}
    v = doc["verdict"]
    assert v["boot"] == "bbbbbbbb" and not v["failover"], v
