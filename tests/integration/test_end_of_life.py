"""The one end-of-life path (issue 24): every ending of a job goes through the agent's chain.

- in-process, with the real chain and hand-written fakes for the clock, commands, Compute API and
  kernel: the final line is drained before the linger, the linger comes before any action, the
  power-off escalates when a step does not power off;
- the hand-off (``daemon/endoflife.py``) between the command and the agent: one chain per boot,
  taken by the agent when it runs, by the command when none does, resumed after a dead runner;
- end to end: a real agent process against the simulated metadata server takes the ending of a
  real ``gce-watchdog end``; with no agent, ``end`` runs the chain itself and deletes the VM
  through the fake Compute API.

Never a real power-off: every config here has recorder commands and ``kernel = []``.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gce_watchdog.daemon.actions import ActionChain, ApiResult, end_action
from gce_watchdog.daemon.endoflife import (
    EndBox,
    EndRequest,
    EndWatch,
    flock_held,
    hand_off,
    parse_linger,
    run_taken,
)
from gce_watchdog.daemon.metawatch import InstanceInfo
from gce_watchdog.lib.proc import RunResult
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol, vocab
from kit.configs import chain_config
from kit.gce import add_spot_vm, spot_vm_info
from kit.paths import REPO

INST = InstanceInfo("sim-project", "us-central1-a", "sim-vm-1", "4520031799277582145")
BOOT = "0badc0de"


# -- one timeline for every edge ----------------------------------------------------------------


@dataclass
class Timeline:
    """Everything the chain does, in order: lines written and drained, sleeps, API calls, commands
    and kernel power-offs."""

    t: float = 1000.0
    log: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, what: str) -> None:
        with self.lock:
            self.log.append((kind, what))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.log]

    def index(self, kind: str, what: str | None = None) -> int:
        return next(
            i for i, (k, w) in enumerate(self.log) if k == kind and (what is None or w == what)
        )


class TimelineSink:
    """A console that records each line when written and again when drained."""

    def __init__(self, tl: Timeline) -> None:
        self.tl = tl
        self.lines: list[str] = []
        self.dropped = 0

    def submit(self, line: str, sync: bool = False) -> object:
        ev = protocol.decode_line(line, pin=SYNTH_KEY.public)
        name = ev.event if isinstance(ev, protocol.Event) else "key"
        self.lines.append(line)
        self.tl.add("write", name)

        def drained() -> bool:
            self.tl.add("drained", name)
            return True

        return drained


class TimelineClock:
    def __init__(self, tl: Timeline) -> None:
        self.tl = tl

    def monotonic(self) -> float:
        return self.tl.t

    def wall(self) -> float:  # lib.clock.Clock; the chain reads no wall time
        return self.monotonic()

    def sleep(self, seconds: float) -> None:
        self.tl.t += max(0.0, seconds)
        self.tl.add("sleep", f"{seconds:g}")

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if event.wait(5.0):  # the API thread of the fake answers at once
            return True
        self.sleep(seconds)
        return event.is_set()


@dataclass
class Runner:
    tl: Timeline
    fail: set[str] = field(default_factory=set)

    def __call__(self, argv: list[str], timeout: float) -> RunResult:
        self.tl.add("run", " ".join(argv))
        return RunResult(1, detail="refused (fake)") if argv[-1] in self.fail else RunResult(0)


@dataclass
class Api:
    tl: Timeline

    def act(self, op: str, inst: InstanceInfo, request_id: str) -> ApiResult:
        self.tl.add("api", op)
        return ApiResult(True, 200, "operation-1")


@dataclass
class Kernel:
    tl: Timeline

    def poweroff(self, method: str) -> str:
        self.tl.add("kernel", method)
        return f"{method}: EPERM (fake)"


def make_chain(
    tmp: Path, action: str = "delete", fail: set[str] | None = None, **actions: object
) -> tuple[ActionChain, Timeline, TimelineSink]:
    cfg = chain_config(tmp, action, **{"linger": 75.0, "poweroff_wait": 120.0, **actions})
    tl = Timeline()
    sink = TimelineSink(tl)
    em = Emitter(sink, SeqAllocator(tmp, BOOT), BOOT, key=SYNTH_KEY)  # type: ignore[arg-type]
    chain = ActionChain.from_config(
        cfg,
        em,
        lambda: None,
        runner=Runner(tl, fail or set()),
        clock=TimelineClock(tl),
        api=Api(tl),
        kernel=Kernel(tl),
        instance=lambda: INST,
        jitter=lambda: 0.5,
    )
    return chain, tl, sink


def decoded(sink: TimelineSink) -> list[protocol.Event]:
    out = []
    for line in sink.lines:
        ev = protocol.decode_line(line, pin=SYNTH_KEY.public)
        if isinstance(ev, protocol.Event):
            out.append(ev)
    return out


# -- the chain for an ending ----------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("reason", vocab.END_REASONS)
def test_an_ending_lingers_after_its_line_is_drained_and_before_any_action(
    tmp_path: Path, reason: str
) -> None:
    chain, tl, sink = make_chain(tmp_path, "delete")
    chain.end_of_life(reason)
    evs = decoded(sink)
    first = evs[0]
    assert first.event == "end", "an ending is never announced as a shutdown (a failover)"
    assert first.fields_dict == {
        "reason": reason,
        "action": "delete",
        "chain": "linger+delete+poweroff+force+kernel",
    }
    assert not any(e.event in ("shutdown", "dry_run_shutdown") for e in evs)
    # The `end` line is written and drained before the first sleep of the linger; the linger's
    # sleeps all come before the API call, which comes before the first power-off command.
    drained = tl.index("drained", "end")
    first_sleep = tl.index("sleep")
    api = tl.index("api", "delete")
    power = tl.index("run", "systemctl poweroff")
    assert drained < first_sleep < api < power
    lingered = sum(float(w) for k, w in tl.log[first_sleep:api] if k == "sleep")
    assert lingered == pytest.approx(75.0)
    # Repeats of the `end` line during the linger, every 5 s, never a rung (no ladder decided).
    reps = [e for e in evs if e.event == "end" and e.get("rep")]
    assert len(reps) == 14 and all(e.get("rung") is None for e in evs)
    assert chain.last_result is not None and chain.last_result.status("delete") == "ok"


@pytest.mark.pure
def test_power_off_escalates_when_a_step_does_not_power_off(tmp_path: Path) -> None:
    chain, tl, sink = make_chain(tmp_path, "poweroff")
    chain.end_of_life("done")
    runs = [w for k, w in tl.log if k in ("run", "kernel")]
    assert runs == ["systemctl poweroff", "systemctl poweroff --force", "reboot", "sysrq"]
    steps = [(e.get("step"), e.get("status")) for e in decoded(sink) if e.event == "action"]
    # accepted, then checked: still up after its wait is `stuck`, and the next step runs
    assert ("poweroff", "stuck") in steps and ("force", "stuck") in steps
    i_power, i_force = tl.index("run", "systemctl poweroff"), tl.index("kernel", "reboot")
    waited = sum(float(w) for k, w in tl.log[i_power:i_force] if k == "sleep")
    assert waited == pytest.approx(120.0 + 30.0)


@pytest.mark.pure
def test_a_refused_poweroff_goes_on_to_the_force_at_once(tmp_path: Path) -> None:
    chain, tl, _sink = make_chain(tmp_path, "poweroff", fail={"poweroff"})
    chain.end_of_life("failed")
    i_power = tl.index("run", "systemctl poweroff")
    i_force = tl.index("run", "systemctl poweroff --force")
    assert [k for k, _ in tl.log[i_power:i_force] if k == "sleep"] == []


@pytest.mark.pure
def test_an_ending_under_a_dry_run_powers_off_for_real(tmp_path: Path) -> None:
    assert end_action("dry-run") == "poweroff"
    assert [end_action(a) for a in ("poweroff", "stop", "delete")] == ["poweroff", "stop", "delete"]
    chain, tl, sink = make_chain(tmp_path, "dry-run", dry_run_op="delete")
    chain.end_of_life("done")
    assert decoded(sink)[0].get("action") == "poweroff"
    assert ("run", "systemctl poweroff") in tl.log and ("api", "delete") not in tl.log
    # the ladder's own chain is left a dry run
    assert chain.dry_run and chain.plan()[1] == "delete"


@pytest.mark.pure
def test_the_linger_of_a_request_overrides_the_config(tmp_path: Path) -> None:
    chain, tl, _sink = make_chain(tmp_path, "poweroff")
    chain.end_of_life("done", linger=10.0)
    lingered = sum(float(w) for k, w in tl.log[: tl.index("run")] if k == "sleep")
    assert lingered == pytest.approx(10.0)
    assert chain.actions.linger == 75.0


@pytest.mark.pure
@pytest.mark.parametrize("raw", ["inf", "-1s", "nan", "2h", "soon", ""])
def test_a_bad_linger_is_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_linger(raw)
    assert parse_linger("90s") == 90.0 and parse_linger("2m") == 120.0 and parse_linger("0") == 0


@pytest.mark.pure
@pytest.mark.parametrize("raw", ["inf", "-5s"])
def test_config_refuses_an_infinite_or_negative_linger(tmp_path: Path, raw: str) -> None:
    with pytest.raises(cfgmod.InvalidConfig, match=r"actions\.linger"):
        cfgmod.from_dict({"actions": {"linger": raw}}, "test")


# -- the hand-off ---------------------------------------------------------------------------------


class StepWaiter:
    """Time that moves only when the command waits; ``on_sleep`` plays the agent's ticks."""

    def __init__(self, on_sleep: object = None) -> None:
        self.t = 0.0
        self.on_sleep = on_sleep
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
        self.sleeps += 1
        if callable(self.on_sleep):
            self.on_sleep()


@dataclass
class Recorded:
    calls: list[dict[str, object]] = field(default_factory=list)

    def __call__(self, reason: str, **kw: object) -> None:
        self.calls.append({"reason": reason, **kw})
        progress = kw.get("progress")
        if callable(progress):
            for step in ("linger", "poweroff", "force"):
                progress(step)


@pytest.mark.pure
def test_the_agent_takes_the_ending_at_its_tick_and_the_command_returns(tmp_path: Path) -> None:
    box = EndBox(tmp_path / "run", "boot-1")
    chain = Recorded()
    agent_box = EndBox(tmp_path / "run", "boot-1")
    watch = EndWatch(
        agent_box, chain, wall=lambda: 5000.0, monotonic=lambda: 0.0, default_linger=75
    )
    assert watch.poll() is False, "nothing requested: nothing runs"
    box.request("done", 90.0)
    assert hand_off(box, 30.0, StepWaiter(on_sleep=watch.poll)) is None
    assert len(chain.calls) == 1
    call = chain.calls[0]
    assert (call["reason"], call["linger"], call["resume_at"]) == ("done", 90.0, None)
    req = box.load()
    assert req is not None and (req.state, req.step, req.by) == ("taken", "end", os.getpid())
    assert box.busy(), "the agent keeps the lock: no second runner"
    assert box.take() is None
    # a second `end` in the same boot joins the first: it changes nothing and runs nothing
    assert box.request("failed", None).reason == "done"
    assert hand_off(box, 30.0, StepWaiter()) is None and len(chain.calls) == 1
    watch.stop()


@pytest.mark.pure
def test_with_no_agent_the_command_takes_the_ending_after_its_wait(tmp_path: Path) -> None:
    box = EndBox(tmp_path / "run", "boot-1")
    box.request("setup_failed", None)
    waiter = StepWaiter()
    taken = hand_off(box, 20.0, waiter)
    assert taken is not None and waiter.t >= 20.0
    assert EndBox(tmp_path / "run", "boot-1").take() is None, "one runner at a time"
    chain = Recorded()
    run_taken(taken, chain, lambda: 100.0, 75.0)
    assert [c["reason"] for c in chain.calls] == ["setup_failed"]
    taken.release()


@pytest.mark.pure
def test_with_no_agent_running_the_command_does_not_wait(tmp_path: Path) -> None:
    box = EndBox(tmp_path / "run", "boot-1")
    box.request("done", None)
    waiter = StepWaiter()
    taken = hand_off(box, 60.0, waiter, agent_up=lambda: False)
    assert taken is not None and waiter.sleeps == 0
    taken.release()


@pytest.mark.pure
def test_flock_held_reads_the_kernel_lock_table_without_taking_the_lock(tmp_path: Path) -> None:
    import fcntl

    path = tmp_path / "agent.lock"
    assert flock_held(path) is False, "no lock file: no agent ever ran"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert flock_held(path) is False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert flock_held(path) is True
        assert flock_held(path, locks=str(tmp_path / "no-proc-locks")) is None
    finally:
        os.close(fd)
    assert flock_held(path) is False


@pytest.mark.pure
def test_a_dead_runner_s_chain_is_resumed_at_its_step_with_the_linger_left(tmp_path: Path) -> None:
    box = EndBox(tmp_path / "run", "boot-1")
    box.request("done", 60.0)
    first = box.take()
    assert first is not None
    first.mark("linger", since=1000.0)
    first.release()  # the runner died during the linger (the kernel drops its lock)
    chain = Recorded()
    watch = EndWatch(box, chain, wall=lambda: 1045.0, monotonic=lambda: 0.0, default_linger=75)
    assert watch.poll() is True
    call = chain.calls[0]
    assert call["resume_at"] == "linger" and call["linger_left"] == pytest.approx(15.0)
    watch.stop()


@pytest.mark.pure
def test_an_end_after_a_dead_runner_s_chain_ran_through_powers_off_again(tmp_path: Path) -> None:
    box = EndBox(tmp_path / "run", "boot-1")
    box.request("done", None)
    first = box.take()
    assert first is not None
    first.mark("end", since=1000.0)  # ran through with the VM still up, then its runner died
    first.release()
    taken = hand_off(box, 5.0, StepWaiter())
    assert taken is not None, "nobody runs it: never reported as handed to the agent"
    chain = Recorded()
    run_taken(taken, chain, lambda: 2000.0, 75.0)
    assert chain.calls[0]["resume_at"] == "end"
    taken.release()


@pytest.mark.pure
def test_a_chain_that_ran_through_is_tried_again_from_the_power_off(tmp_path: Path) -> None:
    box = EndBox(tmp_path / "run", "boot-1")
    box.request("done", None)
    now = [0.0]
    chain = Recorded()
    watch = EndWatch(box, chain, wall=lambda: 1.0, monotonic=lambda: now[0], default_linger=75)
    assert watch.poll() and not watch.poll(), "not again at once"
    now[0] = 61.0
    assert watch.poll()
    assert [c["resume_at"] for c in chain.calls] == [None, "end"]
    watch.stop()


@pytest.mark.pure
@pytest.mark.parametrize(
    "content",
    [
        b"garbage",
        b'{"reason": "ladder", "boot": "boot-1"}',
        b'{"reason": "done", "boot": "other-boot"}',
        b'{"reason": "done", "boot": "boot-1", "linger": 1e999}',
        b'{"reason": "done", "boot": "boot-1", "linger": -1}',
        b"[" * 100000,
    ],
)
def test_a_bad_request_file_runs_nothing(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "end.json").write_bytes(content)
    box = EndBox(tmp_path / "run", "boot-1")
    assert box.load() is None and box.take() is None


@pytest.mark.pure
def test_a_symlink_at_the_lock_is_never_followed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "victim"
    target.write_text("keep")
    (run / "end.lock").symlink_to(target)
    box = EndBox(run, "boot-1")
    box.request("done", None)
    assert box.take() is None and not box.busy()
    assert target.read_text() == "keep"


@pytest.mark.pure
def test_request_round_trip() -> None:
    r = EndRequest("failed", "b", 12.5, "taken", "force", 99.0, 7)
    assert EndRequest.from_json(json.loads(json.dumps(r.to_json()))) == r


# -- end to end -----------------------------------------------------------------------------------


def _recorder(tmp: Path) -> tuple[Path, Path]:
    record = tmp / "argv.log"
    rec = tmp / "record.sh"
    rec.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\n')
    rec.chmod(rec.stat().st_mode | stat.S_IXUSR)
    return rec, record


def _write_config(tmp: Path, md_url: str, action: str, extra: str = "", **actions: object) -> Path:
    rec, _ = _recorder(tmp)
    a: dict[str, object] = {
        "linger": "0.5s",
        "repeat_every": "0.1s",
        "poweroff_cmd": [str(rec), "poweroff"],
        "force_cmd": [str(rec), "force"],
        "poweroff_wait": "0.2s",
        "force_wait": "0.2s",
        "command_timeout": "5s",
        "kernel": [],  # never reboot(2) the test machine
    }
    a.update(actions)
    (tmp / "ttyS0").touch()
    p = tmp / "config.toml"
    p.write_text(
        "[agent]\n"
        f'action = "{action}"\nstate_dir = "{tmp}/state"\nrun_dir = "{tmp}/run"\n{extra}'
        f'[metadata]\nurl = "{md_url}"\n'
        f'[serial]\ndevice = "{tmp}/ttyS0"\n'
        "[actions]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in a.items())
    )
    return p


def _events(path: Path) -> list[protocol.Event]:
    evs, stats = protocol.decode_all(path.read_bytes()) if path.exists() else ([], None)
    assert stats is None or (stats.rejected == 0 and stats.forged == 0)
    return [e for e in evs if e.event not in ("key", "instance")]


def _wait_for(pred: object, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if callable(pred) and pred():
            return True
        time.sleep(0.05)
    return False


def _cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gce_watchdog", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.process
def test_a_running_agent_takes_the_ending_of_a_finished_job(tmp_path: Path) -> None:
    from gce_watchdog.testing.simgce import SimGCE

    with SimGCE() as sim:
        assert sim.tcp is not None
        extra = (
            "interval = 0.3\nprobe_timeout = 0.2\nheartbeat_every = 1\n"
            f'[egress]\ntargets = ["127.0.0.1:{sim.tcp.port}"]\ndns_timeout = 0.1\n'
        )
        cfg = _write_config(tmp_path, sim.metadata.url, "poweroff", extra)
        serial = tmp_path / "ttyS0"
        agent = subprocess.Popen(
            [sys.executable, "-m", "gce_watchdog", "run", "--config", str(cfg)],
            cwd=REPO,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert _wait_for(lambda: any(e.event == "heartbeat" for e in _events(serial)))
            assert _cli("phase", "done", "--config", str(cfg)).returncode == 0
            end = _cli("end", "--reason", "done", "--config", str(cfg), "--wait", "20s")
            assert end.returncode == 0, end.stderr
            assert "handed to the agent" in end.stderr
            assert _wait_for(
                lambda: (
                    ("force", "stuck")
                    in [(e.get("step"), e.get("status")) for e in _events(serial)]
                )
            )
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(20)
    evs = _events(serial)
    names = [e.event for e in evs]
    i_done = next(i for i, e in enumerate(evs) if e.event == "phase" and e.get("ph") == "done")
    i_end = names.index("end")
    assert i_done < i_end
    assert evs[i_end].get("reason") == "done" and evs[i_end].get("chain") == "linger+poweroff+force"
    steps = [(e.get("step"), e.get("status")) for e in evs[i_end:] if e.event == "action"]
    assert steps[:2] == [("linger", "start"), ("linger", "ok")]
    assert steps.index(("linger", "ok")) < steps.index(("poweroff", "start"))
    assert (tmp_path / "argv.log").read_text().split() == ["poweroff", "force"]
    req = EndBox(tmp_path / "run", _boot_id()).load()
    assert req is not None and req.by == agent.pid, "the agent ran the chain, not the command"
    assert "shutdown" not in names


def _boot_id() -> str:
    from gce_watchdog.vm.state import read_boot_id

    return read_boot_id(cfgmod.AgentSection().boot_id_path)


@pytest.mark.process
def test_with_no_agent_end_runs_the_chain_and_deletes_the_spot_vm(tmp_path: Path) -> None:
    from gce_watchdog.testing.simcompute import FakeComputeAPI
    from gce_watchdog.testing.simgce import TOKEN, FakeMetadataServer

    info = spot_vm_info()
    with FakeMetadataServer(info=info) as md, FakeComputeAPI(token=TOKEN) as api:
        add_spot_vm(api)
        cfg = _write_config(
            tmp_path,
            md.url,
            "delete",
            api_base=api.base_url,
            api_timeout="2s",
            api_attempts=2,
            api_deadline="5s",
        )
        # No identity cache: no agent ever ran; `end` asks the metadata server itself.
        assert not (tmp_path / "state" / "instance.json").exists()
        env = dict(os.environ)
        env["GCE_METADATA_HOST"] = f"127.0.0.1:{md.port}"
        env["GCE_METADATA_IP"] = f"127.0.0.1:{md.port}"
        assert _cli("setup-failed", "--step", "install", "--reason", "bad sha", "--config",
                    str(cfg), env=env).returncode == 0  # fmt: skip
        p = _cli("end", "--reason", "setup_failed", "--wait", "0.5s", "--config", str(cfg),
                 env=env)  # fmt: skip
        assert p.returncode == 69, p.stderr  # ran here; the fake power-off left the VM "up"
        assert "running the chain here" in p.stderr
        assert api.instance("sim-vm-1").deleted
        assert len(api.calls_to("delete")) == 1
    evs = _events(tmp_path / "ttyS0")
    names = [e.event for e in evs]
    assert names.index("setup_failed") < names.index("end")
    steps = [(e.get("step"), e.get("status")) for e in evs if e.event == "action"]
    assert steps.index(("linger", "ok")) < steps.index(("delete", "start"))
    assert steps.index(("delete", "ok")) < steps.index(("poweroff", "start"))
    assert (tmp_path / "argv.log").read_text().split() == ["poweroff", "force"]


# -- the agent's loop -----------------------------------------------------------------------------


def _agent(tmp_path: Path, script: list[object], chain: object) -> tuple[object, object, EndBox]:
    from gce_watchdog.daemon.service import Agent, Deps, LadderStore
    from gce_watchdog.vm.console import MemorySink
    from kit.fakes import FakeClock, FakeNotifier, ScriptedProber

    clock = FakeClock()
    sink = MemorySink()
    box = EndBox(tmp_path / "run", "b1")
    watch = EndWatch(
        EndBox(tmp_path / "run", "b1"),
        chain,  # type: ignore[arg-type]
        wall=clock.wall,
        monotonic=clock.monotonic,
        default_linger=75.0,
    )
    cfg = cfgmod.replace(
        cfgmod.Config(), agent={"interval": 30.0, "probe_timeout": 5.0, "threshold": 3}
    )
    deps = Deps(
        emitter=Emitter(
            sink, SeqAllocator(tmp_path, "0000abcd"), "0000abcd", clock.wall, key=SYNTH_KEY
        ),
        prober=ScriptedProber(script, clock),  # type: ignore[arg-type]
        clock=clock,
        notifier=FakeNotifier(),
        store=LadderStore(tmp_path / "ladder.json", "b1"),
        on_shutdown=lambda *a, **k: None,
        end_of_life=watch,
    )
    return Agent.from_config(cfg, deps), sink, box


def _names(sink: object) -> list[protocol.Event]:
    lines = getattr(sink, "lines", [])
    evs = (protocol.decode_line(ln, pin=SYNTH_KEY.public) for ln in list(lines))
    return [e for e in evs if isinstance(e, protocol.Event)]


@pytest.mark.pure
def test_the_agent_runs_a_requested_ending_at_its_next_tick_and_a_sigterm_does_not_stop_it(
    tmp_path: Path,
) -> None:
    from kit.fakes import result

    stop = threading.Event()
    calls: list[str] = []
    holder: list[object] = []

    def chain(reason: str, **kw: object) -> None:
        calls.append(reason)
        kw["progress"]("poweroff")  # type: ignore[operator]
        # systemd stopping units during the power-off this chain started: the chain goes on
        holder[0].request_stop(stop, "sigterm", "SIGTERM")  # type: ignore[attr-defined]
        assert _wait_for(lambda: any(e.event == "signal" for e in _names(holder[1])), 5)

    agent, sink, box = _agent(tmp_path, [result("ok", "ok")], chain)
    holder += [agent, sink]
    agent.tick_once()  # type: ignore[attr-defined]
    assert calls == [], "nothing requested: nothing runs"
    box.request("failed", None)
    agent.run(stop, max_ticks=5)  # type: ignore[attr-defined]
    assert calls == ["failed"]
    evs = _names(sink)
    sig = next(e for e in evs if e.event == "signal")
    assert (sig.get("sig"), sig.get("step")) == ("SIGTERM", "poweroff")
    assert sig.text == "SIGTERM during the shutdown chain: the chain goes on"
    assert evs[-1].event == "stop", "the loop stops only after the chain returned"
    req = box.load()
    assert req is not None and req.step == "end"


@pytest.mark.pure
def test_no_ending_is_run_once_the_ladder_decided(tmp_path: Path) -> None:
    from kit.fakes import result

    chain = Recorded()
    agent, _sink, box = _agent(tmp_path, [result("fail", "fail")], chain)
    for _ in range(3):
        agent.tick_once()  # type: ignore[attr-defined]
    assert agent.state.fired  # type: ignore[attr-defined]
    box.request("done", None)
    agent.tick_once()  # type: ignore[attr-defined]
    assert chain.calls == [], "the ladder's chain ends this VM already"


@pytest.mark.process
def test_a_sigterm_in_the_linger_of_an_ending_stops_the_agent_and_keeps_the_step(
    tmp_path: Path,
) -> None:
    """Issue 39: the agent stops when asked during the linger of a job's ending too; end.json
    keeps `linger`, so a restarted agent resumes the ending there."""
    from gce_watchdog.daemon.actions import ChainStopped
    from kit.fakes import result

    stop = threading.Event()
    holder: list[object] = []

    def chain(reason: str, **kw: object) -> None:
        kw["progress"]("linger")  # type: ignore[operator]
        holder[0].request_stop(stop, "sigterm", "SIGTERM")  # type: ignore[attr-defined]
        raise ChainStopped("stopped during the linger")  # what the chain's linger does

    agent, sink, box = _agent(tmp_path, [result("ok", "ok")], chain)
    holder += [agent, sink]
    box.request("done", None)
    assert agent.run(stop, max_ticks=5) == 0  # type: ignore[attr-defined]
    evs = _names(sink)
    names = [e.event for e in evs]
    sig = next(e for e in evs if e.event == "signal")
    assert (sig.get("sig"), sig.get("step")) == ("SIGTERM", "linger")
    assert sig.text == "SIGTERM during the linger: the agent stops; a restart resumes the chain"
    assert names.index("signal") < names.index("stop") and names[-1] == "stop"
    assert agent.ticks == 1, "the loop stopped at the first tick"  # type: ignore[attr-defined]
    req = box.load()
    assert req is not None and req.step == "linger", "a restart resumes the linger"
