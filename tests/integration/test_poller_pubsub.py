"""The Pub/Sub path (issue 19 item 4, issue 26 item 1): LogEntry decoding of real exported
payloads and the assembly (pure, with properties), the shared assembly state in the ledger, then
workers against the real Pub/Sub emulator behind kit/pubsub_service.py (pulls of at most 20,
spread over several workers, redelivery after the ack deadline): duplicates, reordering, a worker
killed anywhere and restarted, and a worker killed between its claim and its ack; the decisions'
deliveries (``--on-failover``, ``--publish``) across workers."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.poller.assemble import Received, assemble
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.poller import PollOutcome
from gce_watchdog.poller.pubsub import PubSubWorker, parse_log_entry
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind, decide
from gce_watchdog.testing.synth import SYNTH_KEY, Writer
from gce_watchdog.wire.protocol import Event, decode_line
from hypothesis import given
from hypothesis import strategies as st
from kit.identities import TableIdentities
from kit.paths import REPO
from kit.pipes import blocked_pipe
from kit.procs import running, terminate, wait_alive
from kit.pubsub_emulator import publish_all, topic_and_subscription
from kit.pubsub_service import (
    NOISE,
    ServiceLikeSubscriber,
    exported_entry,
    exported_text,
    fleet_stream,
)

PROJECT = "test-project"
# Bounds only: a test waits for what it needs (a decision seen in the ledger), and gives up after
# this long, on a loaded 2-core machine too.
DEADLINE_S = 240.0
# Where every delivery comes back (a withheld one is redelivered by the emulator after its ack
# deadline), no gap may be declared lost while a test runs, however slow the machine: a settle
# longer than any test. The tests of the settle itself set their own.
SETTLE_S = 3600.0
# who the instances of the small streams below are, as the Compute API would say (vm-ID)
IDS = TableIdentities.of(["66", "77", "88", "99"], PROJECT)


def log_entry(iid: str, name: str, text: str, zone: str = "us-central1-a") -> bytes:
    """A LogEntry as a Cloud Logging sink publishes a serial port 1 line (its CR LF kept)."""
    return exported_entry(PROJECT, iid, name, exported_text(text, name, False), zone)


def lines_of(w: Writer, *events: tuple[str, dict[str, str]]) -> list[str]:
    """One console line per entry (a boot's first also gives its key announcement before it)."""
    return [ln for name, fields in events for ln in w.line(name, fields).decode().splitlines()]


# -- pure parts ----------------------------------------------------------------------------------


@pytest.mark.pure
def test_parse_log_entry_takes_serial_port_1_only() -> None:
    line = parse_log_entry(log_entry("123", "vm-1", "hello"))
    assert line is not None and (line.instance_id, line.instance, line.text) == (
        "123",
        "vm-1",
        "hello",
    )
    assert line.zone == "us-central1-a" and line.project == PROJECT
    other = json.loads(log_entry("123", "vm-1", "x"))
    other["logName"] = f"projects/{PROJECT}/logs/syslog"
    assert parse_log_entry(json.dumps(other).encode()) is None
    assert parse_log_entry(b"not json") is None and parse_log_entry(b"[1]") is None
    odd = json.loads(log_entry("123", "vm-1", "x"))
    odd["labels"] = ["not", "a", "map"]
    got = parse_log_entry(json.dumps(odd).encode())
    assert got is not None and got.instance == ""


@pytest.mark.pure
@pytest.mark.parametrize("journald", [False, True])
def test_real_exported_payloads_decode_to_the_agents_line(journald: bool) -> None:
    """textPayload as Cloud Logging exports it: a literal \\r\\n at the end, and (forwarded
    by journald) its prefix. The line decodes to the same verified event as the bare line."""
    w = Writer(boot="eeee0005", announce=False)
    (bare,) = lines_of(w, ("phase", {"ph": "workload"}))
    entry = exported_entry(PROJECT, "9", "vm-9", exported_text(bare, "vm-9", journald))
    assert "\\r\\n" in json.loads(entry)["textPayload"]
    line = parse_log_entry(entry)
    assert line is not None and not line.text.endswith("\\r\\n")
    assert decode_line(line.text, pin=SYNTH_KEY.public) == decode_line(bare, pin=SYNTH_KEY.public)
    assert isinstance(decode_line(line.text, pin=SYNTH_KEY.public), Event)


@pytest.mark.pure
@pytest.mark.parametrize("noise", NOISE)
def test_exported_console_noise_is_not_ours(noise: str) -> None:
    line = parse_log_entry(exported_entry(PROJECT, "9", "vm-9", noise))
    assert line is not None and decode_line(line.text, pin=SYNTH_KEY.public) is None


def _events(n: int) -> list[Event]:
    w = Writer(boot="aaaa0001", announce=False)
    evs = [w.line("heartbeat", {"ph": "workload"}) for _ in range(n)]
    return [e for e in (decode_line(b, pin=SYNTH_KEY.public) for b in evs) if isinstance(e, Event)]


@pytest.mark.pure
@given(st.integers(1, 40), st.randoms(use_true_random=False), st.integers(0, 20))
def test_any_order_with_duplicates_gives_the_prefix_once_in_order(
    n: int, rnd: random.Random, dups: int
) -> None:
    evs = _events(n)
    arrivals = evs + [rnd.choice(evs) for _ in range(dups)]
    rnd.shuffle(arrivals)
    a = assemble([Received(e, 0.0) for e in arrivals])
    assert [e.seq for e in a.prefix] == list(range(n)) and a.next_seq == n
    assert a.held == 0 and not a.settled(1e9, 2.0)  # nothing held: nothing to give up on


@pytest.mark.pure
@given(st.integers(2, 30), st.data())
def test_a_stuck_line_counts_only_once_the_prefix_reaches_it(n: int, data: st.DataObject) -> None:
    """Issue 37: ``Assembly.stuck`` is the first job_stuck line of the gap-free prefix, in any
    order of arrival; one held behind a gap is not (yet) there."""
    w = Writer(boot="aaaa0001", announce=False)
    stuck_at = data.draw(st.integers(0, n - 1))
    raw = [w.line(*STUCK) if i == stuck_at else w.line(*BEAT) for i in range(n)]
    evs = [e for e in (decode_line(b, pin=SYNTH_KEY.public) for b in raw) if isinstance(e, Event)]
    lost = data.draw(st.none() | st.integers(0, n - 1))
    got = [e for e in evs if e.seq != lost]
    data.draw(st.randoms(use_true_random=False)).shuffle(got)
    a = assemble([Received(e, 0.0) for e in got])
    want = evs[stuck_at] if lost is None or stuck_at < lost else None
    assert a.stuck == want


@pytest.mark.pure
@given(st.integers(2, 40), st.data())
def test_a_lost_line_holds_the_rest_until_the_settle_timeout(n: int, data: st.DataObject) -> None:
    evs = _events(n)
    k = data.draw(st.integers(0, n - 2))
    rest = [e for e in evs if e.seq != k]
    data.draw(st.randoms(use_true_random=False)).shuffle(rest)
    a = assemble([Received(e, 0.5 + i / 1000) for i, e in enumerate(rest)])
    assert [e.seq for e in a.prefix] == list(range(k))  # up to the gap
    assert a.held == n - k - 1 and a.held_since == min(
        0.5 + i / 1000 for i, e in enumerate(rest) if e.seq > k
    )
    assert not a.settled(1.0, 2.0)  # not yet
    assert a.settled(3.0, 2.0)


@pytest.mark.pure
@given(st.integers(2, 40), st.data())
def test_the_union_of_any_split_over_workers_is_the_whole_prefix(
    n: int, data: st.DataObject
) -> None:
    """Lines spread over workers at random: no worker alone may see a gap-free boot, their
    union does."""
    evs = _events(n)
    workers = data.draw(st.integers(2, 4))
    owner = [data.draw(st.integers(0, workers - 1)) for _ in evs]
    union = assemble([Received(e, 0.0) for e in evs])
    assert [e.seq for e in union.prefix] == list(range(n))
    for w in range(workers):
        mine = assemble([Received(e, 0.0) for e, o in zip(evs, owner, strict=True) if o == w])
        assert len(mine.prefix) <= n and (len(mine.prefix) < n or all(o == w for o in owner))


@pytest.mark.pure
def test_a_floor_lets_compacted_lines_be_missing() -> None:
    evs = _events(10)
    a = assemble([Received(e, 0.0) for e in evs if e.seq >= 6], floor=6)
    assert a.next_seq == 10 and a.held == 0


@pytest.mark.pure
def test_a_shutdown_ahead_of_its_exit_line_is_not_decided_until_the_exit_arrives() -> None:
    """The job finished (exit rc=0), then the network died and the agent shut down. If the
    shutdown line arrives first, the prefix stops before it: no failover for a finished job."""
    w = Writer(boot="bbbb0002", announce=False)
    raw = lines_of(w, ("phase", {"ph": "workload"}), ("exit", {"rc": "0"}),
                   ("shutdown", {"reason": "ladder", "rung": "10/10"}))  # fmt: skip
    phase, exit_, shutdown = (decode_line(x, pin=SYNTH_KEY.public) for x in raw)
    assert isinstance(phase, Event) and isinstance(exit_, Event) and isinstance(shutdown, Event)
    a = assemble([Received(phase, 0.0), Received(shutdown, 0.0)])
    assert a.terminal is None
    v = decide(list(a.prefix), InstanceState("RUNNING"), 0.0, Policy())
    assert v.kind is not VerdictKind.SELF_SHUTDOWN
    a = assemble([Received(phase, 0.0), Received(shutdown, 0.0), Received(exit_, 0.5)])
    assert a.terminal == exit_
    v = decide(list(a.prefix), InstanceState("RUNNING"), 0.0, Policy())
    assert v.kind is VerdictKind.WORKLOAD_OK


@pytest.mark.pure
def test_a_decision_is_ready_when_the_last_line_it_needed_was_published() -> None:
    """The pipeline's share of a decision's latency starts at the latest first copy of a line up
    to the deciding one: a tick published after its shutdown line (displaced in transit) is
    waited for; a later copy of it, or a line after the shutdown, is not."""
    from gce_watchdog.poller.assembly_store import BootLines
    from gce_watchdog.poller.pubsub import _needed_by

    def rx(seq: int, name: str) -> Received:
        return Received(Event(name, "b", seq, 0), 0.0)

    lines = [(rx(1, "start"), 1.0), (rx(2, "tick"), 20.0), (rx(2, "tick"), 30.0),
             (rx(3, "shutdown"), 10.0), (rx(4, "heartbeat"), 50.0)]  # fmt: skip
    seen = BootLines("1", "b", PROJECT, "z", "vm", 0, lines)
    assert _needed_by(seen, 10.0, 3) == 20.0
    in_order = BootLines("1", "b", PROJECT, "z", "vm", 0, [lines[0], lines[3]])
    assert _needed_by(in_order, 10.0, 3) == 10.0
    assert _needed_by(seen, 1.0, 1) == 1.0  # decided at seq 1 (a gpu_fault): the tick is later


# -- against the real emulator ------------------------------------------------------------------


@pytest.fixture
def topic(pubsub_host: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A fresh topic and subscription (ack deadline 10 s, the minimum) on the emulator."""
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    with topic_and_subscription(PROJECT, "serial", "watchdog", ack_deadline_s=10) as ts:
        yield ts.topic, ts.subscription


def publish(topic: str, datas: list[bytes]) -> None:
    from google.cloud import pubsub_v1

    publish_all(pubsub_v1.PublisherClient(), topic, datas)


def _drive(workers: list[PubSubWorker], done: Any, what: Any) -> None:
    """Step the workers in turn until ``done()`` (bounded: DEADLINE_S)."""
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, what()
        for w in workers:
            w.step(timeout=0.5)


@pytest.mark.process
def test_one_worker_decides_once_per_vm_from_a_service_like_stream(
    topic: tuple[str, str], tmp_path: Path
) -> None:
    """Pulls of at most 20, 5 % of the deliveries lost on the way (the emulator redelivers them
    after the 10 s ack deadline), journald copies, duplicates, noise, shuffled."""
    from google.cloud import pubsub_v1

    t, s = topic
    fleet = fleet_stream(random.Random(19), 30, PROJECT)
    publish(t, fleet.messages)
    sub = ServiceLikeSubscriber(pubsub_v1.SubscriberClient(), 20, withhold=0.05, seed=1)
    outs: list[PollOutcome] = []
    with open_ledger(tmp_path / "ledger.sqlite", owner="w1") as led:
        for iid in fleet.names:  # pinned by the poll path (read from byte 0), or by hand
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        # settle: longer than a redelivery takes (ack deadline 10 s, a loaded machine)
        ids = TableIdentities.of(fleet.names, PROJECT)
        w1 = PubSubWorker(sub, s, led, outs.append, settle_s=SETTLE_S, identity=ids)
        closed = fleet.wedged | fleet.finished
        _drive(
            [w1],
            lambda: (
                {i for i, _, st in led.assembly.boots() if st != "open"} >= closed
                and not led.decisions.pending_announcements()
            ),
            lambda: f"decided {led_count(led)} of {len(fleet.wedged)}",
        )
        decisions = led.decisions.all()
        states = {i: st for i, _, st in led.assembly.boots()}
    assert {d.instance_id for d in decisions} == fleet.wedged  # the finished jobs: never
    assert all(d.verdict == "self_shutdown" for d in decisions)
    assert {states[i] for i in fleet.finished} == {"ended"}
    assert {states[i] for i in fleet.healthy} == {"open"}
    announced = [o.instance_id for o in outs if o.action == "failover"]
    assert sorted(announced) == sorted(fleet.wedged)  # once each, despite duplicates
    assert sub.counts.withheld > 0 and max(sub.counts.sizes) <= 20  # it was service-like
    assert w1.stats.latencies and w1.stats.forged == 0
    sub.close()


@pytest.mark.process
def test_a_boot_that_lost_a_line_is_left_to_the_sweep_never_decided_from_the_stream(
    topic: tuple[str, str], tmp_path: Path
) -> None:
    """The finished job's `exit rc=0` never reaches the stream (lost on the way): its later
    `shutdown` must not fail it over. The wedged VM beside it is decided as usual."""
    from google.cloud import pubsub_v1

    t, s = topic
    msgs: list[bytes] = []
    for i, lose_exit in ((0, False), (1, True)):
        iid, name = f"{5_000_000_000 + i}", f"vm-{i:03d}"
        evs: list[tuple[str, dict[str, str]]] = [
            ("start", {"v": "1"}),
            ("phase", {"ph": "workload"}),
        ]
        evs += [("tick", {"rung": f"{r}/10", "md": "fail", "eg": "fail"}) for r in range(1, 4)]
        if lose_exit:
            evs.append(("exit", {"rc": "0"}))
        evs.append(("shutdown", {"reason": "ladder", "rung": "10/10"}))
        texts = lines_of(Writer(boot=f"{i:08x}"), *evs)
        if lose_exit:
            texts = [x for x in texts if " exit " not in x]
        msgs += [log_entry(iid, name, x) for x in texts]
    publish(t, msgs)
    sub = ServiceLikeSubscriber(pubsub_v1.SubscriberClient(), 3, seed=2)
    outs: list[PollOutcome] = []
    with open_ledger(tmp_path / "ledger.sqlite", owner="w1") as led:
        for iid in ("5000000000", "5000000001"):
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        ids = TableIdentities.of({"5000000000": "vm-000", "5000000001": "vm-001"}, PROJECT)
        w = PubSubWorker(sub, s, led, outs.append, settle_s=1.0, identity=ids)
        _drive(
            [w],
            lambda: led_count(led) >= 1 and w.gapped and w.next_gap() is None,
            lambda: f"decided {led_count(led)}, gapped {w.gapped}",
        )
        assert [d.instance_id for d in led.decisions.all()] == ["5000000000"]
        assert w.heard("5000000001")[1] and not w.heard("5000000000")[1]
        assert w.gapped == {"5000000001"} and w.stats.gapped == 1
    assert [o.instance_id for o in outs if o.action == "failover"] == ["5000000000"]
    sub.close()


# -- the shared assembly state, without the emulator ----------------------------------------------


class _Msg:
    def __init__(self, data: bytes, n: int) -> None:
        self.data, self.publish_time = data, None
        self.n = n


class _Rm:
    def __init__(self, data: bytes, n: int) -> None:
        self.message, self.ack_id = _Msg(data, n), f"ack-{n}"


class _Batches:
    """A subscriber whose pulls hand out given batches, recording acks (no emulator: the
    ledger's part of the protocol on its own)."""

    def __init__(self, batches: list[list[bytes]]) -> None:
        self.batches = [[_Rm(d, i * 1000 + j) for j, d in enumerate(b)] for i, b in
                        enumerate(batches)]  # fmt: skip
        self.acked: list[str] = []

    def pull(self, request: dict[str, Any], timeout: float | None = None) -> Any:
        class R:
            received_messages = self.batches.pop(0) if self.batches else []

        return R()

    def acknowledge(self, request: dict[str, Any]) -> None:
        self.acked += request["ack_ids"]


def _boot_entries(iid: str, boot: str, finished: bool = False) -> list[bytes]:
    evs: list[tuple[str, dict[str, str]]] = [("start", {"v": "1"}), ("phase", {"ph": "workload"})]
    if finished:
        evs.append(("exit", {"rc": "0"}))
    evs.append(("shutdown", {"reason": "ladder", "rung": "10/10"}))
    return [log_entry(iid, f"vm-{iid}", x) for x in lines_of(Writer(boot=boot), *evs)]


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "ledger.sqlite")
    return str(request.getfixturevalue("pg_database"))


@pytest.mark.process
def test_two_workers_each_with_half_a_boot_decide_it_once_from_the_union(
    ledger_url: str,
) -> None:
    """The key and the shutdown go to worker 1, the rest to worker 2: neither alone has a
    gap-free boot (issue 26: with per-worker state 0 of 9 were decided). Worker 2's lines come
    before any pin: stored raw, verified once the poll path has placed the pin."""
    entries = _boot_entries("77", "abab0001")  # key lines (v3: two), start, phase, shutdown
    outs: list[PollOutcome] = []
    s2 = _Batches([entries[-3:-1]])
    s1 = _Batches([entries[:-3] + entries[-1:]])
    with open_ledger(ledger_url, owner="w1") as l1, open_ledger(ledger_url, owner="w2") as l2:
        w2 = PubSubWorker(s2, "s", l2, outs.append, settle_s=SETTLE_S, identity=IDS)
        w1 = PubSubWorker(s1, "s", l1, outs.append, settle_s=SETTLE_S, identity=IDS)
        w2.step()
        assert (
            l2.decisions.all() == [] and w2.stats.unverified == 2 and len(s2.acked) == 2
        )  # stored: acked
        l1.pins.place_pin(
            "77", SYNTH_KEY.public, SYNTH_KEY.fingerprint
        )  # the poll path pins it meanwhile
        w1.step()
        (d,) = l1.decisions.all()
        assert (d.instance_id, d.boot, d.verdict, d.owner) == (
            "77",
            "abab0001",
            "self_shutdown",
            "w1",
        )
        assert l1.assembly.boots() == [("77", "abab0001", "decided")]
        # a redelivery of any of its lines, to either worker: acked, nothing new
        s2.batches = [[_Rm(e, 9000 + i) for i, e in enumerate(entries)]]
        w2.step()
        assert len(l2.decisions.all()) == 1 and len(s2.acked) == 2 + len(entries)
    assert [o.action for o in outs] == ["failover"]


@pytest.mark.pure
def test_a_restarted_worker_loses_nothing_and_needs_nothing_again(tmp_path: Path) -> None:
    """A worker stores lines and acks them, then dies; its successor gets only the rest of the
    stream (what was acked is gone) and still decides: the state was in the store."""
    url = str(tmp_path / "ledger.sqlite")
    wedged = _boot_entries("88", "cdcd0001")
    finished = _boot_entries("99", "efef0001", finished=True)
    outs: list[PollOutcome] = []
    with open_ledger(url, owner="w1") as led:
        for iid in ("88", "99"):
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        first = PubSubWorker(
            _Batches([wedged[:-1] + finished[:-2]]), "s", led, outs.append, identity=IDS
        )
        assert "shutdown" in str(wedged[-1]) and "exit" in str(finished[-2])
        first.step()
        assert (
            led.decisions.all() == [] and first.stats.acked == len(wedged) - 1 + len(finished) - 2
        )
    with open_ledger(url, owner="w1b") as led:
        again = PubSubWorker(_Batches([[wedged[-1], finished[-2], finished[-1]]]), "s", led,
                             outs.append, identity=IDS)  # fmt: skip
        again.step()
        assert [d.instance_id for d in led.decisions.all()] == ["88"]
        assert sorted(led.assembly.boots()) == [
            ("88", "cdcd0001", "decided"),
            ("99", "efef0001", "ended"),
        ]
        assert led.db.exec("SELECT COUNT(*) FROM assembly_lines") == [(0,)]  # pruned
    assert [o.instance_id for o in outs if o.action == "failover"] == ["88"]


GPU_FAULT = ("gpu_fault", {"xid": "79", "pci": "0000:00:04.0", "gpu": "3", "sig": "lost"})
BEAT = ("heartbeat", {"rung": "0/10", "ph": "workload"})


def _gpu_boot(iid: str, boot: str, *evs: tuple[str, dict[str, str]]) -> list[bytes]:
    start = [("start", {"v": "1"}), ("phase", {"ph": "workload"})]
    return [log_entry(iid, f"vm-{iid}", x) for x in lines_of(Writer(boot=boot), *start, *evs)]


@pytest.mark.pure
@pytest.mark.parametrize(
    ("evs", "want"),
    [
        # the agent keeps beating after the fault: no terminal line ever comes
        ([GPU_FAULT, BEAT, BEAT], "gpu_fault"),
        # every GPU stopped answering NVML (the memory watch)
        ([("memory_gpu", {"st": "lost", "n": "0"}), BEAT], "gpu_fault"),
        # taken back in the same batch, before a look: nothing (split over two batches, the
        # first look decides, as a poll that read up to the loss would)
        (
            [
                ("memory_gpu", {"st": "lost", "n": "0"}),
                ("memory_gpu", {"st": "ok", "n": "8"}),
                BEAT,
            ],
            None,
        ),
        # the job finished first: never run a finished job twice
        ([("exit", {"rc": "0", "sig": "-"}), GPU_FAULT], None),
        # the fault, then the ladder's shutdown: the fault decides (the first cause)
        ([GPU_FAULT, ("shutdown", {"reason": "ladder", "rung": "10/10"})], "gpu_fault"),
        # application Xids and stalls never decide
        ([("gpu_event", {"xid": "13", "cls": "app"}), ("gpu_stall", {"ms": "12000"})], None),
    ],
)
def test_a_gpu_fault_decides_in_the_stream_as_in_the_polling_reader(
    tmp_path: Path, evs: list[tuple[str, dict[str, str]]], want: str | None
) -> None:
    """Issue 36: the worker decides gpu_fault at the fault line (same pure rule as poll), one
    claim, while the agent beats on; the policy's report mode decides nothing in the stream."""
    entries = _gpu_boot("66", "abcd0066", *evs)
    outs: list[PollOutcome] = []
    with open_ledger(str(tmp_path / "ledger.sqlite"), owner="w1") as led:
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w = PubSubWorker(_Batches([entries[:-1], entries[-1:]]), "s", led, outs.append,
                         settle_s=SETTLE_S, identity=IDS)  # fmt: skip
        w.step()
        w.step()
        assert [d.verdict for d in led.decisions.all()] == ([want] if want else []), (
            w.stats,
            led.assembly.boots(),
        )
        assert [o.action for o in outs] == (["failover"] if want else [])
        if want:
            assert led.assembly.boots() == [("66", "abcd0066", "decided")]
            assert "GPU" in outs[0].verdict.reason  # type: ignore[union-attr]
            assert w.stats.decisions == 1
    # the same boot under --on-gpu-fault report: an alarm for the Compute API sweep, no claim
    with open_ledger(str(tmp_path / "report.sqlite"), owner="w2") as led:
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        r = PubSubWorker(_Batches([entries]), "s", led, outs.append, settle_s=SETTLE_S,
                         identity=IDS, policy=Policy(gpu_fault_report=True))  # fmt: skip
        r.step()
        # report mode holds back only the GPU's own failover: a later ladder shutdown decides
        shut = ["self_shutdown"] if any(name == "shutdown" for name, _ in evs) else []
        assert [d.verdict for d in led.decisions.all()] == shut


@pytest.mark.pure
def test_a_gpu_fault_past_a_gap_another_worker_fills_is_decided_once_the_hint_is_due(
    tmp_path: Path,
) -> None:
    """The fault goes to worker 1, the line before it to worker 2 (which has no reason to look:
    neither a terminal line nor a fault). Worker 1's look left a hint; when it comes due
    (settle_s after the held line's receipt) the housekeeping look finds the gap filled and
    decides gpu_fault once; before that nothing is decided."""
    entries = _gpu_boot("77", "abcd0077", GPU_FAULT, BEAT)  # key, key, start, phase, fault, beat
    t = [1000.0]
    outs: list[PollOutcome] = []
    url = str(tmp_path / "ledger.sqlite")
    with open_ledger(url, owner="w1") as l1, open_ledger(url, owner="w2") as l2:
        l1.pins.place_pin("77", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w1 = PubSubWorker(_Batches([entries[:3] + entries[4:]]), "s", l1, outs.append,
                          settle_s=2.0, clock=lambda: t[0], identity=IDS)  # fmt: skip
        w2 = PubSubWorker(_Batches([entries[3:4]]), "s", l2, outs.append, settle_s=2.0,
                          clock=lambda: t[0], identity=IDS)  # fmt: skip
        w1.step()
        t[0] += 0.5
        w2.step()  # fills the gap, does not look
        assert l1.decisions.all() == [] and l1.assembly.boots() == [("77", "abcd0077", "open")]
        t[0] += 1.0
        w1.step()  # housekeeping, the hint not due yet
        assert l1.decisions.all() == []
        t[0] += 1.0
        w1.step()
        assert [d.verdict for d in l1.decisions.all()] == ["gpu_fault"]
        assert l1.assembly.boots() == [("77", "abcd0077", "decided")]
    assert [o.action for o in outs] == ["failover"]


STUCK = ("job_stuck", {"rule": "idle", "step": "9", "quiet": "1800", "act": "end"})
SHUTDOWN = ("shutdown", {"reason": "ladder", "rung": "10/10"})


@pytest.mark.pure
@pytest.mark.parametrize(
    ("evs", "want", "reported"),
    [
        # the agent beats on after the stuck line: no terminal line ever comes
        ([STUCK, BEAT, BEAT], "job_stuck", None),
        # the agent's end of life: the job killed by its signal, then the shutdown (reported
        # only: the exit decides, a workload failure, which the stream leaves to the sweep)
        ([STUCK, ("exit", {"rc": "143", "sig": "TERM"}), SHUTDOWN], "job_stuck", None),
        # reported only: the ladder's later shutdown still decides
        ([STUCK, BEAT, SHUTDOWN], "job_stuck", "self_shutdown"),
        # the job finished first: its end decides (never run a finished job twice)
        ([("exit", {"rc": "0", "sig": "-"}), STUCK], None, None),
        # a GPU fault before it explains it and decides instead
        ([GPU_FAULT, STUCK], "gpu_fault", "gpu_fault"),
    ],
)
def test_a_stuck_job_decides_in_the_stream_as_in_the_polling_reader(
    tmp_path: Path, evs: list[tuple[str, dict[str, str]]], want: str | None, reported: str | None
) -> None:
    """Issue 37: the worker decides job_stuck at the signed job_stuck line (the same pure rule
    as poll), one claim; with --on-job-stuck report it decides nothing at that line."""
    entries = _gpu_boot("66", "abcd0066", *evs)
    outs: list[PollOutcome] = []
    with open_ledger(str(tmp_path / "ledger.sqlite"), owner="w1") as led:
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w = PubSubWorker(_Batches([entries[:-1], entries[-1:]]), "s", led, outs.append,
                         settle_s=SETTLE_S, identity=IDS)  # fmt: skip
        w.step()
        w.step()
        assert [d.verdict for d in led.decisions.all()] == ([want] if want else []), w.stats
        assert [o.action for o in outs] == (["failover"] if want else [])
        if want:
            assert led.assembly.boots() == [("66", "abcd0066", "decided")]
            assert w.stats.decisions == 1 and w.stats.announced == 1
        if want == "job_stuck":
            assert "stuck" in outs[0].verdict.reason  # type: ignore[union-attr]
    with open_ledger(str(tmp_path / "report.sqlite"), owner="w2") as led:
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        r = PubSubWorker(_Batches([entries]), "s", led, outs.append, settle_s=SETTLE_S,
                         identity=IDS, policy=Policy(job_stuck_report=True))  # fmt: skip
        r.step()
        # report mode holds back only the stuck job's own failover
        assert [d.verdict for d in led.decisions.all()] == ([reported] if reported else [])


@pytest.mark.pure
def test_stuck_jobs_fail_over_under_the_fleet_brake(tmp_path: Path) -> None:
    """A job_stuck failover is a claim like any other: the fleet-wide brake lets its share
    through (here one) and holds the rest until an operator releases them."""
    from gce_watchdog.poller.brake import BrakeRule

    entries = _gpu_boot("66", "abcd0066", STUCK, BEAT) + _gpu_boot("77", "abcd0077", STUCK)
    outs: list[PollOutcome] = []
    with open_ledger(str(tmp_path / "ledger.sqlite"), owner="w1") as led:
        led.decisions.brake = BrakeRule(0.1, 600.0, 1)
        led.decisions.fleet_size = lambda: 2
        for iid in ("66", "77"):
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w = PubSubWorker(_Batches([entries]), "s", led, outs.append, settle_s=SETTLE_S,
                         identity=IDS)  # fmt: skip
        w.step()
        assert [(d.instance_id, d.verdict) for d in led.decisions.all()] == [("66", "job_stuck")]
        assert [(h.instance_id, h.verdict) for h in led.decisions.holds()] == [("77", "job_stuck")]
        assert [o.instance_id for o in outs if o.action == "failover"] == ["66"]


@pytest.mark.pure
def test_the_store_asks_for_a_later_look_only_where_a_boot_has_a_gap(tmp_path: Path) -> None:
    """Issue 38: a boot whose stored lines run without a gap needs no look until its terminal
    line comes (the store returns it then); one with a gap gets the hint at its receipt, so a
    gap nobody fills is declared lost settle_s later. Before, every boot stored got the hint,
    and every worker looked at every boot again settle_s after each of its lines."""
    whole = _gpu_boot("66", "abcd0066", BEAT, BEAT)
    holed = _gpu_boot("77", "abcd0077", BEAT, BEAT)
    with open_ledger(str(tmp_path / "ledger.sqlite"), owner="w1") as led:
        for iid in ("66", "77"):
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w = PubSubWorker(_Batches([whole + holed[:3] + holed[4:]]), "s", led, lambda o: None,
                         settle_s=SETTLE_S, clock=lambda: 1000.0, identity=IDS)  # fmt: skip
        w.step()
        assert led.assembly.gaps_due(10_000.0) == [("77", "abcd0077")]
        assert led.assembly.next_gap() == 1000.0


@pytest.mark.pure
def test_claim_many_decides_each_as_claim_would_in_one_transaction(tmp_path: Path) -> None:
    """The worker's claims of one pull: tokens in order, an existing decision returned as
    claim returns it (not won), all durable together."""
    with open_ledger(str(tmp_path / "ledger.sqlite"), owner="w1") as led:
        first = led.decisions.claim("66", "b1", "self_shutdown", "r", "p/z/vm-66", 1.0)
        got = led.decisions.claim_many(
            [("66", "b1", "self_shutdown", "r", "p/z/vm-66"),
             ("77", "b2", "job_stuck", "r", "p/z/vm-77"),
             ("88", "b3", "gpu_fault", "r", "p/z/vm-88")], 2.0)  # fmt: skip
        assert [(d.instance_id, d.token, d.won) for d in got] == [
            ("66", first.token, False),
            ("77", first.token + 1, True),
            ("88", first.token + 2, True),
        ]
        assert led.decisions.mark_announced_many([("77", "b2"), ("88", "b3"), ("77", "b2")]) == 2
        assert led.decisions.mark_announced_many([("77", "b2")]) == 0
    with open_ledger(str(tmp_path / "ledger.sqlite"), owner="w2") as again:
        assert [d.instance_id for d in again.decisions.all()] == ["66", "77", "88"]


@pytest.mark.pure
def test_a_forged_line_under_another_key_is_never_evidence(tmp_path: Path) -> None:
    real = _boot_entries("66", "aaaa6666", finished=True)
    import secrets

    from gce_watchdog.wire import protocol

    w = Writer(boot="aaaa6666", key=protocol.LineKey(secrets.token_bytes(32)))
    fake = [log_entry("66", "vm-66", x) for x in lines_of(
        w, ("start", {"v": "1"}), ("shutdown", {"reason": "ladder", "rung": "10/10"}))]  # fmt: skip
    with open_ledger(tmp_path / "l.sqlite") as led:
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        wk = PubSubWorker(
            _Batches([real[:1], fake, real[1:]]), "s", led, lambda o: None, identity=IDS
        )
        for _ in range(3):
            wk.step()
        assert led.decisions.all() == [] and wk.stats.forged >= 2
        assert led.assembly.boots() == [("66", "aaaa6666", "ended")]


@pytest.mark.pure
def test_a_copy_of_a_verified_line_is_not_verified_again_and_a_forged_copy_still_fails(
    tmp_path: Path,
) -> None:
    """Issue 38: journald's copy of a line (another prefix, the same signed bytes) and a
    duplicate are answered by the worker's cache of verified signatures; a line with the same
    boot and seq under another key is checked, and forged, all the same."""
    import secrets

    from gce_watchdog.wire import protocol

    evs = (("start", {"v": "1"}), ("shutdown", {"reason": "ladder", "rung": "10/10"}))
    texts = lines_of(Writer(boot="aaaa6666"), *evs)
    signed = [t for t in texts if " key pk=" not in t]  # start, shutdown (not the key lines)
    bare = [log_entry("66", "vm-66", t) for t in texts]
    copies = [exported_entry(PROJECT, "66", "vm-66", exported_text(t, "vm-66", True))
              for t in signed]  # fmt: skip
    other = Writer(boot="aaaa6666", key=protocol.LineKey(secrets.token_bytes(32)))
    fake = [log_entry("66", "vm-66", t) for t in lines_of(other, *evs) if " key pk=" not in t]
    dup = log_entry("66", "vm-66", signed[0])
    with open_ledger(tmp_path / "l.sqlite") as led:
        led.pins.place_pin("66", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        outs: list[PollOutcome] = []
        wk = PubSubWorker(_Batches([bare[:-1] + copies + fake + bare[-1:] + [dup]]), "s",
                          led, outs.append, settle_s=SETTLE_S, identity=IDS)  # fmt: skip
        wk.step()
        # start and shutdown verified once each; their journald copies and start's duplicate
        # from the cache; the other key's lines verified, and forged
        assert len(signed) == 2 and len(fake) == 2
        assert wk.stats.verified_again == len(copies) + 1
        assert wk.stats.forged == len(fake)
        assert [(d.instance_id, d.verdict) for d in led.decisions.all()] == [
            ("66", "self_shutdown")
        ]


@pytest.mark.process
def test_a_pull_of_many_boots_with_copies_is_stored_once_per_line_in_both_backends(
    ledger_url: str,
) -> None:
    """The store writes a pull's boots and lines as multi-row statements (PostgreSQL: chunks of
    ``VALUES_ROWS``): more boots than one chunk, every line twice in the batch, one terminal
    line; each line is stored once (the first copy), the terminal's boot is returned."""
    from gce_watchdog.poller.assembly_store import OPEN, BootUpdate, StoredLine
    from gce_watchdog.poller.ledger_pg import VALUES_ROWS

    n = VALUES_ROWS + 20
    lines = [
        StoredLine(f"{i}", PROJECT, "z", f"vm-{i}", Event(ev, f"b{i:04d}", seq, 1000, (), ev),
                   10.0 + k, 100.0 + k)
        for k in (0, 1) for i in range(n)
        for seq, ev in ((1, "start"), (2, "shutdown" if i == 7 else "heartbeat"))
    ]  # fmt: skip
    with open_ledger(ledger_url, owner="w1") as led:
        touched, dropped = led.assembly.store(lines, [])
        assert (touched, dropped) == ({("7", "b0007")}, 0)
        looked = led.assembly.update_many(
            [("7", "b0007"), (f"{n - 1}", f"b{n - 1:04d}")], lambda b: BootUpdate(OPEN, None)
        )
        for seen, _ in looked.values():  # the first copy of each seq: received at 10.0
            assert [(r.event.seq, r.received_at, p) for r, p in seen.lines] == [
                (1, 10.0, 100.0),
                (2, 10.0, 100.0),
            ]
        assert len(led.assembly.boots(OPEN)) == n


# -- many workers (issue 26 "Done when") --------------------------------------------------------


def _worker(
    host: str, sub: str, ledger: str, owner: str, seed: int, out: Path, names: Path, *extra: str
) -> subprocess.Popen[bytes]:
    """A worker process (kit/pubsub_worker.py); its stdout and stderr go to ``out`` (a file: a
    pipe nobody reads while it runs could fill and block it). ``$WORKER`` is its owner name."""
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'agent'}:{REPO / 'tests'}",
           "PUBSUB_EMULATOR_HOST": host, "WORKER": owner}  # fmt: skip
    argv = [sys.executable, "-m", "kit.pubsub_worker", "--subscription", sub, "--ledger", ledger,
            "--max", "20", "--withhold", "0.03", "--seed", str(seed), "--settle", str(SETTLE_S),
            "--owner", owner, "--names", str(names), *extra]  # fmt: skip
    with open(out, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)


# Its own deadlines (DEADLINE_S, then 2 x DEADLINE_S after the kill) say what was decided when
# they run out; pytest-timeout's default (300 s) came first on a loaded machine and said nothing.
@pytest.mark.process
@pytest.mark.timeout(3 * DEADLINE_S + 120)
def test_three_workers_with_one_killed_decide_a_100_vm_fleet_exactly_once(
    topic: tuple[str, str], pubsub_host: str, ledger_url: str, tmp_path: Path
) -> None:
    """3 worker processes on one subscription, pulls of at most 20, deliveries lost on the way
    (redelivered by the emulator after the ack deadline), one worker SIGKILLed mid-stream and
    restarted: every wedged VM decided once, no healthy or finished VM, from the stream alone.
    PostgreSQL (many hosts) and SQLite (one host)."""
    t, s = topic
    fleet = fleet_stream(random.Random(26), 100, PROJECT)
    publish(t, fleet.messages)
    with open_ledger(ledger_url) as led:  # the poll path pins each VM (byte 0 of its port)
        for iid in fleet.names:
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
    logs = {n: tmp_path / f"{n}.out" for n in ("w0", "w1", "w2", "w0b")}
    names = tmp_path / "names.json"  # who each id is, as the Compute API would say
    TableIdentities.of(fleet.names, PROJECT).save(names)
    # A kill between a pull's claims and its marks leaves a decision claimed, unannounced: another
    # worker announces it once its lease lapses. With the default 300 s lease that wait was the
    # whole test's time when the kill landed there (307 s against 25 s, a make test under load).
    lease = ("--announce-lease", "30")
    procs = {f"w{i}": _worker(pubsub_host, s, ledger_url, f"w{i}", i, logs[f"w{i}"], names, *lease)
             for i in range(3)}  # fmt: skip
    try:
        with open_ledger(ledger_url) as led:
            deadline = time.monotonic() + DEADLINE_S
            while led_count(led) < len(fleet.wedged) // 4:  # a quarter decided: kill one
                assert all(p.poll() is None for p in procs.values()), _errs(procs)
                assert time.monotonic() < deadline, f"decided {led_count(led)}"
                time.sleep(0.1)
            procs["w0"].kill()
            procs.pop("w0").wait(timeout=30)
            procs["w0b"] = _worker(pubsub_host, s, ledger_url, "w0b", 7, logs["w0b"], names, *lease)
            closed = fleet.wedged | fleet.finished
            deadline = time.monotonic() + 2 * DEADLINE_S
            while not (
                {i for i, _, st in led.assembly.boots() if st != "open"} >= closed
                and not led.decisions.pending_announcements()
            ):
                assert all(p.poll() is None for p in procs.values()), _errs(procs)
                assert time.monotonic() < deadline, f"decided {led_count(led)}"
                time.sleep(0.2)
            decisions = led.decisions.all()
            states = {i: st for i, _, st in led.assembly.boots()}
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs.values()), _errs(procs)
    assert sorted(d.instance_id for d in decisions) == sorted(fleet.wedged)  # each once
    assert {d.verdict for d in decisions} == {"self_shutdown"}
    assert {states[i] for i in fleet.finished} == {"ended"}
    assert {states.get(i) for i in fleet.healthy} == {"open"}
    docs = [json.loads(x) for f in logs.values() for x in f.read_text().splitlines()
            if x.startswith("{")]  # fmt: skip
    stats = [d["stats"] for d in docs if "stats" in d]  # the killed worker printed none
    assert len(stats) == 3 and all(st["max_pull"] <= 20 for st in stats)
    assert sum(st["counts"]["withheld"] for st in stats) > 0
    assert all(st["counts"]["handed"] > 0 for st in stats)  # spread over all
    announced = [d["instance_id"] for d in docs if d.get("action") == "failover"]
    assert set(announced) == fleet.wedged
    # at-least-once: only the worker killed between printing a pull's announcements and
    # marking them (one transaction per pull since issue 38) repeats, that pull's at most
    assert len(announced) - len(fleet.wedged) <= max(st["max_pull"] for st in stats)
    assert len({d.owner for d in decisions}) >= 2  # decided by several workers


# The --on-failover hook of the tests below: every call is recorded ("calls": token, worker),
# the first call for each token fails (exit 1), the second succeeds ("succeeded"). With
# KILL_FIRST set, the very first call of all kills its worker (SIGKILL) before exiting 1: a
# worker that dies while its hook runs, before the hook succeeded.
HOOK = """
import fcntl, json, os, signal, sys
state = sys.argv[1]
doc = json.load(sys.stdin)
token = os.environ["GCE_WATCHDOG_TOKEN"]
assert doc["v"] == 2 and str(doc["token"]) == token
assert doc["verdict"] in ("self_shutdown", "preempted")
assert doc["request_id"] == os.environ["GCE_WATCHDOG_REQUEST_ID"]
assert os.environ["GCE_WATCHDOG_INSTANCE"].endswith("/" + doc["name"])
me = os.environ.get("WORKER", "cli")
with open(os.path.join(state, "lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    calls = open(os.path.join(state, "calls")).read().split() if os.path.exists(
        os.path.join(state, "calls")) else []
    with open(os.path.join(state, "calls"), "a") as f:
        f.write(f"{token} {me}\\n")
    if not calls and os.environ.get("KILL_FIRST"):
        os.kill(os.getppid(), signal.SIGKILL)
        sys.exit(1)
    if token not in calls[0::2]:
        sys.exit(1)  # the first call for this token fails: retried with back-off
    with open(os.path.join(state, "succeeded"), "a") as f:
        f.write(f"{token} {me}\\n")
"""


def _three_workers_until_decided(
    pubsub_host: str, s: str, ledger_url: str, fleet: Any, tmp_path: Path, extra: tuple[str, ...]
) -> tuple[list[Any], dict[str, Path], list[str]]:
    """Three workers (``extra`` their delivery flags) on ``s`` until every wedged and finished
    boot of ``fleet`` is closed and no announcement is pending (at most one worker may die: the
    one ``KILL_FIRST`` kills), then SIGTERM to the rest: (decisions, logs, the killed one)."""
    logs = {n: tmp_path / f"{n}.out" for n in ("w0", "w1", "w2")}
    names = tmp_path / "names.json"  # who each id is, as the Compute API would say
    TableIdentities.of(fleet.names, PROJECT).save(names)
    procs = {n: _worker(pubsub_host, s, ledger_url, n, i, logs[n], names, *extra)
             for i, n in enumerate(logs)}  # fmt: skip
    try:
        with open_ledger(ledger_url) as led:
            closed = fleet.wedged | fleet.finished
            deadline = time.monotonic() + 2 * DEADLINE_S
            while not (
                {i for i, _, st in led.assembly.boots() if st != "open"} >= closed
                and not led.decisions.pending_announcements()
            ):
                assert time.monotonic() < deadline, f"decided {led_count(led)}: {_errs(procs)}"
                assert sum(p.poll() is not None for p in procs.values()) <= 1, _errs(procs)
                time.sleep(0.2)
            decisions = led.decisions.all()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    killed = [n for n, p in procs.items() if p.returncode == -signal.SIGKILL]
    assert len(killed) == 1 and all(
        p.returncode == 0 for n, p in procs.items() if n not in killed
    ), _errs(procs)
    return decisions, logs, killed


def _hook(tmp_path: Path) -> tuple[Path, str]:
    state = tmp_path / "hook"
    state.mkdir()
    (tmp_path / "hook.py").write_text(HOOK)
    return state, f"{sys.executable} {tmp_path / 'hook.py'} {state}"


def _pairs(path: Path) -> list[tuple[str, str]]:
    words = path.read_text().split() if path.exists() else []
    return list(zip(words[0::2], words[1::2], strict=True))


@pytest.mark.process
def test_on_failover_runs_once_per_decision_across_workers_and_a_worker_killed_in_its_hook(
    topic: tuple[str, str], pubsub_host: str, ledger_url: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """3 workers with --on-failover on one subscription (pulls of at most 20, deliveries lost on
    the way), on a 30-VM fleet (18 wedged): each hook fails once, then succeeds on its retry; the
    very first hook run kills its worker. Every wedged VM's hook succeeded exactly once per
    token, run by the worker that marked the announcement done (the holder of its lease); the
    killed worker's decision is taken over by another once its lease lapsed."""
    t, s = topic
    fleet = fleet_stream(random.Random(126), 30, PROJECT)
    publish(t, fleet.messages)
    with open_ledger(ledger_url) as led:
        for iid in fleet.names:
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
    state, hook = _hook(tmp_path)
    monkeypatch.setenv("KILL_FIRST", "1")
    extra = ("--on-failover", hook, "--announce-lease", "8")
    decisions, _logs, killed = _three_workers_until_decided(
        pubsub_host, s, ledger_url, fleet, tmp_path, extra
    )
    assert sorted(d.instance_id for d in decisions) == sorted(fleet.wedged)
    tokens = {str(d.token): d for d in decisions}
    calls, succeeded = _pairs(state / "calls"), _pairs(state / "succeeded")
    assert Counter(t for t, _ in succeeded) == Counter(list(tokens))  # once per token
    for token, who in succeeded:  # by the worker whose announcement it was
        assert tokens[token].announced_by == who and tokens[token].announced_at is not None
    per_token = Counter(t for t, _ in calls)
    assert set(per_token) == set(tokens) and min(per_token.values()) >= 2  # failed, retried
    first_token, first_worker = calls[0]
    assert first_worker == killed[0]
    assert tokens[first_token].announced_by != killed[0]  # taken over after the lease


def _two_wedged_one_finished(
    topic: str, ledger: Path, compute: Any, ids: tuple[str, str, str], boots: tuple[str, str, str]
) -> None:
    """Three VMs' boots on ``topic``: the first two wedged, the third finished; each VM pinned
    in ``ledger`` and known to the fake Compute API by its id."""
    msgs = _boot_entries(ids[0], boots[0]) + _boot_entries(ids[1], boots[1])
    msgs += _boot_entries(ids[2], boots[2], finished=True)
    publish(topic, msgs)
    with open_ledger(ledger) as led:
        for iid in ids:
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
            compute.add_instance(f"vm-{iid}", project=PROJECT, instance_id=iid)  # who it is


def _cli_worker(
    subscription: str, ledger: Path, tmp_path: Path, compute: Any, pubsub_host: str, *extra: str
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of one ``gce-watchdog poll --pubsub`` worker (settle 1 s, JSON
    lines, ids looked up in ``compute``), with ``extra`` options."""
    (tmp_path / "tok").write_text("unused\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PUBSUB_EMULATOR_HOST": pubsub_host}
    argv = [sys.executable, "-m", "gce_watchdog", "poll", "--pubsub", subscription,
            "--ledger", str(ledger), "--json", "--settle", "1s",
            "--access-token-file", str(tmp_path / "tok"), "--api-base", compute.base_url,
            *extra]  # fmt: skip
    return argv, env


@pytest.mark.process
def test_poll_pubsub_runs_on_failover_with_the_decision_and_retries_it(
    topic: tuple[str, str], pubsub_host: str, tmp_path: Path, compute: Any
) -> None:
    """``gce-watchdog poll --pubsub S --on-failover CMD`` (no longer a usage error): two wedged
    VMs on the stream; each hook fails once and succeeds on its retry; each announcement is
    marked done once its hook succeeded, and the hook succeeded once per token."""
    t, s = topic
    ledger = tmp_path / "l.sqlite"
    ids, boots = ("5101", "5102", "5103"), ("abab0001", "abab0002", "abab0003")
    _two_wedged_one_finished(t, ledger, compute, ids, boots)
    state, hook = _hook(tmp_path)
    argv, env = _cli_worker(s, ledger, tmp_path, compute, pubsub_host, "--on-failover", hook)
    env.pop("KILL_FIRST", None)
    with running(argv, env) as worker:
        with open_ledger(ledger) as led:
            wait_alive(
                worker,
                lambda: (
                    len(_pairs(state / "succeeded")) >= 2
                    and not led.decisions.pending_announcements()
                ),
                DEADLINE_S,
                "the hooks never succeeded",
            )
            decisions = led.decisions.all()
        out, err = terminate(worker)
    assert worker.returncode == 0, err.decode()
    assert sorted(d.instance_id for d in decisions) == ["5101", "5102"]
    assert all(d.announced_at is not None for d in decisions)
    assert sorted(t for t, _ in _pairs(state / "succeeded")) == sorted(
        str(d.token) for d in decisions
    )
    assert Counter(t for t, _ in _pairs(state / "calls")) == {str(d.token): 2 for d in decisions}
    assert b"--on-failover for token" in err and b"(attempt 1/3)" in err  # the failed first run
    lines = [json.loads(x) for x in out.decode().splitlines()]
    assert sorted(x["instance_id"] for x in lines if x["action"] == "failover") == ["5101", "5102"]


@pytest.fixture
def decisions_topic(pubsub_host: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """Where ``--publish`` sends decisions: a fresh topic and the dispatcher's subscription."""
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    with topic_and_subscription(PROJECT, "decisions", "dispatcher", ack_deadline_s=60) as ts:
        yield ts.topic, ts.subscription


def _published(topic: str, subscription: str) -> list[Any]:
    """Every decision message on ``subscription`` (each acked as it comes), up to a sentinel
    published now: the ledger said they were all accepted before it (the emulator keeps the
    order of what it accepted). A redelivery (the same message id) is counted once."""
    from google.cloud import pubsub_v1

    pub, sub = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    pub.publish(topic, b"end", sentinel="1").result(timeout=DEADLINE_S)
    got: dict[str, Any] = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not any(m.attributes.get("sentinel") for m in got.values()):
            assert time.monotonic() < deadline, f"the sentinel never came ({len(got)} messages)"
            r = sub.pull(request={"subscription": subscription, "max_messages": 100}, timeout=10)
            if r.received_messages:
                ids = [m.ack_id for m in r.received_messages]
                sub.acknowledge(request={"subscription": subscription, "ack_ids": ids})
            got.update((m.message.message_id, m.message) for m in r.received_messages)
    finally:
        sub.close()
    return [m for m in got.values() if not m.attributes.get("sentinel")]


def _check_messages(msgs: list[Any], decisions: list[Any]) -> None:
    """Each decision's message exactly once (by the dedup key, ``request_id``): the view's JSON,
    its attributes the view's own."""
    by_request = Counter(m.attributes["request_id"] for m in msgs)
    assert by_request == Counter(d.request_id for d in decisions)  # once per announcement
    tokens = {d.request_id: d.token for d in decisions}
    for m in msgs:
        doc = json.loads(m.data)
        assert doc["v"] == 2 and doc["request_id"] == m.attributes["request_id"]
        assert str(doc["token"]) == m.attributes["token"] == str(tokens[doc["request_id"]])
        assert doc["verdict"] == m.attributes["verdict"] == "self_shutdown"


@pytest.mark.process
def test_publish_sends_each_decision_once_across_workers_and_a_worker_killed_before_it(
    topic: tuple[str, str],
    decisions_topic: tuple[str, str],
    pubsub_host: str,
    ledger_url: str,
    tmp_path: Path,
    monkeypatch: Any,
) -> None:
    """3 workers with ``--publish`` on one subscription (pulls of at most 20, deliveries lost on
    the way), on a 30-VM fleet: each token's first publish fails (a 503) and is retried with
    back-off; the very first publish of all kills its worker between its claim and its publish.
    Every wedged VM's decision reaches the decisions topic exactly once (by ``request_id``),
    published by the worker that marked its announcement done; the killed worker's decision is
    published by another once its lease lapsed. Nothing for a finished or healthy VM."""
    t, s = topic
    dt, ds = decisions_topic
    fleet = fleet_stream(random.Random(226), 30, PROJECT)
    publish(t, fleet.messages)
    with open_ledger(ledger_url) as led:
        for iid in fleet.names:
            led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
    faults = tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv("KILL_FIRST", "1")
    extra = ("--publish", dt, "--publish-faults", str(faults), "--announce-lease", "8")
    decisions, logs, killed = _three_workers_until_decided(
        pubsub_host, s, ledger_url, fleet, tmp_path, extra
    )
    assert sorted(d.instance_id for d in decisions) == sorted(fleet.wedged)
    assert all(d.announced_at is not None for d in decisions)
    _check_messages(_published(dt, ds), decisions)
    tokens = {str(d.token): d for d in decisions}
    calls = _pairs(faults / "calls")
    per_token = Counter(tk for tk, _ in calls)
    assert set(per_token) == set(tokens) and min(per_token.values()) >= 2  # failed, retried
    last = dict(calls)  # each token's last call is the one that went through
    for token, who in last.items():  # by the worker whose announcement it was
        assert tokens[token].announced_by == who
    first_token, first_worker = calls[0]
    assert first_worker == killed[0]
    assert tokens[first_token].announced_by != killed[0]  # taken over after the lease
    err = "".join(f.read_text() for f in logs.values())
    assert f"--publish {dt} for token" in err and "ServiceUnavailable" in err
    assert "(attempt 1/3)" in err  # retried in the same delivery, after the back-off


@pytest.mark.process
def test_poll_pubsub_publishes_each_decision_to_the_topic(
    topic: tuple[str, str],
    decisions_topic: tuple[str, str],
    pubsub_host: str,
    tmp_path: Path,
    compute: Any,
) -> None:
    """``gce-watchdog poll --pubsub S --publish T`` (no longer a usage error): two wedged VMs
    and a finished one on the stream; one message per decision on T, each announcement marked
    done, nothing for the finished VM."""
    t, s = topic
    dt, ds = decisions_topic
    ledger = tmp_path / "l.sqlite"
    ids, boots = ("5201", "5202", "5203"), ("abab0011", "abab0012", "abab0013")
    _two_wedged_one_finished(t, ledger, compute, ids, boots)
    argv, env = _cli_worker(s, ledger, tmp_path, compute, pubsub_host, "--publish", dt)
    with running(argv, env) as worker:
        with open_ledger(ledger) as led:
            wait_alive(
                worker,
                lambda: (
                    len(led.decisions.all()) == 2
                    and all(d.announced_at is not None for d in led.decisions.all())
                ),
                DEADLINE_S,
                "the decisions were never announced",
            )
            decisions = led.decisions.all()
        out, err = terminate(worker)
    assert worker.returncode == 0, err.decode()
    assert sorted(d.instance_id for d in decisions) == ["5201", "5202"]
    _check_messages(_published(dt, ds), decisions)
    lines = [json.loads(x) for x in out.decode().splitlines()]
    assert sorted(x["instance_id"] for x in lines if x["action"] == "failover") == ["5201", "5202"]


def _errs(procs: dict[str, subprocess.Popen[bytes]]) -> str:
    return "; ".join(f"{n} exited {p.returncode}" for n, p in procs.items() if p.poll() is not None)


def led_count(led: Any) -> int:
    return len(led.decisions.all())


@pytest.fixture
def compute() -> Iterator[Any]:
    """The fake Compute API the workers below look instance ids up in (token "unused")."""
    from gce_watchdog.testing.simcompute import FakeComputeAPI

    with FakeComputeAPI(token="unused") as api:
        yield api


@pytest.mark.process
def test_a_worker_killed_between_claim_and_ack_is_finished_by_the_next(
    topic: tuple[str, str], pubsub_host: str, pg_database: str, tmp_path: Path, compute: Any
) -> None:
    """Worker 1 claims (PostgreSQL), then blocks writing its announcement (its stdout is full)
    and is killed: nothing announced, nothing acked. Worker 2 gets the redelivered lines, finds
    the decision, and announces it once when worker 1's lease lapses."""
    t, s = topic
    w = Writer(boot="cccc0003")
    texts = lines_of(
        w, ("phase", {"ph": "workload"}), ("shutdown", {"reason": "ladder", "rung": "10/10"})
    )
    publish(t, [log_entry("4242", "vm-k", x) for x in reversed(texts)])
    compute.add_instance("vm-k", project=PROJECT, instance_id="4242")
    with open_ledger(pg_database) as led:
        led.pins.place_pin("4242", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PUBSUB_EMULATOR_HOST": pubsub_host}
    argv = [sys.executable, "-m", "gce_watchdog", "poll", "--pubsub", s, "--ledger", pg_database,
            "--json", "--settle", "1s", "--access-token-file", str(tmp_path / "tok"),
            "--api-base", compute.base_url]  # fmt: skip
    (tmp_path / "tok").write_text("unused\n")
    r, wfd = blocked_pipe()
    # its lease outlives the redelivery (ack deadline 10 s): worker 2 first sees the lines of a
    # decision it must not announce yet, acks them, then announces when the lease lapses
    first = subprocess.Popen([*argv, "--announce-lease", "20s"], stdout=wfd,
                             stderr=subprocess.PIPE, env=env)  # fmt: skip
    os.close(wfd)
    try:
        deadline = time.monotonic() + DEADLINE_S
        with open_ledger(pg_database) as led:
            while not led.decisions.pending_announcements():
                assert first.poll() is None, first.communicate()
                assert time.monotonic() < deadline, "worker 1 never claimed"
                time.sleep(0.1)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        os.close(r)
    second = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + DEADLINE_S
        with open_ledger(pg_database) as led:
            while (
                led.decisions.pending_announcements()
            ):  # redelivery (ack deadline 10 s), then the sweep
                assert second.poll() is None, second.communicate()
                assert time.monotonic() < deadline, "worker 2 never announced"
                time.sleep(0.2)
            (d,) = led.decisions.all()
        second.send_signal(signal.SIGTERM)
        out, err = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            second.kill()
            second.communicate()
    assert second.returncode == 0, err.decode()
    lines = [json.loads(x) for x in out.decode().splitlines()]
    assert [x["action"] for x in lines] == ["failover"]
    assert lines[0]["decision"]["token"] == d.token and d.announced_by != d.owner
    acked = re.search(rb"(\d+) acked", err)
    assert acked is not None and int(acked.group(1)) >= 2  # the redelivered lines, after the claim


@pytest.mark.process
def test_the_compute_sweep_catches_a_vm_stopped_without_a_word(
    topic: tuple[str, str], pubsub_host: str, tmp_path: Path
) -> None:
    """A worker with --label also sweeps the Compute API: a VM that stopped without writing a
    line (nothing on the stream) is decided by the sweep; a healthy VM heard on the stream is
    not decided about. (Issue 24: the stop is a preemption GCE recorded; a stop without any
    evidence is the ended_unread alarm, never a failover, so it would not be decided.)"""
    from gce_watchdog.testing.simcompute import FakeComputeAPI

    t, s = topic
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-stopped", project=PROJECT, labels={"gce-watchdog": "on"}, spot=True)
        heard = api.add_instance("vm-heard", project=PROJECT, labels={"gce-watchdog": "on"})
        api.preempt("vm-stopped")
        w = Writer(boot="dddd0004")
        w.ts_ms = int(time.time() * 1000)
        text = w.line("phase", {"ph": "workload"})
        api.append_serial("vm-heard", text)
        publish(t, [log_entry(heard.id, "vm-heard", text.decode().rstrip())])
        (tmp_path / "tok").write_text("tok\n")
        state, hook = _hook(tmp_path)  # the sweep's failover is delivered too
        env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PUBSUB_EMULATOR_HOST": pubsub_host}
        env.pop("KILL_FIRST", None)
        argv = [sys.executable, "-m", "gce_watchdog", "poll", "--pubsub", s, "--json",
                "--on-failover", hook,
                "--label", "gce-watchdog=on", "--project", PROJECT, "--sweep-interval", "1s",
                "--api-base", api.base_url, "--access-token-file", str(tmp_path / "tok"),
                "--ledger", str(tmp_path / "l.sqlite"),
                "--cursor-dir", str(tmp_path / "c")]  # fmt: skip
        with running(argv, env) as worker:
            wait_alive(
                worker,
                lambda: (tmp_path / "l.sqlite").exists() and _decided(tmp_path / "l.sqlite"),
                DEADLINE_S,
                "the sweep never decided",
            )
            out, err = terminate(worker)
    assert worker.returncode == 0, err.decode()
    lines = [json.loads(x) for x in out.decode().splitlines()]
    failovers = [x for x in lines if x["action"] == "failover"]
    assert [(x["instance"], x["verdict"]) for x in failovers] == [("vm-stopped", "preempted")], err
    with open_ledger(tmp_path / "l.sqlite") as led:
        (d,) = led.decisions.all()
        assert d.instance == f"{PROJECT}/us-central1-a/vm-stopped"
    assert b"sweep:" in err
    assert [t for t, _ in _pairs(state / "succeeded")] == [str(d.token)]  # failed once, then ran


def _decided(path: Path) -> bool:
    """A decision claimed and announced (its line printed): claiming alone comes first, and a
    SIGTERM between the two leaves the announcement to the next poller (docs/poller.md)."""
    with open_ledger(path) as led:
        return any(d.announced_at is not None for d in led.decisions.all())


@pytest.mark.process
def test_no_pin_no_decision_and_a_relabelled_line_decides_nothing(
    topic: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 25, the Pub/Sub path, with the attacker reading everything the API shows: an
    instance with no pin in the ledger is never decided from its stream (a forged key and a
    forged shutdown, self-consistent, change nothing: an alarm), and a real `shutdown` of one VM
    relabelled with another VM's instance id (a replayed LogEntry) decides nothing for it."""
    import secrets

    from gce_watchdog.wire import protocol
    from google.cloud import pubsub_v1

    t, s = topic
    evil = protocol.LineKey(secrets.token_bytes(32))
    fake = Writer(boot="eeee0005", key=evil, inst="7000000001")
    forged = lines_of(fake, ("phase", {"ph": "workload"}), ("shutdown", {"reason": "ladder"}))
    real = Writer(boot="ffff0006", inst="7000000002")
    texts = lines_of(real, ("phase", {"ph": "workload"}), ("shutdown", {"reason": "ladder"}))
    msgs = [log_entry("7000000001", "vm-unpinned", x) for x in forged]
    msgs += [log_entry("7000000003", "vm-other", x) for x in texts]  # relabelled: not its key
    publish(t, msgs)
    sub = pubsub_v1.SubscriberClient()
    outs: list[PollOutcome] = []
    with open_ledger(tmp_path / "ledger.sqlite", owner="w1") as led:
        other = protocol.LineKey(secrets.token_bytes(32))  # vm-other's own (real) key
        led.pins.place_pin("7000000003", other.public, other.fingerprint)
        w = PubSubWorker(sub, s, led, outs.append, settle_s=0.5, identity=TableIdentities({}))
        deadline = time.monotonic() + DEADLINE_S
        while w.stats.messages < len(msgs) or w.stats.forged < len(texts):
            assert time.monotonic() < deadline, f"saw {w.stats.messages} of {len(msgs)}"
            w.step(timeout=1.0)
        for _ in range(3):
            w.step(timeout=0.5)
        assert led.decisions.all() == [] and outs == []
    assert w.unpinned == {"7000000001"} and w.stats.unpinned == 1
    assert w.stats.forged >= len(texts)  # the relabelled lines: not under vm-other's pin
    sub.close()
