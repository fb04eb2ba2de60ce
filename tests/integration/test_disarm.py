"""Disarm switch (daemon/disarm.py): local file with an expiry, metadata attribute, CLI."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from gce_watchdog.daemon.disarm import (
    MAX_DISARM_S,
    DisarmGate,
    disarm_path,
    disarm_status,
)
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol
from hypothesis import given
from hypothesis import strategies as st
from kit.cli import agent_env, gcewd
from kit.events import sink_events

T0 = 1_800_000_000.0  # a fixed wall clock for the pure checks


def cfg_for(tmp: Path) -> cfgmod.Config:
    return cfgmod.from_dict({"agent": {"state_dir": str(tmp)}})


def write_local(cfg: cfgmod.Config, set_at: float, until: float) -> None:
    disarm_path(cfg.agent.state_dir).parent.mkdir(parents=True, exist_ok=True)
    disarm_path(cfg.agent.state_dir).write_text(
        json.dumps({"set_at": set_at, "until": until, "reason": "x"})
    )


@pytest.mark.pure
def test_no_file_is_armed(tmp_path: Path) -> None:
    assert disarm_status(cfg_for(tmp_path).agent.state_dir, T0, False) == (True, "armed")


@pytest.mark.pure
def test_local_disarm_until_expiry_then_rearms_by_itself(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    write_local(cfg, T0, T0 + 7200)
    armed, why = disarm_status(cfg.agent.state_dir, T0 + 10, False)
    assert not armed and why.startswith("local-until-")
    assert disarm_status(cfg.agent.state_dir, T0 + 7199, False)[0] is False
    assert disarm_status(cfg.agent.state_dir, T0 + 7200, False) == (True, "expired")


@pytest.mark.pure
def test_metadata_disarm_is_honoured(tmp_path: Path) -> None:
    assert disarm_status(cfg_for(tmp_path).agent.state_dir, T0, True) == (False, "metadata")


@pytest.mark.pure
def test_a_file_claiming_more_than_the_cap_is_capped(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    write_local(cfg, T0, T0 + 10 * 86400)
    assert disarm_status(cfg.agent.state_dir, T0 + MAX_DISARM_S - 1, False)[0] is False
    assert disarm_status(cfg.agent.state_dir, T0 + MAX_DISARM_S, False) == (True, "expired")


@pytest.mark.pure
def test_a_disarm_from_the_future_is_not_trusted(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    write_local(cfg, T0 + 3600, T0 + 7200)  # the clock went back an hour since it was set
    assert disarm_status(cfg.agent.state_dir, T0, False) == (True, "expired")


@pytest.mark.pure
@pytest.mark.parametrize(
    "content",
    [
        "",
        "{",
        "[]",
        '{"until": "soon"}',
        '{"set_at": 1}',
        '{"set_at": 1%s, "until": 1}' % ("0" * 400),  # an int float() cannot hold
    ],
)
def test_a_bad_file_never_disarms(tmp_path: Path, content: str) -> None:
    cfg = cfg_for(tmp_path)
    disarm_path(cfg.agent.state_dir).write_text(content)
    assert disarm_status(cfg.agent.state_dir, T0, False) == (True, "bad-disarm-file")


@pytest.mark.pure
@given(
    set_off=st.floats(-1e6, 1e6),
    length=st.floats(-1e6, 1e7),
    now_off=st.floats(-2e6, 2e7),
)
def test_property_disarm_always_expires(set_off: float, length: float, now_off: float) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cfg = cfg_for(Path(d))
        write_local(cfg, T0 + set_off, T0 + set_off + length)
        armed, _ = disarm_status(cfg.agent.state_dir, T0 + now_off, False)
        # Never disarmed at or after set_at + 24 h, whatever the file says.
        if now_off >= set_off + MAX_DISARM_S:
            assert armed


def _gate(tmp: Path, md: list[bool], wall: list[float]) -> tuple[DisarmGate, MemorySink]:
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp, "0badc0de"), "0badc0de", key=SYNTH_KEY)
    return DisarmGate.from_config(cfg_for(tmp), em, lambda: md[0], lambda: wall[0]), sink


def _events(sink: MemorySink) -> list[tuple[str, str | None, str | None]]:
    return [(ev.event, ev.get("src"), ev.get("why")) for ev in sink_events(sink)]


@pytest.mark.pure
def test_gate_reports_metadata_transitions_and_expiry(tmp_path: Path) -> None:
    md, wall = [False], [T0]
    gate, sink = _gate(tmp_path, md, wall)
    assert gate() == (True, "armed")
    md[0] = True
    assert gate() == (False, "metadata")
    assert gate() == (False, "metadata")  # no repeat line while nothing changes
    md[0] = False
    assert gate()[0] is True
    write_local(cfg_for(Path(gate.state_dir)), T0, T0 + 60)
    assert gate()[0] is False  # the CLI reported this one: no line from the gate
    wall[0] = T0 + 61
    assert gate() == (True, "expired")
    assert _events(sink) == [
        ("disarm", "metadata", "metadata"),
        ("arm", "metadata", "armed"),
        ("arm", "local", "expired"),
    ]


@pytest.mark.pure
def test_gate_reports_a_disarm_found_at_start(tmp_path: Path) -> None:
    md, wall = [False], [T0]
    gate, sink = _gate(tmp_path, md, wall)
    write_local(cfg_for(Path(gate.state_dir)), T0 - 10, T0 + 600)
    assert gate()[0] is False
    assert _events(sink)[0][:2] == ("disarm", "local")


@pytest.mark.pure
def test_gate_survives_a_broken_metadata_source(tmp_path: Path) -> None:
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=SYNTH_KEY)

    def broken() -> bool:
        raise RuntimeError("watcher not started")

    assert DisarmGate.from_config(cfg_for(tmp_path), em, broken, lambda: T0)() == (True, "armed")


# -- CLI (real processes, real files) ------------------------------------------------------------


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp / "config.toml"
    if not cfg.exists():
        (tmp / "serial.log").touch()  # the "serial device" (a missing one is unusable)
        cfg.write_text(
            f'[agent]\nstate_dir = "{tmp / "state"}"\nrun_dir = "{tmp / "run"}"\n'
            f'[serial]\ndevice = "{tmp / "serial.log"}"\n'
        )
    return gcewd(*args, "--config", str(cfg), env=agent_env())


@pytest.mark.process
def test_cli_disarm_then_arm(tmp_path: Path) -> None:
    t = time.time()
    p = _cli(tmp_path, "disarm", "--for", "2h", "--reason", "debugging the loader")
    assert p.returncode == 0, p.stderr
    assert "disarmed until" in p.stdout
    cfg = cfgmod.load(tmp_path / "config.toml")
    raw = json.loads(disarm_path(cfg.agent.state_dir).read_text())
    assert 7190 <= raw["until"] - t <= 7210
    assert disarm_status(cfg.agent.state_dir, time.time(), False)[0] is False
    p = _cli(tmp_path, "disarm", "--status")
    assert p.returncode == 0 and p.stdout.startswith("disarmed")
    p = _cli(tmp_path, "arm")
    assert p.returncode == 0, p.stderr
    assert not disarm_path(cfg.agent.state_dir).exists()
    events, stats = protocol.decode_all((tmp_path / "serial.log").read_bytes())
    assert stats.rejected == 0 and stats.forged == 0
    events = [e for e in events if e.event != "key"]
    assert [e.event for e in events] == ["disarm", "arm"]
    assert events[0].get("dur") == "7200s"
    assert events[0].text == "debugging the loader"
    assert events[1].get("was") == "disarmed"


@pytest.mark.process
@pytest.mark.parametrize("dur", ["25h", "0s", "soon", "-1h"])
def test_cli_refuses_bad_or_too_long_durations(tmp_path: Path, dur: str) -> None:
    p = _cli(tmp_path, "disarm", f"--for={dur}")
    assert p.returncode == 64  # EX_USAGE, like every command
    assert "--for" in p.stderr
    assert not (tmp_path / "state" / "disarm.json").exists()


@pytest.mark.process
def test_cli_disarm_needs_a_duration(tmp_path: Path) -> None:
    p = _cli(tmp_path, "disarm")
    assert p.returncode == 64 and "--for DURATION is required" in p.stderr
