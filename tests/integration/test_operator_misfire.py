"""Operators cannot misfire (issue 35 item 6): each attack of the issue, against the real CLI.

``gce-watchdog pin`` with a typo in the VM name or id, or in the ledger path, or over a good
pin; a VM whose fleet selection label is removed while it runs (``vm_untracked``); against the
fake Compute API over loopback and a real SQLite ledger.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.lib.compute import ComputeClient, label_filter
from gce_watchdog.poller.decisions import alarm_metrics, delivery_metrics
from gce_watchdog.poller.fleet import FleetPoller, RoundReport
from gce_watchdog.poller.ledger import InstanceAlarm
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer
from google.oauth2.credentials import Credentials
from prometheus_client.parser import text_string_to_metric_families

P, Z = "test-project", "us-central1-a"
GOOD = "a" * 32
OTHER = "b" * 32


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        a.add_instance("train-7", project=P, zone=Z, instance_id="4000000000000000007")
        a.add_instance("train-8", project=P, zone=Z, instance_id="4000000000000000008")
        yield a


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.sqlite"
    with open_ledger(path) as led:  # a ledger in use: train-7 pinned from its first line
        led.pins.place_pin("4000000000000000007", b"\x07" * 32, GOOD, now=1.0)
    return path


def pin(api: FakeComputeAPI, tmp_path: Path, *args: str) -> int:
    tok = tmp_path / "token"
    tok.write_text("tok\n")
    return main(["pin", "--api-base", api.base_url, "--access-token-file", str(tok), *args])


def pinned(ledger: Path, iid: str = "4000000000000000007") -> tuple[str, str, bytes | None] | None:
    with open_ledger(ledger) as led:
        p = led.pins.get_pin(iid)
    return None if p is None else (p.fingerprint, p.source, p.public)


PLACED = (GOOD, "placed", b"\x07" * 32)


@pytest.mark.process
def test_a_typo_in_the_vm_name_pins_nothing(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = pin(api, tmp_path, "--ledger", str(ledger), f"{P}/{Z}/train-77", OTHER)
    assert rc == 69
    assert "no instance test-project/us-central1-a/train-77" in capsys.readouterr().err
    assert pinned(ledger) == PLACED


@pytest.mark.process
def test_a_typo_in_the_instance_id_pins_nothing(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = pin(api, tmp_path, "--ledger", str(ledger), "--project", P, "4000000000000000009", OTHER)
    assert rc == 69 and "no instance with id 4000000000000000009" in capsys.readouterr().err
    assert pinned(ledger, "4000000000000000009") is None
    # an id needs the projects it is looked up in
    assert pin(api, tmp_path, "--ledger", str(ledger), "4000000000000000008", OTHER) == 64


@pytest.mark.process
def test_an_api_that_cannot_tell_pins_nothing(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.set_unreachable(P, "europe-west1-b")  # absence from an incomplete list proves nothing
    rc = pin(api, tmp_path, "--ledger", str(ledger), "--project", P, "4000000000000000009", OTHER)
    assert rc == 75 and "cannot tell whether 4000000000000000009 exists" in capsys.readouterr().err
    assert pinned(ledger, "4000000000000000009") is None


@pytest.mark.process
def test_a_typo_in_the_ledger_path_creates_nothing(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "ledgr.sqlite"
    assert pin(api, tmp_path, "--ledger", str(typo), f"{P}/{Z}/train-8", OTHER) == 66
    assert f"no ledger at {typo}" in capsys.readouterr().err
    assert not typo.exists()
    assert pin(api, tmp_path, "--ledger", str(typo), "--create", f"{P}/{Z}/train-8", OTHER) == 0
    assert pinned(typo, "4000000000000000008") == (OTHER, "hand", None)


@pytest.mark.process
def test_replacing_a_good_pin_needs_replace_and_prints_both(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pin(api, tmp_path, "--ledger", str(ledger), f"{P}/{Z}/train-7", OTHER) == 1
    err = capsys.readouterr().err
    assert GOOD in err and OTHER in err and "--replace" in err
    assert pinned(ledger) == PLACED  # nothing changed
    # the same fingerprint again: nothing to do, the placed key is kept
    assert pin(api, tmp_path, "--ledger", str(ledger), f"{P}/{Z}/train-7", GOOD) == 0
    assert "already pinned" in capsys.readouterr().out
    assert pinned(ledger) == PLACED
    rc = pin(api, tmp_path, "--ledger", str(ledger), "--replace", f"{P}/{Z}/train-7", OTHER)
    assert rc == 0
    out = capsys.readouterr().out
    assert f"pinned 4000000000000000007 ({P}/{Z}/train-7) {OTHER}" in out
    assert f"replaced {GOOD}, placed" in out
    assert pinned(ledger) == (OTHER, "hand", None)


@pytest.mark.process
def test_a_new_pin_by_id_and_a_bad_fingerprint(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pin(api, tmp_path, "--ledger", str(ledger), f"{P}/{Z}/train-8", "XYZ") == 64
    rc = pin(api, tmp_path, "--ledger", str(ledger), "--project", P, "4000000000000000008", OTHER)
    assert rc == 0
    assert f"pinned 4000000000000000008 ({P}/{Z}/train-8) {OTHER}" in capsys.readouterr().out
    assert pinned(ledger, "4000000000000000008") == (OTHER, "hand", None)


# -- vm_untracked: a VM's selection label removed while it runs -----------------------------

LABEL = {"gce-watchdog": "on"}
FLEET = f"{P}/{Z}"


def poll_once(api: FakeComputeAPI, tmp_path: Path) -> int:
    tok = tmp_path / "token"
    tok.write_text("tok\n")
    return main([
        "poll", "--label", "gce-watchdog=on", "--project", P, "--api-base", api.base_url,
        "--access-token-file", str(tok), "--ledger", str(tmp_path / "l.sqlite"),
        "--cursor-dir", str(tmp_path / "c"), "--json", "--once", "--api-attempts", "1",
    ])  # fmt: skip


def alarms_view(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    capsys.readouterr()
    assert main(["decisions", "alarms", "--ledger", str(tmp_path / "l.sqlite"), "--json"]) == 0
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()]


@pytest.mark.process
def test_removing_the_label_of_a_running_vm_raises_vm_untracked_until_it_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeComputeAPI(token="tok") as api:
        for name in ("keep", "sneaky"):
            api.add_instance(name, project=P, zone=Z, labels=LABEL)
        w = Writer(boot="5eaf0001")
        w.ts_ms = int(time.time() * 1000)
        api.append_serial("sneaky", w.line("phase", {"ph": "workload"}))
        api.append_serial("keep", Writer(boot="5eaf0002").line("phase", {"ph": "workload"}))
        assert poll_once(api, tmp_path) == 0
        capsys.readouterr()
        # the attack: a local process with compute-rw removes the VM's selection label
        api.instance("sneaky").labels.clear()
        for _ in range(2):  # every round (each a restarted poller here) says so and polls it
            assert poll_once(api, tmp_path) == 0
            cap = capsys.readouterr()
            assert f"ALARM {FLEET}/sneaky alarm=vm_untracked status=RUNNING" in cap.err
            polled = [json.loads(x)["instance"] for x in cap.out.splitlines()]
            assert "sneaky" in polled
            [doc] = alarms_view(tmp_path, capsys)
            assert (doc["alarm"], doc["name"], doc["status"]) == ("vm_untracked", "sneaky",
                                                                  "RUNNING")  # fmt: skip
        # it wedges and powers off, still unlabelled: its failover is decided all the same
        api.append_serial("sneaky", w.line("shutdown", {"reason": "ladder", "rung": "10/10"}))
        assert poll_once(api, tmp_path) == 0  # its last line read while it still runs
        outs = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"sneaky"' in x]
        api.set_status("sneaky", "TERMINATED")
        assert poll_once(api, tmp_path) == 0
        cap = capsys.readouterr()
        assert f"{FLEET}/sneaky: vm_untracked cleared: ended (TERMINATED)" in cap.err
        outs += [json.loads(x) for x in cap.out.splitlines() if '"sneaky"' in x]
        assert [o["action"] for o in outs].count("failover") == 1, outs
        assert outs[-1]["verdict"] == "self_shutdown"
        assert alarms_view(tmp_path, capsys) == []
        assert poll_once(api, tmp_path) == 0  # let go: no longer polled
        assert '"sneaky"' not in capsys.readouterr().out


@pytest.mark.process
def test_an_untracked_vm_is_polled_by_one_poller_round_after_round_until_deleted(
    tmp_path: Path,
) -> None:
    with FakeComputeAPI(token="tok") as api, open_ledger(tmp_path / "l.sqlite") as led:
        api.add_instance("vm", project=P, zone=Z, labels=LABEL)
        api.add_instance("stopped", project=P, zone=Z, labels=LABEL)
        client = ComputeClient.create(Credentials("tok"), api.base_url)  # type: ignore[no-untyped-call]
        fleet = FleetPoller(
            client, CursorStore(tmp_path / "c"), led, [P], label_filter("gce-watchdog", "on")
        )
        try:

            def round_() -> tuple[list[str], RoundReport]:
                outs: list[str] = []
                rep = fleet.round(math.inf, lambda o: outs.append(o.instance), time.monotonic)
                return sorted(outs), rep

            assert round_()[0] == ["stopped", "vm"]
            api.instance("vm").labels.clear()
            api.set_status("stopped", "TERMINATED")
            api.instance("stopped").labels.clear()  # ended before it left: let go, no alarm
            outs, rep = round_()
            assert outs == ["vm"] and [t.name for t, _ in rep.raised] == ["vm"]
            assert [a.instance for a in led.decisions.alarms()] == [f"{FLEET}/vm"]
            outs, rep = round_()
            assert outs == ["vm"] and rep.raised == [] and [t.name for t in rep.untracked] == ["vm"]
            # selected again: watched as any listed VM, the alarm cleared
            api.instance("vm").labels.update(LABEL)
            outs, rep = round_()
            assert outs == ["vm"] and [why for _, why in rep.cleared] == ["selected again"]
            assert led.decisions.alarms() == [] and fleet.untracked == {}
            api.instance("vm").labels.clear()
            assert [t.name for t, _ in round_()[1].raised] == ["vm"]  # raised again
            api.instance("vm").deleted = True
            outs, rep = round_()
            assert outs == ["vm"] and [why for _, why in rep.cleared] == ["deleted"]
            assert led.decisions.alarms() == [] and round_()[0] == []
        finally:
            fleet.close()
            client.close()


@pytest.mark.pure
def test_the_alarm_metric_counts_raised_alarms_by_kind() -> None:
    a = InstanceAlarm("1", "vm_untracked", f"{FLEET}/x", "RUNNING", {}, 1.0, "me", 2.0)
    for alarms, n in (([], 0.0), ([a, a], 2.0)):
        # what GET /metrics serves: both families, read by the reference parser as an oracle
        text = delivery_metrics({}) + alarm_metrics(alarms)
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert set(fams) == {"gce_watchdog_poller_decisions", "gce_watchdog_poller_alarms"}
        alarm = fams["gce_watchdog_poller_alarms"]
        assert alarm.type == "gauge"
        assert {s.labels["alarm"]: s.value for s in alarm.samples} == {
            "vm_untracked": n,
            "idle_busy": 0.0,  # every kind has its series, zero when none is raised
            "boot_regressed": 0.0,
        }
