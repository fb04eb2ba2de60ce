"""The Pub/Sub path (issue 19 item 4): LogEntry decoding and the assembler (pure, with
properties), then workers against the real Pub/Sub emulator: duplicates, reordering,
redeliveries, and a worker killed between its claim and its ack."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.poller.assemble import Assembler
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.poller import PollOutcome
from gce_watchdog.poller.pubsub import PubSubWorker, parse_log_entry
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind, decide
from gce_watchdog.testing.synth import SYNTH_KEY, Writer
from gce_watchdog.wire.protocol import Event, decode_line
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.logentries import PROJECT, fleet_messages, lines_of, log_entry
from kit.paths import REPO
from kit.pipes import blocked_pipe

DEADLINE_S = 90.0


# -- pure parts ----------------------------------------------------------------------------------


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


def _events(n: int) -> list[Event]:
    w = Writer(boot="aaaa0001", announce=False)
    evs = [w.line("heartbeat", {"ph": "workload"}) for _ in range(n)]
    return [e for e in (decode_line(b, pin=SYNTH_KEY.public) for b in evs) if isinstance(e, Event)]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.randoms(use_true_random=False), st.integers(0, 20))
def test_any_order_with_duplicates_gives_the_prefix_once_in_order(
    n: int, rnd: random.Random, dups: int
) -> None:
    evs = _events(n)
    arrivals = evs + [rnd.choice(evs) for _ in range(dups)]
    rnd.shuffle(arrivals)
    asm = Assembler(settle_s=5.0)
    for e in arrivals:
        asm.add("id", e, now=0.0)
    assert [e.seq for e in asm.events("id", "aaaa0001")] == list(range(n))
    assert asm.settle(now=1e9) == []  # nothing held: nothing to give up on


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 40), st.data())
def test_a_lost_line_holds_the_rest_until_the_settle_timeout(n: int, data: st.DataObject) -> None:
    evs = _events(n)
    k = data.draw(st.integers(0, n - 2))
    rest = [e for e in evs if e.seq != k]
    data.draw(st.randoms(use_true_random=False)).shuffle(rest)
    asm = Assembler(settle_s=2.0)
    for i, e in enumerate(rest):
        asm.add("id", e, now=float(i) / 1000)
    assert [e.seq for e in asm.events("id", "aaaa0001")] == list(range(k))  # up to the gap
    assert asm.next_deadline() is not None
    assert asm.settle(now=1.0) == []  # not yet
    assert asm.settle(now=3.0) == [("id", "aaaa0001")]
    s = asm.streams[("id", "aaaa0001")]
    assert [e.seq for e in s.prefix] == [e.seq for e in evs if e.seq != k] and s.lost == 1


def test_a_shutdown_ahead_of_its_exit_line_is_not_decided_until_the_exit_arrives() -> None:
    """The job finished (exit rc=0), then the network died and the agent shut down. If the
    shutdown line arrives first, the prefix stops before it: no failover for a finished job."""
    w = Writer(boot="bbbb0002", announce=False)
    raw = lines_of(w, ("phase", {"ph": "workload"}), ("exit", {"rc": "0"}),
                   ("shutdown", {"reason": "ladder", "rung": "10/10"}))  # fmt: skip
    phase, exit_, shutdown = (decode_line(x, pin=SYNTH_KEY.public) for x in raw)
    asm = Assembler(settle_s=2.0)
    for e in (phase, shutdown):
        assert isinstance(e, Event)
        asm.add("id", e, now=0.0)
    v = decide(asm.events("id", "bbbb0002"), InstanceState("RUNNING"), 0.0, Policy())
    assert v.kind is not VerdictKind.SELF_SHUTDOWN
    assert isinstance(exit_, Event)
    asm.add("id", exit_, now=0.5)
    v = decide(asm.events("id", "bbbb0002"), InstanceState("RUNNING"), 0.0, Policy())
    assert v.kind is VerdictKind.WORKLOAD_OK


# -- against the real emulator ------------------------------------------------------------------


@pytest.fixture
def topic(pubsub_host: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A fresh topic and subscription (ack deadline 10 s, the minimum) on the emulator."""
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    from google.cloud import pubsub_v1

    n = f"{os.getpid()}-{random.getrandbits(32):x}"
    pub, sub = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    t = pub.topic_path(PROJECT, f"serial-{n}")
    s = sub.subscription_path(PROJECT, f"watchdog-{n}")
    pub.create_topic(request={"name": t})
    sub.create_subscription(request={"name": s, "topic": t, "ack_deadline_seconds": 10})
    try:
        yield t, s
    finally:
        sub.delete_subscription(request={"subscription": s})
        pub.delete_topic(request={"topic": t})
        sub.close()


def publish(topic: str, datas: list[bytes]) -> None:
    from google.cloud import pubsub_v1

    pub = pubsub_v1.PublisherClient()
    futures = [pub.publish(topic, d) for d in datas]
    for f in futures:
        f.result(timeout=30)


def test_workers_decide_once_per_vm_from_a_shuffled_duplicated_stream(
    topic: tuple[str, str], tmp_path: Path
) -> None:
    from google.cloud import pubsub_v1

    t, s = topic
    rnd = random.Random(19)
    msgs, wedged, _finished = fleet_messages(rnd, 30)
    publish(t, msgs)
    sub = pubsub_v1.SubscriberClient()
    # redeliveries: the test takes some messages first and hands them back unacked (nack)
    first = sub.pull(request={"subscription": s, "max_messages": 50}, timeout=30)
    sub.modify_ack_deadline(
        request={
            "subscription": s,
            "ack_ids": [m.ack_id for m in first.received_messages],
            "ack_deadline_seconds": 0,
        }
    )
    outs: list[PollOutcome] = []
    with open_ledger(tmp_path / "ledger.sqlite", owner="w1") as led:
        for iid in wedged | _finished:  # pinned by the poll path (read from byte 0), or by hand
            led.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        # settle: long enough that a line handed back (nack) or held up by a loaded machine comes
        # back before its gap is declared lost (a boot with a lost line is left to the sweep)
        w1 = PubSubWorker(sub, s, led, outs.append, settle_s=5.0)
        deadline = time.monotonic() + DEADLINE_S
        while led_count(led) < len(wedged) or w1.asm.next_deadline() is not None:
            assert time.monotonic() < deadline, f"decided {led_count(led)} of {len(wedged)}"
            w1.step(timeout=1.0)
        decisions = led.all()
        assert led.pending_announcements() == []
    assert {d.instance_id for d in decisions} == wedged  # the finished job: never
    assert all(d.verdict == "self_shutdown" for d in decisions)
    announced = [o.instance_id for o in outs if o.action == "failover"]
    assert sorted(announced) == sorted(wedged)  # once each, despite duplicates
    assert w1.stats.latencies and max(w1.stats.latencies) < 60
    sub.close()


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
    sub = pubsub_v1.SubscriberClient()
    outs: list[PollOutcome] = []
    with open_ledger(tmp_path / "ledger.sqlite", owner="w1") as led:
        for iid in ("5000000000", "5000000001"):
            led.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w = PubSubWorker(sub, s, led, outs.append, settle_s=1.0)
        deadline = time.monotonic() + DEADLINE_S
        while not (led_count(led) >= 1 and w.gapped) or w.asm.next_deadline() is not None:
            assert time.monotonic() < deadline, f"decided {led_count(led)}, gapped {w.gapped}"
            w.step(timeout=1.0)
        assert [d.instance_id for d in led.all()] == ["5000000000"]
    assert w.gapped == {"5000000001"} and w.stats.gapped == 1
    assert [o.instance_id for o in outs if o.action == "failover"] == ["5000000000"]
    sub.close()


def led_count(led: Any) -> int:
    return len(led.all())


def test_a_worker_killed_between_claim_and_ack_is_finished_by_the_next(
    topic: tuple[str, str], pubsub_host: str, pg_database: str, tmp_path: Path
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
    with open_ledger(pg_database) as led:
        led.place_pin("4242", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PUBSUB_EMULATOR_HOST": pubsub_host}
    argv = [sys.executable, "-m", "gce_watchdog", "poll", "--pubsub", s, "--ledger", pg_database,
            "--json", "--settle", "1s", "--access-token-file", str(tmp_path / "tok")]  # fmt: skip
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
            while not led.pending_announcements():
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
            while led.pending_announcements():  # redelivery (ack deadline 10 s), then the sweep
                assert second.poll() is None, second.communicate()
                assert time.monotonic() < deadline, "worker 2 never announced"
                time.sleep(0.2)
            (d,) = led.all()
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
        env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PUBSUB_EMULATOR_HOST": pubsub_host}
        argv = [sys.executable, "-m", "gce_watchdog", "poll", "--pubsub", s, "--json",
                "--label", "gce-watchdog=on", "--project", PROJECT, "--sweep-interval", "1s",
                "--api-base", api.base_url, "--access-token-file", str(tmp_path / "tok"),
                "--ledger", str(tmp_path / "l.sqlite"),
                "--cursor-dir", str(tmp_path / "c")]  # fmt: skip
        worker = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not (tmp_path / "l.sqlite").exists() or not _decided(tmp_path / "l.sqlite"):
                assert worker.poll() is None, worker.communicate()
                assert time.monotonic() < deadline, "the sweep never decided"
                time.sleep(0.2)
            worker.send_signal(signal.SIGTERM)
            out, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    assert worker.returncode == 0, err.decode()
    lines = [json.loads(x) for x in out.decode().splitlines()]
    failovers = [x for x in lines if x["action"] == "failover"]
    assert [(x["instance"], x["verdict"]) for x in failovers] == [
        ("vm-stopped", "preempted")
    ]
    with open_ledger(tmp_path / "l.sqlite") as led:
        assert [d.instance for d in led.all()] == [f"{PROJECT}/us-central1-a/vm-stopped"]
    assert b"sweep:" in err


def _decided(path: Path) -> bool:
    """A decision claimed and announced (its line printed): claiming alone comes first, and a
    SIGTERM between the two leaves the announcement to the next poller (docs/poller.md)."""
    with open_ledger(path) as led:
        return any(d.announced_at is not None for d in led.all())


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
        led.place_pin("7000000003", other.public, other.fingerprint)
        w = PubSubWorker(sub, s, led, outs.append, settle_s=0.5)
        deadline = time.monotonic() + DEADLINE_S
        while w.stats.messages < len(msgs) or w.stats.forged < len(texts):
            assert time.monotonic() < deadline, f"saw {w.stats.messages} of {len(msgs)}"
            w.step(timeout=1.0)
        for _ in range(3):
            w.step(timeout=0.5)
        assert led.all() == [] and outs == []
    assert w.unpinned == {"7000000001"} and w.stats.unpinned == 1
    assert w.stats.forged >= len(texts)  # the relabelled lines: not under vm-other's pin
    sub.close()
