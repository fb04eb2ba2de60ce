"""Boot order on the Pub/Sub path (issue 35, items 1 and 7): a message of a boot below the
instance's highest boot counter never decides; the worker keeps its own liveness rules. The
worker's ledger part on its own (a subscriber that hands out given batches), then the real
emulator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.poller.boots import Record
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.poller import PollOutcome
from gce_watchdog.poller.pubsub import PubSubWorker
from gce_watchdog.testing.synth import SYNTH_KEY
from kit.bootcount import BcWriter
from kit.identities import Batches, TableIdentities
from kit.pubsub_emulator import publish_all, topic_and_subscription
from kit.pubsub_service import ServiceLikeSubscriber, exported_entry, exported_text

PROJECT = "test-project"
IDS = TableIdentities.of(["66"], PROJECT)
SETTLE_S = 3600.0


def _entries(w: BcWriter, *events: tuple[str, dict[str, str]]) -> list[bytes]:
    lines = [ln for name, f in events for ln in w.line(name, f).decode().splitlines()]
    return [exported_entry(PROJECT, "66", "vm-66", exported_text(x, "vm-66", False)) for x in lines]


def _previous_boot_replayed() -> tuple[list[bytes], list[bytes]]:
    """The current boot (bc=2), alive; the previous boot's (bc=1) lines with its ladder
    shutdown, replayed after them (a boot no worker decided)."""
    a = BcWriter(boot="aaaa0001", bc="1")
    b = BcWriter(boot="bbbb0002", bc="2", ts_ms=a.ts_ms + 3_600_000)
    old = _entries(a, ("start", {"v": "1"}), ("phase", {"ph": "workload"}),
                   ("shutdown", {"reason": "ladder", "rung": "10/10"}))  # fmt: skip
    new = _entries(b, ("start", {"v": "1"}), ("phase", {"ph": "workload"}))
    return old, new


@pytest.mark.pure
@pytest.mark.parametrize("record_from", ["worker", "poller"])
def test_a_replayed_older_boot_never_fails_a_healthy_vm_over(
    tmp_path: Path, record_from: str
) -> None:
    old, new = _previous_boot_replayed()
    outs: list[PollOutcome] = []
    with open_ledger(str(tmp_path / "ledger.sqlite"), owner="w1") as led:
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        if record_from == "poller":  # the polling reader raised the record, no worker saw b
            led.freshness.raise_boot("66", Record(2, "bbbb0002", 1.0))
            batches = [old]
        else:
            batches = [new, old]
        w = PubSubWorker(Batches(batches), "s", led, outs.append, settle_s=SETTLE_S, identity=IDS)
        for _ in batches:
            w.step()
        assert led.decisions.all() == [] and not outs
        assert [a.alarm for a in led.decisions.alarms()] == ["boot_regressed"]
        assert ("66", "aaaa0001", "ended") in led.assembly.boots()
        rec = led.freshness.boot_record("66")
        assert rec is not None and (rec.counter, rec.boot) == (2, "bbbb0002")


@pytest.mark.pure
def test_without_a_higher_boot_on_record_the_older_boot_decides_as_before(tmp_path: Path) -> None:
    old, _ = _previous_boot_replayed()
    outs: list[PollOutcome] = []
    with open_ledger(str(tmp_path / "ledger.sqlite"), owner="w1") as led:
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w = PubSubWorker(Batches([old]), "s", led, outs.append, settle_s=SETTLE_S, identity=IDS)
        w.step()
        assert [d.verdict for d in led.decisions.all()] == ["self_shutdown"]
        assert led.decisions.alarms() == []


# -- against the real emulator --------------------------------------------------------------------

DEADLINE_S = 240.0  # a bound only: the test waits for what it needs (a record, an alarm)


@pytest.mark.process
def test_on_the_emulator_a_replayed_older_boot_never_fails_a_healthy_vm_over(
    pubsub_host: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The issue's Pub/Sub case through the real emulator and the client: the current boot's
    lines (bc=2) go through the worker, then a local process prints the previous boot's lines
    (bc=1, ending in its ladder ``shutdown``, a boot nobody decided) again; they reach the
    worker as messages like any other. No decision, no failover; ``boot_regressed`` instead."""
    from google.cloud import pubsub_v1

    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    old, new = _previous_boot_replayed()
    outs: list[PollOutcome] = []
    with (
        topic_and_subscription(PROJECT, "serial", "watchdog", ack_deadline_s=10) as ts,
        open_ledger(str(tmp_path / "ledger.sqlite"), owner="w1") as led,
    ):
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        sub = ServiceLikeSubscriber(pubsub_v1.SubscriberClient(), 20)
        w = PubSubWorker(sub, ts.subscription, led, outs.append, settle_s=SETTLE_S, identity=IDS)
        publisher = pubsub_v1.PublisherClient()

        def drive(done: Any, what: str) -> None:
            deadline = time.monotonic() + DEADLINE_S
            while not done():
                assert time.monotonic() < deadline, what
                w.step(timeout=0.5)

        publish_all(publisher, ts.topic, new)
        drive(lambda: led.freshness.boot_record("66") is not None, "no boot record from bc=2")
        publish_all(publisher, ts.topic, old)
        drive(lambda: led.decisions.alarms() or led.decisions.all(), "neither alarm nor decision")
        assert led.decisions.all() == [] and not outs
        assert [a.alarm for a in led.decisions.alarms()] == ["boot_regressed"]
        rec = led.freshness.boot_record("66")
        assert rec is not None and (rec.counter, rec.boot) == (2, "bbbb0002")
        sub.close()
