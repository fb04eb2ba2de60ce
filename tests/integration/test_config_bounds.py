"""Config values that would disable the agent are refused (issue 16, item 2).

Each value below was accepted by `config check` and then crashed the agent, disarmed it or flooded
the console. Now each is refused with exit 78 and its reason. `config check` reads only regular
files of bounded size. The property: whatever `config check` accepts, a tick and the whole chain
run without an exception (fakes for the edges).
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
from gce_watchdog.daemon.actions import ActionChain, ApiResult, RunResult
from gce_watchdog.daemon.ladder import LadderState
from gce_watchdog.daemon.metawatch import InstanceInfo
from gce_watchdog.daemon.service import Agent, Deps
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol
from hypothesis import given
from hypothesis import strategies as st
from kit.cli import gcewd
from kit.clocks import ChainClock
from kit.fakes import FakeClock, FakeNotifier, MemoryLadderStore, ScriptedProber, result

INF = float("inf")

# (section, key, value, what the message must say; an infinite duration is refused by the
# duration parser itself, whose message names the value)
REFUSED = [
    ("agent", "interval", INF, "inf"),
    ("agent", "interval", 1e308, "at most 1h"),
    ("agent", "interval", 9.4e9, "at most 1h"),
    ("agent", "interval", "1ms", "at least 100ms"),
    ("agent", "interval", 0.000001, "at least 100ms"),
    ("agent", "interval", 3601, "at most 1h"),
    ("agent", "probe_timeout", INF, "inf"),
    ("agent", "threshold", 2**63 - 1, "between 1 and 10000"),
    ("agent", "threshold", 10_001, "between 1 and 10000"),
    ("agent", "boot_grace", INF, "inf"),
    ("egress", "dns_timeout", INF, "inf"),
    ("serial", "sync_timeout", INF, "inf"),
    ("serial", "sync_timeout", 3600, "at most 60s"),
    ("memory", "period", INF, "inf"),
    ("memory", "period", 10**400, "finite"),
    ("memory", "serial_every", "1ms", "at least 100ms"),
    ("memory", "band_gib", INF, "finite"),
    ("actions", "linger", INF, "inf"),
    ("actions", "linger", 1e9, "at most 1h"),
    ("actions", "poweroff_wait", INF, "inf"),
    ("actions", "force_wait", 1e12, "at most 1h"),
    ("actions", "api_deadline", INF, "inf"),
    ("actions", "api_timeout", INF, "inf"),
    ("actions", "command_timeout", INF, "inf"),
    ("actions", "repeat_every", "1ms", "at least 100ms"),
    ("watch", "disarm_hold", INF, "inf"),
    ("watch", "disarm_hold", "30d", "every disarm expires"),
    ("watch", "refresh", INF, "inf"),
    ("watch", "request_timeout", INF, "inf"),
    # trusting metadata is a yes/no the operator writes on purpose: no truthy strings
    ("watch", "trust_metadata", "yes", "expected bool"),
    ("watch", "trust_metadata", 1, "expected bool"),
]


@pytest.mark.pure
@pytest.mark.parametrize(("section", "key", "value", "why"), REFUSED)
def test_each_disabling_value_is_refused_with_its_reason(
    section: str, key: str, value: object, why: str
) -> None:
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.from_dict({section: {key: value}}, "test")
    msgs = {e.path: e.message for e in ei.value.errors}
    assert f"{section}.{key}" in msgs, msgs
    assert why in msgs[f"{section}.{key}"]


@pytest.mark.pure
def test_the_bounds_themselves_are_accepted() -> None:
    cfg = cfgmod.from_dict(
        {
            "agent": {"interval": "100ms", "probe_timeout": "90ms", "threshold": 10_000},
            "egress": {"dns_timeout": "50ms"},
            "watch": {"disarm_hold": "24h"},
            "actions": {"linger": "1h", "repeat_every": "100ms"},
        }
    )
    assert cfg.agent.interval == pytest.approx(0.1) and cfg.agent.threshold == 10_000
    cfgmod.from_dict({"agent": {"interval": "1h", "probe_timeout": "59m"}})


def _check(path: Path | str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return gcewd("config", "check", str(path), timeout=timeout)


@pytest.mark.process
def test_config_check_cli_refuses_every_value_at_once_with_exit_78(tmp_path: Path) -> None:
    p = tmp_path / "config.toml"
    p.write_text(
        "[agent]\ninterval = inf\nthreshold = 9223372036854775807\n"
        "[serial]\nsync_timeout = inf\n[memory]\nperiod = inf\n"
        "[actions]\nlinger = inf\npoweroff_wait = inf\napi_deadline = inf\n"
        "[watch]\ndisarm_hold = inf\n"
    )
    r = _check(p)
    assert r.returncode == 78, r
    for key in (
        "agent.interval",
        "agent.threshold",
        "serial.sync_timeout",
        "memory.period",
        "actions.linger",
        "actions.poweroff_wait",
        "actions.api_deadline",
        "watch.disarm_hold",
    ):
        assert key in r.stderr
    assert "Traceback" not in r.stderr


# -- file kinds ----------------------------------------------------------------------------------


@pytest.mark.process
def test_a_fifo_with_no_writer_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    r = _check(fifo, timeout=30)  # used to block forever
    assert r.returncode == 78
    assert "is a FIFO (named pipe), not a regular file" in r.stderr


@pytest.mark.process
def test_a_link_to_dev_zero_is_refused_without_reading_it(tmp_path: Path) -> None:
    link = tmp_path / "config.toml"
    link.symlink_to("/dev/zero")
    r = _check(link, timeout=30)
    assert r.returncode == 78
    assert "is a character device, not a regular file" in r.stderr


@pytest.mark.process
def test_a_directory_is_refused(tmp_path: Path) -> None:
    r = _check(tmp_path)
    assert r.returncode == 78 and "is a directory" in r.stderr


@pytest.mark.process
def test_a_link_to_a_regular_file_is_read(tmp_path: Path) -> None:
    real = tmp_path / "real.toml"
    real.write_text("[agent]\ninterval = 10\n")
    (tmp_path / "config.toml").symlink_to(real)
    r = _check(tmp_path / "config.toml")
    assert r.returncode == 0 and "OK" in r.stdout


@pytest.mark.process
def test_an_oversized_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "config.toml"
    p.write_text("# padding\n" * 200_000)  # 2 MB of comments: valid TOML, not a config
    r = _check(p)
    assert r.returncode == 78 and "larger than 1024 KiB" in r.stderr


@pytest.mark.process
def test_deep_nesting_is_refused_without_a_traceback(tmp_path: Path) -> None:
    p = tmp_path / "config.toml"
    p.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    r = _check(p)
    assert r.returncode == 78, r.stderr[-500:]
    assert "nested too deeply" in r.stderr and "Traceback" not in r.stderr


# -- the property: accepted means it runs --------------------------------------------------------


class _Api:
    def act(self, op: str, inst: InstanceInfo, request_id: str) -> ApiResult:
        return ApiResult(False, 503, "unavailable", retryable=True)


class _Kernel:
    def poweroff(self, method: str) -> str:
        return "EPERM (fake)"


NASTY = st.sampled_from(
    [INF, -INF, float("nan"), 1e308, 9.4e9, -1, 0, "1us", 10**30, 2**63 - 1, "30d"]
)


def _dur(lo: float, hi: float) -> st.SearchStrategy[object]:
    """Values inside the bounds, and the bounds themselves (a nasty one is mixed in below)."""
    return st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi]))


_KEYS: dict[tuple[str, str], st.SearchStrategy[object]] = {
    ("agent", "threshold"): st.one_of(st.integers(1, 10_000), st.sampled_from([1, 10_000])),
    ("agent", "action"): st.sampled_from(["poweroff", "delete", "stop", "dry-run"]),
    ("agent", "boot_grace"): _dur(0, 86400),
    ("serial", "sync_timeout"): _dur(0.001, 60),
    ("actions", "linger"): _dur(0, 3600),
    ("actions", "repeat_every"): _dur(0.1, 30),
    ("actions", "api_timeout"): _dur(0.01, 600),
    ("actions", "api_deadline"): _dur(0.01, 600),
    ("actions", "api_attempts"): st.integers(1, 100),
    ("actions", "poweroff_wait"): _dur(0.01, 3600),
    ("actions", "force_wait"): _dur(0.01, 3600),
    ("actions", "command_timeout"): _dur(0.01, 600),
    ("actions", "kernel"): st.sampled_from([[], ["reboot"], ["reboot", "sysrq"]]),
    ("watch", "disarm_hold"): _dur(0.01, 86400),
    ("watch", "trust_metadata"): st.booleans(),
    ("memory", "period"): _dur(0.01, 86400),
}


@st.composite
def raw_configs(draw: st.DrawFn) -> dict[str, dict[str, object]]:
    raw: dict[str, dict[str, object]] = {}
    # The timeouts of a tick, drawn as fractions of the interval (the rule is "below it").
    if draw(st.booleans()):
        interval = draw(_dur(0.1, 3600))
        raw["agent"] = {"interval": interval}
        if isinstance(interval, float) and 0.1 <= interval <= 3600:
            pt = interval * draw(st.floats(0.01, 1.0))
            raw["agent"]["probe_timeout"] = pt
            raw["egress"] = {"dns_timeout": pt * draw(st.floats(0.01, 1.0))}
    for (section, key), strat in _KEYS.items():
        if draw(st.integers(0, 2)) == 0:
            raw.setdefault(section, {})[key] = draw(strat)
    if draw(st.integers(0, 3)) == 0:  # now and then one value out of every bound
        section, key = draw(st.sampled_from(sorted(_KEYS)))
        raw.setdefault(section, {})[key] = draw(NASTY)
    return raw


@pytest.mark.pure
@given(raw=raw_configs())
def test_any_accepted_config_runs_a_tick_and_the_whole_chain(
    raw: dict[str, dict[str, object]],
) -> None:
    try:
        cfg = cfgmod.from_dict(raw, "property")
    except cfgmod.InvalidConfig:
        return  # refused with exit 78 by `config check`: fine
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = cfgmod.replace(cfg, agent={"state_dir": d})
        fc = FakeClock()
        sink = MemorySink()
        em = Emitter(sink, SeqAllocator(tmp, "0000abcd"), "0000abcd", fc.wall, key=SYNTH_KEY)
        chain = ActionChain.from_config(
            cfg,
            em,
            lambda: None,
            runner=lambda argv, timeout: RunResult(0),
            clock=ChainClock(fc, real_slice=2.0),
            api=_Api(),
            kernel=_Kernel(),
            instance=lambda: InstanceInfo("p", "z", "vm", "1"),
            jitter=lambda: 0.5,
        )
        deps = Deps(
            emitter=em,
            prober=ScriptedProber([result("fail", "fail")], fc),
            clock=fc,
            notifier=FakeNotifier(),
            # in memory: the property is about the loop and the chain, and the real store's
            # fsyncs were most of its time (about 10 per example; seconds on a loaded disk)
            store=MemoryLadderStore("b1"),
            on_shutdown=chain.execute,
        )
        agent = Agent.from_config(cfg, deps)
        assert deps.store.save(LadderState(rung=cfg.agent.threshold - 1))
        agent.run(threading.Event(), max_ticks=1)  # start line, the deciding tick, the chain
        assert agent.tick_errors == 0
        ours = [x for x in sink.lines if " key pk=" not in x]
        evs = [protocol.decode_line(x, pin=SYNTH_KEY.public) for x in ours]
        assert all(isinstance(e, protocol.Event) for e in evs)
        steps = [(e.get("step"), e.get("status")) for e in evs if isinstance(e, protocol.Event)]
        assert not [s for s in steps if s[1] == "error"], steps
        last = "kernel" if cfg.actions.kernel else "force"
        assert any(s == last for s, _ in steps), steps  # the chain reached its last step
