"""The shutdown action chain (agent/gce_watchdog/daemon/actions.py).

Two layers:
- in-process, with hand-written fakes for the clock, commands, Compute API and kernel: the order of
  the lines, escalation, keepalive cadence, retries with one requestId, dry-run;
- end to end, in a child process, against REAL local servers: the simulated metadata server
  (identity + token, google-auth pointed at it with GCE_METADATA_HOST/GCE_METADATA_IP) and the fake
  Compute API (bearer token, URL, requestId). A child process because google-auth reads those
  variables once, when it is first imported.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gce_watchdog.daemon.actions import ActionChain, ApiResult, ChainRetry, ChainStopped
from gce_watchdog.daemon.metawatch import InstanceInfo, save_instance_cache
from gce_watchdog.lib.proc import RunResult
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol
from hypothesis import given
from hypothesis import strategies as st
from kit.agent import agent_config
from kit.cli import agent_env, gcewd_argv
from kit.configs import chain_config
from kit.events import read_events, sink_events
from kit.gce import add_spot_vm, spot_vm_info
from kit.paths import REPO
from kit.wait import wait_for

INST = InstanceInfo("sim-project", "us-central1-a", "sim-vm-1", "4520031799277582145")


# -- fakes -------------------------------------------------------------------------------------


class FakeClock:
    """Monotonic time that only moves when the code under test sleeps or waits."""

    def __init__(self, real_slice: float = 1.0) -> None:
        self.t = 1000.0
        self.real_slice = real_slice  # real seconds a wait gives another thread to finish
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self.t

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.t += max(0.0, seconds)

    def wall(self) -> float:  # lib.clock.Clock; the chain reads no wall time
        return self.monotonic()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if event.wait(self.real_slice):
            return True
        self.sleep(seconds)
        return event.is_set()


@dataclass
class FakeRunner:
    results: dict[str, RunResult] = field(default_factory=dict)
    calls: list[list[str]] = field(default_factory=list)

    def __call__(self, argv: list[str], timeout: float) -> RunResult:
        self.calls.append(list(argv))
        return self.results.get(argv[-1], RunResult(0))


@dataclass
class FakeApi:
    script: list[ApiResult] = field(default_factory=list)
    calls: list[tuple[str, InstanceInfo, str]] = field(default_factory=list)
    hang: threading.Event | None = None

    def act(self, op: str, inst: InstanceInfo, request_id: str) -> ApiResult:
        self.calls.append((op, inst, request_id))
        if self.hang is not None:
            self.hang.wait(30)
            return ApiResult(False, None, "released", retryable=True)
        return self.script.pop(0) if self.script else ApiResult(True, 200, "operation-1")


@dataclass
class FakeKernel:
    fail: set[str] = field(default_factory=lambda: {"reboot", "sysrq"})
    calls: list[str] = field(default_factory=list)

    def poweroff(self, method: str) -> str:
        self.calls.append(method)
        return f"{method}: EPERM (fake)" if method in self.fail else ""


@dataclass
class Pings:
    clock: FakeClock
    times: list[float] = field(default_factory=list)

    def __call__(self) -> None:
        self.times.append(self.clock.monotonic())


def make_cfg(tmp: Path, action: str = "poweroff", **actions: object) -> cfgmod.Config:
    return chain_config(tmp, action, **{"linger": 20.0, "poweroff_wait": 60.0, **actions})


# Every step of a chain whose delete works and whose poweroff and force both go stuck, once each.
FULL_CHAIN = [
    ("linger", "start"),
    ("linger", "ok"),
    ("delete", "start"),
    ("delete", "ok"),
    ("poweroff", "start"),
    ("poweroff", "ok"),
    ("poweroff", "stuck"),
    ("force", "start"),
    ("force", "ok"),
    ("force", "stuck"),
    ("kernel", "start"),
    ("kernel", "fail"),
]


@dataclass
class Rig:
    cfg: cfgmod.Config
    chain: ActionChain
    sink: MemorySink
    clock: FakeClock
    runner: FakeRunner
    api: FakeApi
    kernel: FakeKernel
    pings: Pings

    def events(self) -> list[protocol.Event]:
        return sink_events(self.sink)

    def steps(self) -> list[tuple[str, str | None, str | None]]:
        return [(e.event, e.get("step"), e.get("status")) for e in self.events()]


def rig(
    tmp_path: Path,
    action: str = "poweroff",
    instance: InstanceInfo | None = INST,
    runner: FakeRunner | None = None,
    api: FakeApi | None = None,
    fake_kernel: FakeKernel | None = None,
    clock: FakeClock | None = None,
    **actions: object,
) -> Rig:
    cfg = make_cfg(tmp_path, action, **actions)
    sink = MemorySink()
    clock = clock or FakeClock()
    em = Emitter(sink, SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=SYNTH_KEY)
    runner = runner or FakeRunner()
    api = api or FakeApi()
    kernel = fake_kernel or FakeKernel()
    pings = Pings(clock)
    chain = ActionChain.from_config(
        cfg,
        em,
        pings,
        runner=runner,
        clock=clock,
        api=api,
        kernel=kernel,
        instance=lambda: instance,
        jitter=lambda: 0.5,
    )
    return Rig(cfg, chain, sink, clock, runner, api, kernel, pings)


# -- plan ---------------------------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize(
    ("action", "extra", "plan"),
    [
        ("poweroff", {}, ["linger", "poweroff", "force", "kernel"]),
        ("delete", {}, ["linger", "delete", "poweroff", "force", "kernel"]),
        ("stop", {"kernel": []}, ["linger", "stop", "poweroff", "force"]),
        # a dry run rehearses the default action's chain (poweroff), or the one it names
        ("dry-run", {}, ["linger", "poweroff", "force", "kernel"]),
        ("dry-run", {"dry_run_op": "delete"}, ["linger", "delete", "poweroff", "force", "kernel"]),
        ("dry-run", {"dry_run_op": "stop"}, ["linger", "stop", "poweroff", "force", "kernel"]),
        ("dry-run", {"dry_run_op": "none", "linger": 0}, ["poweroff", "force", "kernel"]),
    ],
)
def test_plan(tmp_path: Path, action: str, extra: dict[str, object], plan: list[str]) -> None:
    assert rig(tmp_path, action, **extra).chain.plan() == plan


# -- the chain in order (fakes) -----------------------------------------------------------------


@pytest.mark.pure
def test_poweroff_chain_in_order_and_every_step_announced_before_its_outcome(
    tmp_path: Path,
) -> None:
    r = rig(tmp_path, "delete")
    r.chain.execute("ladder", 10, 10)
    steps = r.steps()
    first = r.events()[0]
    assert first.event == "shutdown"
    assert first.fields_dict == {
        "reason": "ladder",
        "rung": "10/10",
        "action": "delete",
        "chain": "linger+delete+poweroff+force+kernel",
    }
    # shortened to fit beside the signed trailer, never dropped
    assert first.text.startswith("shutting down: BOTH reachability pro")
    actions = [(s, st) for e, s, st in steps if e == "action"]
    assert actions == [*FULL_CHAIN, ("kernel", "start"), ("kernel", "fail")]
    # The verdict is repeated during the 20 s linger, every 5 s.
    reps = [e for e in r.events() if e.event == "shutdown" and e.get("rep")]
    assert [e.get("rep") for e in reps] == ["1", "2", "3"]
    assert r.runner.calls == [["systemctl", "poweroff"], ["systemctl", "poweroff", "--force"]]
    assert r.kernel.calls == ["reboot", "sysrq"]
    assert [c[0] for c in r.api.calls] == ["delete"]
    assert r.chain.last_result is not None
    assert r.chain.last_result.status("delete") == "ok"


@pytest.mark.pure
def test_keepalive_is_pinged_at_least_every_repeat_interval(tmp_path: Path) -> None:
    r = rig(tmp_path, "poweroff", linger=75.0, poweroff_wait=120.0, force_wait=30.0)
    start = r.clock.monotonic()
    r.chain.execute("ladder", 10, 10)
    times = [start, *r.pings.times, r.clock.monotonic()]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert r.clock.monotonic() - start >= 75 + 120 + 30
    assert max(gaps) <= 5.0 + 1e-9, gaps  # systemd's WatchdogSec is far above 5 s


@pytest.mark.pure
def test_poweroff_command_failing_escalates_at_once(tmp_path: Path) -> None:
    runner = FakeRunner({"poweroff": RunResult(1, "Access denied")})
    r = rig(tmp_path, "poweroff", runner=runner, linger=0)
    r.chain.execute("ladder", 10, 10)
    ev = r.events()
    fail = next(e for e in ev if e.get("step") == "poweroff" and e.get("status") == "fail")
    assert fail.get("rc") == "1"
    assert fail.text == "Access denied"
    force = next(e for e in ev if e.get("step") == "force" and e.get("status") == "start")
    # No waiting after a refused poweroff: the forced one follows immediately (fake time).
    assert force.seq == fail.seq + 1
    assert r.runner.calls[1] == ["systemctl", "poweroff", "--force"]


@pytest.mark.pure
def test_command_that_cannot_run_counts_as_failed(tmp_path: Path) -> None:
    runner = FakeRunner({"poweroff": RunResult(None, "not found: systemctl")})
    r = rig(tmp_path, runner=runner, linger=0, kernel=[])
    r.chain.execute("ladder", 10, 10)
    fail = next(e for e in r.events() if e.get("status") == "fail")
    assert (fail.get("step"), fail.get("rc")) == ("poweroff", "-")
    assert r.chain.plan()[-1] == "force"


@pytest.mark.pure
def test_kernel_success_ends_the_chain(tmp_path: Path) -> None:
    r = rig(tmp_path, linger=0, fake_kernel=FakeKernel(fail={"reboot"}))
    r.chain.execute("ladder", 10, 10)
    assert r.kernel.calls == ["reboot", "sysrq"]
    assert r.steps()[-1] == ("action", "kernel", "ok")


@pytest.mark.pure
def test_api_retries_keep_one_request_id(tmp_path: Path) -> None:
    api = FakeApi(
        script=[
            ApiResult(False, 429, "Rate Limit Exceeded", retryable=True),
            ApiResult(False, 503, "Backend Error", retryable=True),
            ApiResult(True, 200, "operation-7"),
        ]
    )
    r = rig(tmp_path, "stop", api=api, linger=0, api_attempts=3)
    r.chain.execute("ladder", 10, 10)
    rids = {c[2] for c in api.calls}
    assert len(api.calls) == 3 and len(rids) == 1
    uuid.UUID(rids.pop())
    ok = next(e for e in r.events() if e.get("step") == "stop" and e.get("status") == "ok")
    assert (ok.get("tries"), ok.get("http"), ok.get("opn")) == ("3", "200", "operation-7")
    start = next(e for e in r.events() if e.get("step") == "stop" and e.get("status") == "start")
    assert start.get("rid") == api.calls[0][2]


@pytest.mark.pure
def test_api_refusal_is_final_and_reported(tmp_path: Path) -> None:
    api = FakeApi(script=[ApiResult(False, 403, "Required permission denied.")])
    r = rig(tmp_path, "delete", api=api, linger=0)
    r.chain.execute("ladder", 10, 10)
    assert len(api.calls) == 1
    fail = next(e for e in r.events() if e.get("step") == "delete" and e.get("status") == "fail")
    assert fail.get("http") == "403"
    assert "Required permission denied" in fail.text
    assert ("action", "poweroff", "start") in r.steps()  # the chain goes on


@pytest.mark.pure
def test_api_that_never_answers_is_abandoned_at_the_deadline(tmp_path: Path) -> None:
    release = threading.Event()
    api = FakeApi(hang=release)
    clock = FakeClock(real_slice=0.02)
    r = rig(tmp_path, "delete", api=api, clock=clock, linger=0, api_deadline=20.0)
    try:
        r.chain.execute("ladder", 10, 10)
    finally:
        release.set()
    to = next(e for e in r.events() if e.get("step") == "delete" and e.get("status") == "timeout")
    assert 20000 <= int(to.get("ms") or 0) <= 25000
    assert ("action", "poweroff", "start") in r.steps()


@pytest.mark.pure
def test_no_cached_identity_skips_the_api_but_not_the_chain(tmp_path: Path) -> None:
    r = rig(tmp_path, "delete", instance=None, linger=0)
    r.chain.execute("ladder", 10, 10)
    assert ("action", "delete", "skip") in r.steps()
    assert r.api.calls == []
    assert ("action", "poweroff", "start") in r.steps()


@pytest.mark.pure
def test_dry_run_reports_the_chain_the_default_action_would_run(tmp_path: Path) -> None:
    cfg = cfgmod.Config()
    real = rig(tmp_path / "real", cfg.agent.action)
    dry = rig(tmp_path / "dry", "dry-run")
    assert dry.chain.plan() == real.chain.plan()  # the default config, switched to dry-run


@pytest.mark.pure
def test_dry_run_never_runs_a_real_action(tmp_path: Path) -> None:
    r = rig(tmp_path, "dry-run", linger=10.0, dry_run_op="delete")
    r.chain.execute("ladder", 10, 10)
    assert r.runner.calls == []
    assert r.kernel.calls == []
    assert r.api.calls == []
    dry = [(s, st) for e, s, st in r.steps() if e == "action" and st == "dry_run"]
    assert dry == [
        ("delete", "dry_run"),
        ("poweroff", "dry_run"),
        ("force", "dry_run"),
        ("kernel", "dry_run"),
    ]
    texts = [e.text for e in r.events() if e.get("status") == "dry_run"]
    assert texts[0] == "dry-run: would call instances.delete on sim-vm-1"
    assert texts[1] == "dry-run: would run systemctl poweroff"
    assert r.clock.monotonic() - 1000.0 == pytest.approx(10.0)  # lingered, never waited on power
    # its own decision event: no reader takes the rehearsal for a shutdown
    names = [e.event for e in r.events()]
    assert "shutdown" not in names and names[0] == "dry_run_shutdown"


@pytest.mark.pure
def test_default_cache_reader_uses_the_state_dir(tmp_path: Path) -> None:
    save_instance_cache(tmp_path, INST)
    cfg = make_cfg(tmp_path, "dry-run", linger=0, dry_run_op="delete")
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=SYNTH_KEY)
    chain = ActionChain.from_config(cfg, em, lambda: None, runner=FakeRunner(), kernel=FakeKernel())
    chain.execute("ladder", 10, 10)
    dry = [protocol.decode_line(x, pin=SYNTH_KEY.public) for x in sink.lines]
    assert any(isinstance(e, protocol.Event) and e.get("inst") == "sim-vm-1" for e in dry)


@pytest.mark.pure
def test_very_long_names_never_break_the_chain(tmp_path: Path) -> None:
    long = InstanceInfo("p" * 30, "z" * 60, "n" * 63, "1")
    r = rig(tmp_path, "delete", instance=long, linger=0)
    r.chain.execute("ladder", 10, 10)
    assert all(len(x) <= protocol.MAX_LINE for x in r.sink.lines)
    assert ("action", "delete", "ok") in r.steps()


@pytest.mark.pure
def test_a_failing_keepalive_does_not_stop_the_chain(tmp_path: Path) -> None:
    r = rig(tmp_path, linger=10)

    def boom() -> None:
        raise OSError("notify socket gone")

    r.chain.keepalive = boom
    r.chain.execute("ladder", 10, 10)
    assert r.steps()[-1][1] == "kernel"


@pytest.mark.pure
@given(
    attempts=st.integers(1, 10),
    deadline=st.floats(0.5, 120),
    jitter=st.floats(0, 0.999),
)
def test_retry_policy_is_bounded(attempts: int, deadline: float, jitter: float) -> None:
    p = ChainRetry(attempts, deadline)
    for n in range(2, attempts + 1):
        w = p.wait_before(n, jitter)
        assert 0 < w <= p.max_wait
    # Replay the loop of _api_attempts with always-retryable failures: never past the deadline.
    t, tries = 0.0, 0
    for n in range(1, attempts + 1):
        if n > 1:
            w = p.wait_before(n, jitter)
            if t + w >= deadline:
                break
            t += w
        tries += 1
    assert 1 <= tries <= attempts and t < deadline


@dataclass
class TimedApi(FakeApi):
    """A FakeApi that records the fake clock's time of each attempt."""

    clock: FakeClock = field(default_factory=FakeClock)
    times: list[float] = field(default_factory=list)

    def act(self, op: str, inst: InstanceInfo, request_id: str) -> ApiResult:
        self.times.append(self.clock.monotonic())
        return super().act(op, inst, request_id)


RATE_LIMITED = "Rate Limit Exceeded"


@pytest.mark.pure
@pytest.mark.parametrize(("asked", "waited"), [(20.0, 20.0), (1e6, 25.0), (float("inf"), 25.0)])
def test_a_rate_limited_delete_waits_what_the_api_asked_within_the_deadline(
    tmp_path: Path, asked: float, waited: float
) -> None:
    """The least wait (Retry-After, or the next quota interval) is honoured; one that would
    leave no whole attempt (api_timeout 5 s) before the deadline (30 s) is shortened to the last
    start that does: one late try, never past the deadline."""
    clock = FakeClock()
    api = TimedApi(
        script=[
            ApiResult(False, 403, RATE_LIMITED, retryable=True, wait_at_least=asked),
            ApiResult(True, 200, "operation-9"),
        ],
        clock=clock,
    )
    r = rig(
        tmp_path,
        "delete",
        api=api,
        clock=clock,
        linger=0,
        api_attempts=3,
        api_deadline=30.0,
        api_timeout=5.0,
    )
    r.chain.execute("ladder", 10, 10)
    assert len(api.times) == 2 and api.times[1] - api.times[0] == pytest.approx(waited)
    ok = next(e for e in r.events() if e.get("step") == "delete" and e.get("status") == "ok")
    assert ok.get("tries") == "2"


@pytest.mark.pure
@given(
    attempts=st.integers(1, 10),
    deadline=st.floats(0.5, 120),
    attempt_time=st.floats(0, 60),
    jitter=st.floats(0, 0.999),
    asked=st.lists(
        st.none() | st.floats(0, 1e9) | st.sampled_from([math.inf, math.nan]),
        min_size=10,
        max_size=10,
    ),
)
def test_chain_retry_never_crosses_its_deadline_whatever_the_api_asks(
    attempts: int, deadline: float, attempt_time: float, jitter: float, asked: list[float | None]
) -> None:
    p = ChainRetry(attempts, deadline, attempt_time=attempt_time)
    t = 0.0
    for n in range(2, attempts + 1):
        w = p.next_wait(n, jitter, t, asked[n - 1])
        if w is None:
            assert t + p.wait_before(n, jitter) >= deadline  # stops only when it must
            break
        assert w >= p.wait_before(n, jitter)  # never shorter than the back-off
        hint = asked[n - 1]
        # fits: the attempt after it still starts before the deadline (strict, as `t < deadline`
        # below: a wait ending exactly at the deadline leaves no time for the attempt)
        if hint is not None and hint == hint and t + hint + attempt_time < deadline:
            assert w >= hint  # a wait that fits is honoured in full
        t += w
        assert t < deadline


# -- end to end against real local servers (child process) --------------------------------------

CHILD = r"""
import json, os, sys, time
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.daemon.actions import ActionChain
from gce_watchdog.daemon.metawatch import MetadataWatcher
from gce_watchdog.vm.runtime import make_emitter

cfg = cfgmod.load(sys.argv[1])
kernel_log = sys.argv[2]


class FileKernel:  # stands in for reboot(2): never power off the test machine
    def poweroff(self, method):
        with open(kernel_log, "a") as f:
            f.write(method + "\n")
        return method + ": not in tests"


em, port = make_emitter(cfg)
try:
    w = MetadataWatcher.from_config(cfg, em)
    assert w.refresh_once(), "metadata identity not read"
    pings = []
    chain = ActionChain.from_config(
        cfg, em, lambda: pings.append(time.monotonic()), kernel=FileKernel()
    )
    t0 = time.monotonic()
    chain.execute("ladder", 10, 10)
    res = chain.last_result
    print(json.dumps({"pings": len(pings), "secs": time.monotonic() - t0,
                      "steps": [[s.step, s.status] for s in res.steps]}))
finally:
    port.close()
"""


@dataclass
class E2E:
    tmp: Path
    md: object
    api: object
    recorder: Path
    record: Path

    def config(self, action: str = "delete", **actions: object) -> Path:
        from gce_watchdog.testing.simgce import FakeMetadataServer

        md = self.md
        assert isinstance(md, FakeMetadataServer)
        a: dict[str, object] = {
            "linger": "0.3s",
            "repeat_every": "0.1s",
            "api_base": self.api.base_url,  # type: ignore[attr-defined]
            "api_timeout": "1s",
            "api_attempts": 2,
            "api_deadline": "3s",
            "poweroff_cmd": [str(self.recorder), "poweroff"],
            "force_cmd": [str(self.recorder), "force"],
            "poweroff_wait": "0.3s",
            "force_wait": "0.2s",
            "command_timeout": "5s",
            "kernel": ["reboot"],
        }
        a.update(actions)
        lines = [
            "[agent]",
            f'action = "{action}"',
            f'state_dir = "{self.tmp / "state"}"',
            f'run_dir = "{self.tmp / "run"}"',
            "[metadata]",
            f'url = "{md.url}"',
            "[serial]",
            f'device = "{self.tmp / "serial.log"}"',
            "[actions]",
        ]
        lines += [f"{k} = {json.dumps(v)}" for k, v in a.items()]
        path = self.tmp / "config.toml"
        (self.tmp / "serial.log").touch()  # the "serial device" (a missing one is unusable)
        path.write_text("\n".join(lines) + "\n")
        return path

    def run(self, cfg: Path) -> tuple[dict[str, object], list[protocol.Event]]:
        from gce_watchdog.testing.simgce import FakeMetadataServer

        md = self.md
        assert isinstance(md, FakeMetadataServer)
        env = dict(os.environ)
        env["GCE_METADATA_HOST"] = f"127.0.0.1:{md.port}"
        env["GCE_METADATA_IP"] = f"127.0.0.1:{md.port}"
        env["PYTHONPATH"] = str(REPO / "agent")
        p = subprocess.run(
            [sys.executable, "-c", CHILD, str(cfg), str(self.tmp / "kernel.log")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=REPO,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        summary = json.loads(p.stdout.strip().splitlines()[-1])
        events, stats = protocol.decode_all((self.tmp / "serial.log").read_bytes())
        assert stats.rejected == 0 and stats.forged == 0
        # the watcher's line when it learns the identity (test_metawatch); the chain's follow
        return summary, [e for e in events if e.event not in ("instance", "key")]


@pytest.fixture
def e2e(tmp_path: Path) -> Iterator[E2E]:
    from gce_watchdog.testing.simcompute import FakeComputeAPI
    from gce_watchdog.testing.simgce import TOKEN, FakeMetadataServer

    record = tmp_path / "argv.log"
    recorder = tmp_path / "record.sh"
    # Records its argv, so the test sees which power-off commands ran and in which order.
    recorder.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\n')
    recorder.chmod(recorder.stat().st_mode | stat.S_IXUSR)
    info = spot_vm_info()
    with FakeMetadataServer(info=info) as md, FakeComputeAPI(token=TOKEN, hang_s=20) as api:
        add_spot_vm(api)
        yield E2E(tmp_path, md, api, recorder, record)


def _actions(events: list[protocol.Event]) -> list[tuple[str | None, str | None]]:
    return [(e.get("step"), e.get("status")) for e in events if e.event == "action"]


@pytest.mark.process
def test_e2e_api_succeeds(e2e: E2E) -> None:
    summary, events = e2e.run(e2e.config("delete"))
    assert events[0].event == "shutdown"
    assert events[0].get("chain") == "linger+delete+poweroff+force+kernel"
    assert _actions(events) == FULL_CHAIN
    calls = e2e.api.calls_to("delete")  # type: ignore[attr-defined]
    assert len(calls) == 1
    c = calls[0]
    assert c.authorized and c.status == 200
    assert c.path == "/compute/v1/projects/sim-project/zones/us-central1-a/instances/sim-vm-1"
    start = next(e for e in events if e.get("step") == "delete" and e.get("status") == "start")
    assert c.query["requestId"] == start.get("rid")
    assert e2e.api.instance("sim-vm-1").deleted  # type: ignore[attr-defined]
    assert e2e.record.read_text().splitlines() == ["poweroff", "force"]
    assert (e2e.tmp / "kernel.log").read_text().split() == ["reboot"]
    assert int(str(summary["pings"])) >= 3
    # The metadata server handed out the token google-auth used.
    assert e2e.md.count("/service-accounts/default/token") >= 1  # type: ignore[attr-defined]


@pytest.mark.process
def test_e2e_api_hangs_and_the_chain_moves_on_within_its_deadline(e2e: E2E) -> None:
    from gce_watchdog.testing.simcompute import Fault

    e2e.api.set_fault("delete", Fault.HANG)  # type: ignore[attr-defined]
    _summary, events = e2e.run(e2e.config("delete"))
    start = next(e for e in events if e.get("step") == "delete" and e.get("status") == "start")
    end = next(e for e in events if e.get("step") == "delete" and e.get("status") != "start")
    assert end.get("status") == "timeout"
    assert (end.ts_ms - start.ts_ms) / 1000 <= 3.0 + 1.0  # api_deadline + line overhead
    assert ("poweroff", "start") in _actions(events)
    # The fake records a call when its handler returns: release the hanging ones, then look.
    api = e2e.api
    api.close()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while not api.calls_to("delete") and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    calls = api.calls_to("delete")  # type: ignore[attr-defined]
    assert 1 <= len(calls) <= 2  # api_attempts = 2, each bounded by api_timeout = 1 s
    assert len({c.query["requestId"] for c in calls}) == 1


@pytest.mark.process
def test_e2e_api_refuses_403(e2e: E2E) -> None:
    from gce_watchdog.testing.simcompute import Fault

    e2e.api.set_fault("stop", Fault.REFUSE)  # type: ignore[attr-defined]
    _, events = e2e.run(e2e.config("stop"))
    end = next(e for e in events if e.get("step") == "stop" and e.get("status") != "start")
    assert (end.get("status"), end.get("http"), end.get("tries")) == ("fail", "403", "1")
    assert len(e2e.api.calls_to("stop")) == 1  # type: ignore[attr-defined]
    assert e2e.api.instance("sim-vm-1").status == "RUNNING"  # type: ignore[attr-defined]
    assert ("poweroff", "start") in _actions(events)


@pytest.mark.process
def test_e2e_delete_rate_limited_403_is_retried_and_deletes(e2e: E2E) -> None:
    """GCE answers a rate limit with 403 rateLimitExceeded (its API rate-limit docs): a mass
    recovery where many VMs delete at once. The chain waits the Retry-After and deletes."""
    from gce_watchdog.testing.simcompute import Fault

    e2e.api.set_fault("delete", Fault.RATE_LIMIT, count=1)  # type: ignore[attr-defined]
    # a wide deadline: the test is about the retry, not about a loaded machine's speed
    cfg = e2e.config("delete", api_timeout="5s", api_attempts=3, api_deadline="30s")
    _, events = e2e.run(cfg)
    end = next(e for e in events if e.get("step") == "delete" and e.get("status") != "start")
    assert (end.get("status"), end.get("http"), end.get("tries")) == ("ok", "200", "2")
    calls = e2e.api.calls_to("delete")  # type: ignore[attr-defined]
    assert [c.status for c in calls] == [403, 200]
    assert len({c.query["requestId"] for c in calls}) == 1
    assert e2e.api.instance("sim-vm-1").deleted  # type: ignore[attr-defined]
    assert ("poweroff", "start") in _actions(events)  # the chain goes on to the power-off


@pytest.mark.process
def test_e2e_poweroff_fails_and_the_chain_escalates(e2e: E2E) -> None:
    cfg = e2e.config("poweroff", poweroff_cmd=["/bin/false"], kernel=["reboot"])
    _summary, events = e2e.run(cfg)
    acts = _actions(events)
    assert acts[acts.index(("poweroff", "start")) + 1] == ("poweroff", "fail")
    assert acts[acts.index(("poweroff", "fail")) + 1] == ("force", "start")
    assert e2e.record.read_text().splitlines() == ["force"]
    assert e2e.api.calls == []  # type: ignore[attr-defined]
    assert ("kernel", "fail") in acts


@pytest.mark.process
def test_e2e_dry_run_touches_nothing(e2e: E2E) -> None:
    _, events = e2e.run(e2e.config("dry-run", dry_run_op="delete"))  # rehearse a delete
    decisions = [e for e in events if e.event == "dry_run_shutdown" and not e.get("rep")]
    assert len(decisions) == 1  # the linger's repeats carry rep=
    assert "shutdown" not in [e.event for e in events]
    # every reader: a dry run is never a failover (the VM keeps running)
    from gce_watchdog.poller.timeline import parse_bytes
    from gce_watchdog.poller.verdict import InstanceState, Policy

    tl = parse_bytes((e2e.tmp / "serial.log").read_bytes(), rx=1e9)
    v = tl.judge(InstanceState("RUNNING"), 1e9, Policy())
    assert not v.failover and "dry-run shutdown decision" in v.reason, v.reason
    assert not e2e.record.exists()
    assert not (e2e.tmp / "kernel.log").exists()
    assert e2e.api.calls == []  # type: ignore[attr-defined]
    assert {s for s, st in _actions(events) if st == "dry_run"} == {
        "delete",
        "poweroff",
        "force",
        "kernel",
    }


# -- restart continuity against a real daemon process -------------------------------------------


@pytest.mark.process
def test_sigkill_at_rung_5_then_restart_shuts_down_at_10_not_15(tmp_path: Path) -> None:
    import signal

    from gce_watchdog.testing.simgce import SimGCE

    with SimGCE() as sim:
        cfg = agent_config(
            tmp_path,
            sim,
            {"threshold": 10, "heartbeat_every": None},
            actions={"dry_run_op": "none"},
            watch={"enabled": False},
        )
        serial = tmp_path / "ttyS0"
        cmd = gcewd_argv("run", "--config", str(cfg))
        env = agent_env()

        def evs() -> list[protocol.Event]:
            return read_events(serial)

        def wait(pred: Callable[[], object], timeout: float = 30.0) -> bool:
            return wait_for(pred, timeout, interval=0.02)

        sim.outage(True)
        first = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
        try:
            assert wait(lambda: any(e.get("rung") == "5/10" for e in evs() if e.event == "tick"))
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(5)
        killed_at = [e.get("rung") for e in evs() if e.event == "tick"][-1]
        second = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
        try:
            assert wait(lambda: any(e.event == "dry_run_shutdown" for e in evs()))
        finally:
            second.send_signal(signal.SIGTERM)
            try:
                second.wait(15)
            except subprocess.TimeoutExpired:
                second.kill()
                second.wait(5)
    all_ev = evs()
    starts = [e for e in all_ev if e.event == "start"]
    assert len(starts) == 2
    # The restarted agent continues where it was. A tick saves its rung before it writes its
    # line (a restart never forgets a climb): a SIGKILL between the two, which no test can time,
    # resumes one rung above the last line, whose own line was never written. Both are exact.
    n = int(str(killed_at).split("/")[0])
    resumed = int(str(starts[1].get("rung")).split("/")[0])
    assert n >= 5 and resumed in (n, n + 1), (killed_at, starts[1].get("rung"))
    climbs = [e.get("rung") for e in all_ev if e.event == "tick" and "FAILED (" in e.text]
    assert climbs == [f"{i}/10" for i in range(1, n + 1)] + [
        f"{i}/10" for i in range(resumed + 1, 11)
    ]
    # a dry run: its own decision event (never `shutdown`), once
    shutdowns = [e for e in all_ev if e.event == "dry_run_shutdown" and not e.get("rep")]
    assert len(shutdowns) == 1 and shutdowns[0].get("rung") == "10/10"
    assert not [e for e in all_ev if e.event == "shutdown"]


# -- a stop asked for during the linger ---------------------------------------------------------


class StopAfter(FakeClock):
    """A fake clock whose waits set ``stop`` once ``after`` fake seconds have passed (a SIGTERM
    arriving then)."""

    def __init__(self, stop: threading.Event, after: float) -> None:
        super().__init__(real_slice=0.0)
        self.stop, self.at = stop, self.t + after

    def wait(self, event: threading.Event, seconds: float) -> bool:
        got = super().wait(event, seconds)
        if self.monotonic() >= self.at:
            self.stop.set()
        return got or event.is_set()


@pytest.mark.pure
@pytest.mark.parametrize("action", ["poweroff", "delete", "dry-run"])
def test_a_stop_during_the_linger_ends_the_chain_there(tmp_path: Path, action: str) -> None:
    stop = threading.Event()
    r = rig(tmp_path, action, clock=StopAfter(stop, 7.0))
    r.chain.stop = stop
    marks: list[str] = []
    with pytest.raises(ChainStopped):
        r.chain.execute("ladder", 10, 10, progress=marks.append)
    assert marks == ["shutdown", "linger"], "nothing after the linger is started"
    assert [(s, st) for e, s, st in r.steps() if e == "action"] == [("linger", "start")]
    assert r.runner.calls == [] and r.api.calls == [] and r.kernel.calls == []
    assert 7.0 <= r.clock.monotonic() - 1000.0 < 20.0, "stopped at the stop, not at the end"


@pytest.mark.pure
def test_a_stop_before_the_linger_ends_it_at_once_and_past_it_the_chain_goes_on(
    tmp_path: Path,
) -> None:
    stop = threading.Event()
    stop.set()
    r = rig(tmp_path, "poweroff", clock=FakeClock(real_slice=0.0))
    r.chain.stop = stop
    with pytest.raises(ChainStopped):
        r.chain.execute("ladder", 10, 10)
    assert r.clock.monotonic() == 1000.0 and r.runner.calls == []
    # resumed past the linger: a stop changes nothing, the chain acts
    r2 = rig(tmp_path / "2", "poweroff", clock=FakeClock(real_slice=0.0))
    r2.chain.stop = stop
    r2.chain.execute("ladder", 10, 10, resume_at="poweroff")
    assert r2.runner.calls[0] == ["systemctl", "poweroff"]


@pytest.mark.pure
def test_a_dry_run_says_its_decision_once_through_the_linger(tmp_path: Path) -> None:
    r = rig(tmp_path, "dry-run", clock=FakeClock(real_slice=0.0))
    r.chain.execute("ladder", 10, 10)
    names = [e.event for e in r.events()]
    assert names.count("dry_run_shutdown") == 1 and "shutdown" not in names
    done = next(e for e in r.events() if e.get("step") == "linger" and e.get("status") == "ok")
    assert done.get("reps") == "0" and int(done.get("ms") or 0) >= 20_000
    # a real chain repeats it (the poller must read it before the VM goes)
    r2 = rig(tmp_path / "2", "poweroff", clock=FakeClock(real_slice=0.0))
    r2.chain.execute("ladder", 10, 10)
    assert len([e for e in r2.events() if e.event == "shutdown" and e.get("rep")]) == 3
