"""A decided shutdown always ends in power-off (issue 16, item 1).

- an exception in any step of the chain is written to the console and the chain goes on;
- the persisted state says "chain started, at step X" before each step, and an agent restarted in
  the middle of the chain resumes it there (and says so), never holds forever;
- no content of any state file crashes a tick;
- a SIGTERM while the chain acts (past its linger) writes a line that says the chain goes on (in
  process); one during the linger stops the agent there, and a restart resumes it (issue 39; a
  real signal to a real agent process here and in test_daemon.py).

Every edge is a hand-written fake injected through the constructors (no patching).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gce_watchdog.daemon.actions import ActionChain, ApiResult, RunResult
from gce_watchdog.daemon.disarm import DisarmGate
from gce_watchdog.daemon.metawatch import InstanceInfo
from gce_watchdog.daemon.service import CHAIN_RETRY_S, Agent, Deps, LadderStore, _instance_id
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator, read_phase
from gce_watchdog.wire import protocol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.agent import agent_config, agent_process, stop_agent
from kit.clocks import ChainClock
from kit.events import read_events, sink_events
from kit.fakes import FakeClock, FakeNotifier, ScriptedProber, result
from kit.wait import wait_for

INST = InstanceInfo("sim-project", "us-central1-a", "sim-vm-1", "4520031799277582145")
BOOT = "0000abcd"


class Crash(BaseException):
    """Stands in for the agent process dying in the middle of a step (not an Exception: the
    chain's own guards must not catch it)."""


class Boom(RuntimeError):
    """An ordinary bug in a step."""


@dataclass
class Runner:
    fail: dict[str, BaseException] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def __call__(self, argv: list[str], timeout: float) -> RunResult:
        name = "force" if argv[-1] == "--force" else "poweroff"
        self.calls.append(name)
        if name in self.fail:
            raise self.fail.pop(name)
        return RunResult(0)


@dataclass
class Api:
    calls: int = 0

    def act(self, op: str, inst: InstanceInfo, request_id: str) -> ApiResult:
        self.calls += 1
        return ApiResult(True, 200, "operation-1")


@dataclass
class Kernel:
    fail: dict[str, BaseException] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def poweroff(self, method: str) -> str:
        self.calls.append(method)
        if method in self.fail:
            raise self.fail.pop(method)
        return f"{method}: EPERM (fake)"


@dataclass
class FailingSink(MemorySink):
    """A sink whose first line of a given event raises."""

    fail_event: str = ""
    exc: BaseException | None = None

    def submit(self, line: str, sync: bool = False) -> Callable[[], bool]:
        if self.exc is not None and f" {self.fail_event} " in line:
            exc, self.exc = self.exc, None
            raise exc
        return super().submit(line, sync)


def make_cfg(tmp: Path, action: str = "delete", **actions: object) -> cfgmod.Config:
    base: dict[str, object] = {
        "linger": 10.0,
        "repeat_every": 5.0,
        "poweroff_wait": 20.0,
        "force_wait": 10.0,
    }
    base.update(actions)
    return cfgmod.from_dict(
        {
            "agent": {
                "action": action,
                "state_dir": str(tmp),
                "threshold": 2,
                "interval": 30.0,
                "probe_timeout": 5.0,
                "heartbeat_every": 1,
            },
            "actions": base,
        },
        "test",
    )


@dataclass
class Rig:
    cfg: cfgmod.Config
    clock: FakeClock
    sink: FailingSink
    runner: Runner
    api: Api
    kernel: Kernel
    chain_clock: ChainClock
    chain: ActionChain
    agent: Agent
    instance: list[BaseException]

    def events(self) -> list[protocol.Event]:
        return sink_events(self.sink)

    def actions(self) -> list[tuple[str | None, str | None]]:
        return [(e.get("step"), e.get("status")) for e in self.events() if e.event == "action"]


def make_rig(
    tmp: Path, action: str = "delete", script: list | None = None, **actions: object
) -> Rig:
    cfg = make_cfg(tmp, action, **actions)
    clock = FakeClock()
    sink = FailingSink()
    em = Emitter(sink, SeqAllocator(tmp, BOOT), BOOT, clock.wall, key=SYNTH_KEY)
    runner, api, kernel = Runner(), Api(), Kernel()
    cc = ChainClock(clock)
    inst_fail: list[BaseException] = []

    def instance() -> InstanceInfo:
        if inst_fail:
            raise inst_fail.pop()
        return INST

    chain = ActionChain.from_config(
        cfg,
        em,
        lambda: None,
        runner=runner,
        clock=cc,
        api=api,
        kernel=kernel,
        instance=instance,
        jitter=lambda: 0.5,
    )
    deps = Deps(
        emitter=em,
        prober=ScriptedProber(script or [result("fail", "fail")], clock),
        clock=clock,
        notifier=FakeNotifier(),
        store=LadderStore(tmp / "ladder.json", "b1"),
        on_shutdown=chain.execute,
    )
    return Rig(
        cfg, clock, sink, runner, api, kernel, cc, chain, Agent.from_config(cfg, deps), inst_fail
    )


def inject(r: Rig, step: str, exc: BaseException) -> None:
    """Make the fake behind ``step`` raise ``exc`` once."""
    if step == "shutdown":
        r.sink.fail_event, r.sink.exc = "shutdown", exc
    elif step == "linger":
        r.chain_clock.fail_sleep = exc
    elif step == "delete":
        r.instance.append(exc)
    elif step in ("poweroff", "force"):
        r.runner.fail[step] = exc
    elif step == "kernel":
        r.kernel.fail["reboot"] = exc
    else:
        raise AssertionError(step)


STEPS = ["shutdown", "linger", "delete", "poweroff", "force", "kernel"]


# -- an exception in any step ----------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("step", STEPS)
def test_an_exception_in_any_step_is_written_and_the_chain_goes_on(
    tmp_path: Path, step: str
) -> None:
    r = make_rig(tmp_path)
    inject(r, step, Boom(f"bug in {step}"))
    r.chain.execute("ladder", 2, 2)
    errors = [e for e in r.events() if e.get("status") == "error"]
    assert [(e.get("step"), e.get("err")) for e in errors] == [(step, "Boom")]
    assert f"bug in {step}" in errors[0].text and "going on" in errors[0].text
    # Whatever failed, every later power-off step was still taken.
    assert r.runner.calls == ["poweroff", "force"] or step in ("poweroff", "force")
    assert "force" in r.runner.calls
    assert r.kernel.calls == ["reboot", "sysrq"]  # a raising reboot still lets sysrq try
    assert r.actions()[-1] == ("kernel", "fail")


@pytest.mark.pure
def test_infinite_linger_does_not_stop_the_power_off(tmp_path: Path) -> None:
    """The reported crash: actions.linger = inf raised OverflowError before the power-off. (The
    config now refuses inf; the chain must survive such a value anyway.)"""
    r = make_rig(tmp_path, linger=10.0)
    object.__setattr__(r.cfg.actions, "linger", float("inf"))
    r.chain.execute("ladder", 2, 2)
    assert ("linger", "error") in r.actions()
    assert r.runner.calls == ["poweroff", "force"]


# -- persisted progress and restarts -----------------------------------------------------------


@pytest.mark.pure
def test_the_state_says_chain_started_at_step_x_before_each_step(tmp_path: Path) -> None:
    r = make_rig(tmp_path)
    seen: list[tuple[bool, str]] = []
    inner = r.runner.__call__

    def spy(argv: list[str], timeout: float) -> RunResult:
        raw = json.loads((tmp_path / "ladder.json").read_text())
        seen.append((raw["fired"], raw["chain"]["step"]))
        return inner(argv, timeout)

    r.chain.runner = spy
    r.agent.run(threading.Event(), max_ticks=2)
    assert seen == [(True, "poweroff"), (True, "force")]
    raw = json.loads((tmp_path / "ladder.json").read_text())
    assert raw["chain"]["step"] == "end"  # ran through, the VM (this test) still up


@pytest.mark.pure
@pytest.mark.parametrize("step", STEPS)
def test_a_restart_in_the_middle_of_any_step_resumes_the_chain_there(
    tmp_path: Path, step: str
) -> None:
    r1 = make_rig(tmp_path)
    inject(r1, step, Crash())
    with pytest.raises(Crash):
        r1.agent.run(threading.Event(), max_ticks=3)
    assert json.loads((tmp_path / "ladder.json").read_text())["chain"]["step"] == step
    # The restarted agent (same boot, same state dir) goes on with the chain at once.
    r2 = make_rig(tmp_path)
    r2.agent.run(threading.Event(), max_ticks=1)
    evs = r2.events()
    assert [e.event for e in evs[:2]] == ["start", "shutdown"]
    resumed = evs[1]
    if step == "shutdown":  # not one line was written: the chain starts over
        assert resumed.get("resume") is None
    else:
        assert resumed.get("resume") == step
        assert f"resuming the shutdown chain at {step}" in resumed.text
    done = {s for s, st in r2.actions() if st != "start"}
    order = ["linger", "delete", "poweroff", "force", "kernel"]
    first = order.index(step) if step in order else 0
    assert done == set(order[first:])  # every step from the mark on, none before it
    assert r2.kernel.calls == ["reboot", "sysrq"]


@pytest.mark.pure
def test_a_restart_during_the_linger_only_waits_what_is_left(tmp_path: Path) -> None:
    r1 = make_rig(tmp_path, linger=40.0)
    r1.agent.run(threading.Event(), max_ticks=1)  # rung 1/2, nothing decided yet
    r1.agent.mark = None
    raw = json.loads((tmp_path / "ladder.json").read_text())
    raw.update(
        fired=True,
        rung=2,
        chain={"step": "linger", "since": r1.clock.wall() - 30.0},
    )
    (tmp_path / "ladder.json").write_text(json.dumps(raw))
    r2 = make_rig(tmp_path, linger=40.0)
    r2.clock.t = r1.clock.t
    r2.agent.run(threading.Event(), max_ticks=1)
    start = next(e for e in r2.events() if e.get("step") == "linger")
    assert start.get("ms") == "10000"


@pytest.mark.pure
def test_an_old_state_file_with_fired_but_no_step_powers_off(tmp_path: Path) -> None:
    """What the agent wrote before: fired=true and nothing else. It used to hold forever."""
    (tmp_path / "ladder.json").write_text(
        json.dumps({"boot_id": "b1", "rung": 2, "fired": True, "warned": False})
    )
    r = make_rig(tmp_path, script=[result("ok", "ok")])
    r.agent.run(threading.Event(), max_ticks=1)
    assert r.runner.calls == ["poweroff", "force"]


@pytest.mark.pure
def test_a_chain_that_ran_through_is_tried_again_not_held_forever(tmp_path: Path) -> None:
    r = make_rig(tmp_path, linger=0)
    ticks = 2 + int(CHAIN_RETRY_S / 30) + 2
    r.agent.run(threading.Event(), max_ticks=ticks)
    shutdowns = [e for e in r.events() if e.event == "shutdown"]
    assert len(shutdowns) >= 2
    assert shutdowns[0].get("resume") is None
    assert shutdowns[1].get("resume") == "poweroff"
    assert "still up" in shutdowns[1].text
    assert r.runner.calls.count("poweroff") >= 2
    assert r.api.calls == 1  # the Compute API step is not repeated by a power-off retry


@pytest.mark.pure
def test_a_chain_hook_that_always_raises_still_moves_on(tmp_path: Path) -> None:
    r = make_rig(tmp_path)
    calls: list[str | None] = []

    def broken(*a: object, resume_at: str | None = None, **k: object) -> None:
        calls.append(resume_at)
        raise Boom("chain hook")

    r.agent.d.on_shutdown = broken
    r.agent.run(threading.Event(), max_ticks=8)
    # decided at tick 2, then each failing attempt starts one step further, never the same
    assert calls[:3] == [None, "linger", "delete"]
    assert len(set(calls)) == len(calls) or "end" in calls
    errs = [e for e in r.events() if e.event == "error"]
    assert errs and errs[0].get("where") == "chain" and "Boom" in errs[0].text


# -- no content of any state file can crash a tick ----------------------------------------------

NASTY = [
    b"\xff\xfe\xfd invalid utf-8 \x80",
    b"{not json",
    b"[" * 50_000,
    b'{"boot_id": "b1", "rung": "x", "fired": "yes", "chain": [1], "set_at": 1e999}',
    b'{"boot_id": "b1", "rung": 1e400, "chain": {"step": 7, "since": "x"}}',
    b'{"boot_id": "b1", "rung": 2, "chain": {"step": "nonsense", "since": -1e308}}',
    b'{"set_at": 1e300, "until": 1e308, "project": ["x"], "zone": 5}',
    b'{"set_at": "NaN", "until": "Infinity"}',
    b"1" * 5000,
    b"\x00" * 64,
    b"",
]
FILES = ["ladder.json", "phase", "disarm.json", "instance.json", "seq"]


def real_file_agent(tmp: Path) -> tuple[Agent, MemorySink, list[object]]:
    """An agent whose state-file readers are the real ones (ladder, phase, disarm, identity)."""
    cfg = make_cfg(tmp, "poweroff")
    clock = FakeClock()
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp, BOOT), BOOT, clock.wall, key=SYNTH_KEY)
    decided: list[object] = []
    deps = Deps(
        emitter=em,
        prober=ScriptedProber([result("fail", "fail")], clock),
        clock=clock,
        notifier=FakeNotifier(),
        store=LadderStore(tmp / "ladder.json", "b1"),
        on_shutdown=lambda *a, **k: decided.append(a),
        armed=DisarmGate.from_config(cfg, em, lambda: False, wall=clock.wall),
        phase=lambda: read_phase(tmp),
        instance_id=lambda: _instance_id(str(tmp), None),
    )
    return Agent.from_config(cfg, deps), sink, decided


@pytest.mark.pure
@pytest.mark.parametrize("content", NASTY, ids=range(len(NASTY)))
@pytest.mark.parametrize("name", FILES)
def test_no_state_file_content_crashes_a_tick(tmp_path: Path, name: str, content: bytes) -> None:
    (tmp_path / name).write_bytes(content)
    agent, sink, decided = real_file_agent(tmp_path)
    agent.run(threading.Event(), max_ticks=3)
    assert agent.tick_errors == 0
    assert decided  # armed (an unreadable disarm file never disarms), and the chain was called
    decoded = [protocol.decode_line(x, pin=SYNTH_KEY.public) for x in sink.lines]
    assert not any(isinstance(e, protocol.Event) and e.event == "error" for e in decoded)


@pytest.mark.pure
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(FILES), content=st.binary(max_size=300))
def test_no_state_file_content_crashes_a_tick_property(
    tmp_path_factory: pytest.TempPathFactory, name: str, content: bytes
) -> None:
    tmp = tmp_path_factory.mktemp("state")
    (tmp / name).write_bytes(content)
    agent, _, decided = real_file_agent(tmp)
    agent.run(threading.Event(), max_ticks=3)
    assert agent.tick_errors == 0 and decided


@pytest.mark.pure
def test_an_unexpected_tick_exception_is_written_and_the_watch_goes_on(tmp_path: Path) -> None:
    r = make_rig(tmp_path, script=[result("ok", "ok")])
    n = [0]

    def phase() -> str:
        n[0] += 1
        if n[0] == 1:
            raise Boom("phase reader bug")
        return "workload"

    r.agent.d.phase = phase
    r.agent.d.prober = ScriptedProber([result("fail", "ok")], r.clock)
    r.agent.run(threading.Event(), max_ticks=3)
    evs = r.events()
    err = next(e for e in evs if e.event == "error")
    assert err.get("where") == "tick" and "phase reader bug" in err.text
    assert [e.event for e in evs].count("tick") == 2 and evs[-1].event == "stop"


# -- SIGTERM during the chain -------------------------------------------------------------------


@pytest.mark.pure
def test_sigterm_during_the_chain_writes_that_the_chain_goes_on(tmp_path: Path) -> None:
    r = make_rig(tmp_path, linger=0)
    stop = threading.Event()
    saw_line = threading.Event()
    inner = r.runner.__call__

    def runner(argv: list[str], timeout: float) -> RunResult:
        if not stop.is_set():  # systemd stopping units during the power-off we started
            r.agent.request_stop(stop, "sigterm", "SIGTERM")
            end = time.monotonic() + 10
            while time.monotonic() < end and not saw_line.is_set():
                if any(" signal " in x for x in r.sink.lines):
                    saw_line.set()
                time.sleep(0.01)
        return inner(argv, timeout)

    r.chain.runner = runner
    r.agent.run(stop, max_ticks=10)
    assert saw_line.is_set()
    evs = r.events()
    sig = next(e for e in evs if e.event == "signal")
    assert sig.get("sig") == "SIGTERM" and sig.get("step") == "poweroff"
    assert sig.text == "SIGTERM during the shutdown chain: the chain goes on"
    names = [(e.event, e.get("step"), e.get("status")) for e in evs]
    # the chain went on after the signal: force and kernel, then the stop line
    after = names[names.index(("signal", "poweroff", None)) :]
    assert ("action", "force", "start") in after and ("action", "kernel", "start") in after
    assert evs[-1].event == "stop" and evs[-1].get("reason") == "sigterm"


@pytest.mark.process
def test_real_sigterm_during_the_linger_of_a_real_agent_stops_it_there(tmp_path: Path) -> None:
    serial = tmp_path / "ttyS0"

    def evs() -> list[protocol.Event]:
        return read_events(serial)

    dmi = tmp_path / "product_name"  # this test acts: it must look like GCE
    dmi.write_text("Google Compute Engine\n")
    with SimGCE() as sim:
        cfg = agent_config(
            tmp_path,
            sim,
            {
                "threshold": 2,
                "heartbeat_every": None,
                "action": "poweroff",
                "dmi_product_path": str(dmi),
            },
            actions={
                "linger": 3,
                "repeat_every": 0.5,
                "poweroff_cmd": ["false"],
                "force_cmd": ["false"],
                "kernel": [],
            },
        )
        sim.outage(True)
        with agent_process(cfg) as p:
            assert wait_for(
                lambda: ("linger", "start") in [(e.get("step"), e.get("status")) for e in evs()],
                timeout=30,
            )
            assert stop_agent(p, timeout=30) == 0
    got = [(e.event, e.get("step"), e.get("status")) for e in evs()]
    i = next(i for i, g in enumerate(got) if g[0] == "signal")
    assert got[i][1] == "linger" and got[i + 1 :] == [("stop", None, None)]
    assert not any(g[0] == "action" and g[1] != "linger" for g in got), "nothing after the linger"
    stored = json.loads((tmp_path / "state" / "ladder.json").read_text())
    assert stored["chain"]["step"] == "linger", "a restart resumes the linger"
