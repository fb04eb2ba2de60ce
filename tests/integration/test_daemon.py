"""The daemon end to end with a fake clock and fake edges, and as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.daemon.ladder import LadderState, WouldShutdown
from gce_watchdog.daemon.service import MIN_BUDGET_SHARE, Agent, Deps, LadderStore, probe_budget
from gce_watchdog.daemon.tick import TickReport, TickResult
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol
from gce_watchdog.wire.protocol import Event
from hypothesis import given
from hypothesis import strategies as st
from kit.agent import agent_config, agent_process, run_agent, stop_agent
from kit.events import read_events, sink_events
from kit.fakes import FakeClock, FakeNotifier, ScriptedProber, result
from kit.wait import wait_for


def make(
    tmp_path: Path,
    script: list,
    boot: str = "b1",
    clock: FakeClock | None = None,
    latency: float = 0.0,
    notifier: FakeNotifier | None = None,
    **agent_kw: object,
):
    clock = clock or FakeClock()
    sink = MemorySink()
    shutdowns: list[tuple[str, int, int]] = []  # decisions (a resumed chain is not one)
    resumed: list[str] = []

    def on_shutdown(*a: object, resume_at: str | None = None, **k: object) -> None:
        if resume_at is None:
            shutdowns.append(a)  # type: ignore[arg-type]
        else:
            resumed.append(resume_at)

    cfg = cfgmod.replace(
        cfgmod.Config(),
        agent={"interval": 30.0, "probe_timeout": 5.0, "heartbeat_every": 3, **agent_kw},
    )
    deps = Deps(
        emitter=Emitter(
            sink, SeqAllocator(tmp_path, "0000abcd"), "0000abcd", clock.wall, key=SYNTH_KEY
        ),
        prober=ScriptedProber(script, clock, latency),
        clock=clock,
        notifier=notifier or FakeNotifier(),
        store=LadderStore(tmp_path / "ladder.json", boot),
        on_shutdown=on_shutdown,
    )
    return Agent.from_config(cfg, deps), sink, shutdowns, clock


def events(sink: MemorySink) -> list[Event]:
    return sink_events(sink)


@pytest.mark.pure
def test_outage_climbs_to_shutdown_exactly_once(tmp_path: Path) -> None:
    script = [result("ok", "ok")] * 3 + [result("fail", "fail")] * 15
    agent, sink, shutdowns, _ = make(tmp_path, script)
    agent.run(threading.Event(), max_ticks=18)
    assert shutdowns == [("ladder", 10, 10)]
    evs = events(sink)
    texts = [e.text for e in evs if e.event == "tick"]
    assert texts[:10] == [f"BOTH reachability probes FAILED ({i}/10)" for i in range(1, 11)]
    assert evs[0].event == "start" and evs[-1].event == "stop"
    assert evs[0].get("bootid") == "b1" and evs[0].get("cfg") and evs[0].get("v")
    # contiguous around the key announcements (seq 0, 1 and every multiple of 32)
    free = [n for n in range(2 * len(evs) + 2) if not protocol.needs_announcement(n)]
    assert [e.seq for e in evs] == free[: len(evs)]


@pytest.mark.pure
def test_nine_tick_outage_recovers_without_shutdown(tmp_path: Path) -> None:
    script = [result("fail", "fail")] * 9 + [result("fail", "ok")] + [result("ok", "ok")] * 5
    agent, sink, shutdowns, _ = make(tmp_path, script)
    agent.run(threading.Event(), max_ticks=15)
    assert shutdowns == []
    rec = [e for e in events(sink) if e.event == "recovered"]
    assert len(rec) == 1 and rec[0].get("from") == "9"


@pytest.mark.pure
def test_heartbeat_every_k_healthy_ticks_and_no_tick_noise(tmp_path: Path) -> None:
    agent, sink, _, _ = make(tmp_path, [result("ok", "ok")])
    agent.run(threading.Event(), max_ticks=9)
    names = [e.event for e in events(sink)]
    assert names == ["start", "heartbeat", "heartbeat", "heartbeat", "stop"]


@pytest.mark.pure
def test_schedule_is_a_fixed_grid_and_a_slow_tick_is_followed_at_once(tmp_path: Path) -> None:
    notifier = FakeNotifier()
    agent, _, _, clock = make(tmp_path, [result("ok", "ok")], latency=2.0, notifier=notifier)
    t0 = clock.monotonic()
    agent.run(threading.Event(), max_ticks=4)
    # each tick took 2 s; ticks start at t0, t0+30, t0+60, t0+90 (no drift)
    assert clock.monotonic() - t0 == pytest.approx(92.0)
    assert notifier.messages[0][0] == "READY=1"
    assert sum(1 for m in notifier.messages if m[0] == "WATCHDOG=1") == 4
    slow, _, _, _ = make(tmp_path / "s", [result("ok", "ok")], latency=45.0)
    (tmp_path / "s").mkdir(exist_ok=True)
    t1 = slow.d.clock.monotonic()
    slow.run(threading.Event(), max_ticks=3)
    # each 45 s tick overran its 30 s slot: the next one started at once (no slot skipped)
    assert slow.overruns == 2
    assert slow.d.clock.monotonic() - t1 == pytest.approx(135.0)


class _BlackHoleAfterOne:
    """The first tick passes at once; then the fault: every probe waits out its whole budget,
    and every tick spends ``overhead`` more of its own (a loaded machine's emit and fsync)."""

    def __init__(self, clock: FakeClock, overhead: float) -> None:
        self.clock, self.overhead = clock, overhead
        self.calls = 0
        self.budgets: list[float] = []
        self.fault_at = 0.0
        self.fail_ends: list[float] = []

    def __call__(self, budget: float) -> TickResult:
        self.calls += 1
        self.budgets.append(budget)
        if self.calls == 1:
            self.fault_at = self.clock.monotonic() + 0.001  # just after this tick started
            self.clock.advance(0.01 + self.overhead)
            return result("ok", "ok")
        self.clock.advance(budget + self.overhead)
        self.fail_ends.append(self.clock.monotonic())
        return result("fail", "fail")


@pytest.mark.pure
@pytest.mark.parametrize("ratio", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("overhead", [0.0, 0.005, 0.02])
def test_late_ticks_do_not_push_the_decision_out_of_its_window(
    tmp_path: Path, ratio: float, overhead: float
) -> None:
    """Issue 38: at timeout/interval 0.99 every failing tick overran its slot by its own few ms,
    the grid restarted after each, and the 10th failing tick landed 10 overheads late: past
    threshold x interval + timeout under load. Now a late tick's probes end by its slot's start +
    the timeout, so only the deciding tick's own overhead is left past the policy's bound."""
    agent, _, shutdowns, clock = make(
        tmp_path, [result("ok", "ok")], interval=1.0, probe_timeout=ratio, threshold=10
    )
    hole = _BlackHoleAfterOne(clock, overhead)
    agent.d.prober = hole
    agent.run(threading.Event(), max_ticks=11)
    assert shutdowns == [("ladder", 10, 10)]
    decided = hole.fail_ends[9] - hole.fault_at
    assert decided <= 10 * 1.0 + ratio + overhead + 1e-9, (decided, hole.budgets)
    assert min(hole.budgets) >= ratio / 2  # a late tick keeps half its timeout at least


@pytest.mark.pure
@given(
    slot=st.floats(0, 1e6),
    late=st.floats(-10, 100),
    timeout=st.floats(0.001, 3600),
)
def test_probe_budget_ends_by_the_slot_and_keeps_half(
    slot: float, late: float, timeout: float
) -> None:
    start = slot + late
    b = probe_budget(slot, start, timeout)
    assert timeout * MIN_BUDGET_SHARE - 1e-9 <= b <= timeout
    if late <= 0:
        assert b == timeout  # on time: the whole timeout
    elif late <= timeout * (1 - MIN_BUDGET_SHARE):
        assert start + b == pytest.approx(slot + timeout, abs=1e-6)  # ends by slot + timeout


@pytest.mark.pure
def test_watchdog_pinged_between_long_ticks(tmp_path: Path) -> None:
    notifier = FakeNotifier(watchdog_interval=20.0)  # WatchdogSec=20s < interval 30 s
    agent, _, _, _ = make(tmp_path, [result("ok", "ok")], notifier=notifier)
    agent.run(threading.Event(), max_ticks=3)
    pings = sum(1 for m in notifier.messages if m[0] == "WATCHDOG=1")
    assert pings >= 3 + 2 * 2  # one per tick plus at least two in each 30 s wait


@pytest.mark.pure
def test_restart_continues_the_ladder_within_a_boot(tmp_path: Path) -> None:
    fail = [result("fail", "fail")]
    a1, _, s1, _ = make(tmp_path, fail)
    a1.run(threading.Event(), max_ticks=5)
    assert s1 == [] and a1.state.rung == 5
    a2, sink2, s2, _ = make(tmp_path, fail)  # same boot: continues at 5
    a2.run(threading.Event(), max_ticks=6)
    assert s2 == [("ladder", 10, 10)]
    assert events(sink2)[0].get("rung") == "5/10"
    a3, _, s3, _ = make(tmp_path, fail, boot="b2")  # new boot: starts at 0
    a3.run(threading.Event(), max_ticks=5)
    assert s3 == [] and a3.state.rung == 5


@pytest.mark.pure
def test_corrupt_state_file_starts_at_zero(tmp_path: Path) -> None:
    (tmp_path / "ladder.json").write_text("{not json")
    assert LadderStore(tmp_path / "ladder.json", "b1").load(10).rung == 0
    # JSON that parses but whose rung int() refuses (Infinity, NaN): also 0, never an exception
    for rung in ("Infinity", "NaN", '"3.5"'):
        (tmp_path / "ladder.json").write_text(f'{{"boot_id": "b1", "rung": {rung}}}')
        assert LadderStore(tmp_path / "ladder.json", "b1").load(10).rung == 0


@pytest.mark.pure
def test_boot_grace_reports_but_does_not_climb(tmp_path: Path) -> None:
    agent, sink, shutdowns, _ = make(tmp_path, [result("fail", "fail")], boot_grace=300.0)
    agent.d.uptime = lambda: 10.0
    agent.run(threading.Event(), max_ticks=12)
    assert shutdowns == [] and agent.state.rung == 0
    assert any("boot grace" in e.text for e in events(sink))


# -- a real process ----------------------------------------------------------------------------


@pytest.mark.process
def test_real_process_sigterm_lock_and_outage(tmp_path: Path) -> None:
    with SimGCE() as sim:
        cfg = agent_config(tmp_path, sim)
        serial = tmp_path / "ttyS0"
        with agent_process(cfg, stderr=subprocess.PIPE) as p:
            assert wait_for(lambda: any(e.event == "heartbeat" for e in read_events(serial)))
            second = run_agent(cfg, timeout=30)
            assert second.returncode == 75 and "refusing to run a second ladder" in second.stderr
            sim.outage(True)
            assert wait_for(lambda: any(e.event == "dry_run_shutdown" for e in read_events(serial)))
            sim.outage(False)
            assert stop_agent(p) == 0
    evs = read_events(serial)
    names = [e.event for e in evs]
    # a dry run's decision: its own event, once per outage (the repeats carry rep=)
    assert names.count("dry_run_shutdown") == 1 and names[-1] == "stop"
    assert evs[-1].get("reason") == "sigterm"
    climbs = [e.get("rung") for e in evs if e.event == "tick" and "FAILED (" in e.text]
    assert climbs[:3] == ["1/3", "2/3", "3/3"]
    free = [n for n in range(2 * len(evs) + 2) if not protocol.needs_announcement(n)]
    assert [e.seq for e in evs] == free[: len(evs)]  # around the key announcements
    hb = next(e for e in evs if e.event == "heartbeat")
    assert hb.get("ph") == "unknown" and hb.get("rung") == "0/3"
    assert os.path.exists(tmp_path / "state" / "ladder.json")


@pytest.mark.pure
def test_long_phase_and_exception_names_never_crash_the_tick(tmp_path: Path) -> None:
    # The phase comes from a file anyone with root may write; a probe's reason can carry an
    # exception class name. Together they can exceed the 280-byte line: the tick must still
    # be written (values shortened), never raise out of the loop.
    (tmp_path / "phase").write_text("p" * 80 + "\n")
    reason = "internal_" + "VeryLongExceptionName" * 3
    agent, sink, _, _ = make(tmp_path, [result("unknown", "unknown", reason)] * 3)
    agent.d.phase = lambda: (tmp_path / "phase").read_text().strip()
    agent.run(threading.Event(), max_ticks=3)
    evs = events(sink)
    assert [e.event for e in evs] == ["start", "tick", "tick", "tick", "stop"]
    assert all(len(x) <= protocol.MAX_LINE for x in sink.lines)
    assert evs[1].get("rung") == "0/10"


@pytest.mark.pure
def test_a_failed_state_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "ladder.json").mkdir()  # os.replace onto a directory fails
    assert LadderStore(tmp_path / "ladder.json", "b1").save(LadderState(rung=3)) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ladder.json"]


@pytest.mark.process
def test_no_console_at_all_still_watches(tmp_path: Path) -> None:
    """Neither the serial device nor the fallback can be opened: the agent keeps ticking (and
    deciding) with its lines in the journal only, instead of crash-looping."""
    with SimGCE() as sim:
        gone = "/proc/no-such-dir"
        cfg = agent_config(
            tmp_path, sim, serial={"device": f"{gone}/ttyS0", "fallback_file": f"{gone}/serial.log"}
        )
        r = run_agent(cfg, "--max-ticks", "3", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "serial_unavailable" in r.stderr
    assert "event='heartbeat'" in r.stderr and "event='stop'" in r.stderr


@pytest.mark.pure
def test_a_dry_run_decision_latches_nothing_and_recovery_is_reported(tmp_path: Path) -> None:
    """Issue 15: a dry run used to latch at 10/10 for the rest of the boot."""
    fail, ok = result("fail", "fail"), result("ok", "ok")
    script = [fail] * 12 + [ok] * 3 + [fail] * 12
    agent, sink, shutdowns, _ = make(tmp_path, script, action="dry-run")
    agent.run(threading.Event(), max_ticks=len(script))
    assert shutdowns == [("ladder", 10, 10), ("ladder", 10, 10)]  # rehearsed once per outage
    assert not agent.state.fired
    evs = events(sink)
    names = [e.event for e in evs]
    assert "recovered" in names and names.count("would_shutdown") == 0
    rec = next(e for e in evs if e.event == "recovered")
    assert rec.get("from") == "10"
    stored = json.loads((tmp_path / "ladder.json").read_text())
    assert stored.get("fired") is not True


@pytest.mark.pure
def test_a_rehearsed_linger_runs_beside_the_ticks(tmp_path: Path) -> None:
    """Issue 38: a dry-run decision's linger used to stop the ladder for its whole length (the
    agent ticked again only after it). The fake chain lingers until the agent has ticked five
    more times: a chain run on the loop's thread never sees them (its bounded wait runs out)."""
    agent, sink, _, _ = make(tmp_path, [result("fail", "fail")] * 20, action="dry-run")
    decided: list[int] = []
    steps_seen: list[str | None] = []  # the rehearsal's step at each tick after the decision
    five_more = threading.Event()
    released_at: list[int] = []

    def lingering_chain(*_a: object, progress: Any = None, **_k: object) -> None:
        progress("linger")
        five_more.wait(10)  # bounded: the failure mode this test catches
        released_at.append(agent.ticks)

    def count(report: TickReport) -> None:
        if any(isinstance(a, WouldShutdown) for a in report.actions):
            decided.append(report.n)
        elif decided:
            steps_seen.append(agent.rehearsing)
            if report.n >= decided[0] + 5:
                five_more.set()

    agent.d.on_shutdown = lingering_chain
    agent.d.tick_hooks.append(count)
    agent.run(threading.Event(), max_ticks=20)
    assert decided == [10]
    assert released_at and released_at[0] >= 15, released_at  # ticks went on while it lingered
    assert steps_seen[:5] and None not in steps_seen[:5], steps_seen
    assert agent.rehearsing is None  # the loop's end waited for it
    evs = events(sink)
    assert sum(1 for e in evs if e.event == "tick") == 20 and evs[-1].event == "stop"


@pytest.mark.pure
def test_a_rehearsal_writes_its_decision_line_before_the_loop_goes_on(tmp_path: Path) -> None:
    """Issue 38 item 7: the rehearsal's decision line (``dry_run_shutdown``) came 30-40 ms after
    the deciding tick on a loaded machine, its thread competing with the loop's: the loop now
    waits (bounded) until the line is written. The fake chain takes 50 ms before its line (a
    loaded machine's scheduling), then lingers until released."""
    agent, _, _, _ = make(tmp_path, [result("fail", "fail")] * 12, action="dry-run")
    order: list[str] = []
    release = threading.Event()

    def slow_chain(*_a: object, progress: Any = None, **_k: object) -> None:
        progress("shutdown")
        threading.Event().wait(0.05)
        order.append("decision line")
        progress("linger")
        release.wait(10)  # bounded

    def hook(report: TickReport) -> None:
        if any(isinstance(a, WouldShutdown) for a in report.actions):
            order.append("decision tick's report")
            release.set()

    agent.d.on_shutdown = slow_chain
    agent.d.tick_hooks.append(hook)
    agent.run(threading.Event(), max_ticks=12)
    assert order == ["decision line", "decision tick's report"]
    assert agent.rehearsing is None


# -- a stop asked for during the linger (issue 39) -----------------------------------------------


def _in_linger(serial: Path) -> bool:
    return any(
        e.event == "action" and (e.get("step"), e.get("status")) == ("linger", "start")
        for e in read_events(serial)
    )


def _sigterm_within(p: subprocess.Popen[str], limit: float) -> tuple[int, float]:
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(limit + 15)  # bounded; the limit itself is asserted by the caller
    return rc, time.monotonic() - t0


@pytest.mark.process
def test_sigterm_during_a_rehearsed_linger_stops_a_dry_run_within_5s(tmp_path: Path) -> None:
    with SimGCE() as sim:
        cfg = agent_config(tmp_path, sim, actions={"linger": 120, "repeat_every": 0.2})
        serial = tmp_path / "ttyS0"
        with agent_process(cfg, stderr=subprocess.PIPE) as p:
            assert wait_for(lambda: any(e.event == "heartbeat" for e in read_events(serial)))
            sim.outage(True)
            assert wait_for(lambda: _in_linger(serial), 30)
            rc, took = _sigterm_within(p, 5.0)
            assert p.stderr is not None
            err = p.stderr.read()
    assert rc == 0 and took < 5.0, f"rc {rc} after {took:.1f}s"
    evs = read_events(serial)
    names = [e.event for e in evs]
    sig = [e for e in evs if e.event == "signal"]
    assert len(sig) == 1 and (sig[0].get("sig"), sig[0].get("step")) == ("SIGTERM", "linger")
    assert sig[0].text == "SIGTERM during the dry-run linger: the agent stops"
    assert names[-1] == "stop" and evs[-1].get("reason") == "sigterm"
    assert names.index("signal") < names.index("stop")
    steps = [(e.get("step"), e.get("status")) for e in evs if e.event == "action"]
    assert steps == [("linger", "start")], "nothing rehearsed after the linger"
    # the decision once, on the console and in the journal, as a warning
    assert names.count("dry_run_shutdown") == 1
    journal = [ln for ln in err.splitlines() if "event='dry_run_shutdown'" in ln]
    assert len(journal) == 1 and "level='warning'" in journal[0], err[-2000:]


@pytest.mark.process
def test_sigterm_during_a_real_linger_stops_within_5s_and_a_restart_resumes_it(
    tmp_path: Path,
) -> None:
    record = tmp_path / "argv.log"
    rec = tmp_path / "record.sh"
    rec.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\n')
    rec.chmod(0o755)
    with SimGCE() as sim:
        cfg = agent_config(
            tmp_path,
            sim,
            agent={"action": "poweroff", "allow_non_gce": True},
            actions={
                "linger": 120,
                "repeat_every": 0.5,
                "poweroff_cmd": [str(rec), "poweroff"],
                "force_cmd": [str(rec), "force"],
                "kernel": [],  # never reboot(2) the test machine
            },
        )
        serial = tmp_path / "ttyS0"
        with agent_process(cfg) as p:
            sim.outage(True)
            assert wait_for(lambda: _in_linger(serial), 30)
            rc, took = _sigterm_within(p, 5.0)
        assert rc == 0 and took < 5.0, f"rc {rc} after {took:.1f}s"
        evs = read_events(serial)
        sig = next(e for e in evs if e.event == "signal")
        assert (sig.get("sig"), sig.get("step")) == ("SIGTERM", "linger")
        assert sig.text == "SIGTERM during the linger: the agent stops; a restart resumes the chain"
        assert evs[-1].event == "stop" and not record.exists(), "nothing powered off"
        stored = json.loads((tmp_path / "state" / "ladder.json").read_text())
        assert stored["fired"] is True and stored["chain"]["step"] == "linger"
        # a restart resumes the linger (what is left of it), and stops when asked again
        n = len(evs)
        with agent_process(cfg) as p:
            assert wait_for(
                lambda: any(e.get("resume") == "linger" for e in read_events(serial)[n:]), 30
            )
            rc, took = _sigterm_within(p, 5.0)
    assert rc == 0 and took < 5.0, f"rc {rc} after {took:.1f}s"
    assert not record.exists()
    assert read_events(serial)[-1].event == "stop"
