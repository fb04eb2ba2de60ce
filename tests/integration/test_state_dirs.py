"""State and run directories are not trusted blindly (issue 16, item 3).

As root (these tests run as root; the ones that need it skip otherwise): a state or run dir owned
by another user (chown to nobody), writable by group or others, or a symlink is not used; lock,
counter and state files are opened with O_NOFOLLOW (a planted link's target is left alone); a run
dir that cannot be used means running without the lock (and saying why), never exit 75 with "a
second ladder"; a missing serial device is unusable, the fallback file is used and the device's
directory is never created. Real agent processes, real files.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gce_watchdog.lib.files import atomic_write, read_json
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.vm.console import SerialPort
from gce_watchdog.vm.state import SeqAllocator, read_phase, untrusted_dir
from gce_watchdog.wire import protocol
from kit.agent import LADDER_ONLY, SHORT_LADDER, agent_config, run_agent
from kit.events import read_events
from kit.paths import REPO
from kit.wait import wait_for

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the checks are root's)")


def nobody() -> int:
    return pwd.getpwnam("nobody").pw_uid


# -- the check itself ----------------------------------------------------------------------------


@pytest.mark.process
@root_only
def test_untrusted_dir_reasons(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir(mode=0o755)
    assert untrusted_dir(good) is None
    assert untrusted_dir(tmp_path / "absent") is None  # created by the agent itself
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, nobody(), -1)
    assert untrusted_dir(foreign) == f"is owned by uid {nobody()}, not root"
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    assert untrusted_dir(loose) == "is writable by group and others (mode 0777)"
    link = tmp_path / "link"
    link.symlink_to(good)
    assert untrusted_dir(link) == "is a symlink"
    assert untrusted_dir(foreign, euid=1000) is None  # not root: nothing to check


# -- O_NOFOLLOW ------------------------------------------------------------------------------------


@pytest.mark.pure
def test_planted_links_are_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / "seq").symlink_to(victim)
    seq = SeqAllocator(state, "0badc0de")
    assert [seq.next(), seq.next()] == [0, 1]  # an in-process count instead
    (state / "phase").symlink_to(victim)
    assert read_phase(state) == "unknown"
    (state / "ladder.json").symlink_to(victim)
    assert read_json(state / "ladder.json") is None
    # a link at the temporary name of an atomic write: refused, the target is untouched
    tmp_name = state / f".disarm.json.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp_name.symlink_to(victim)
    with pytest.raises(OSError):
        atomic_write(state / "disarm.json", b"{}")
    assert victim.read_text() == "precious\n"


# -- the missing serial device ---------------------------------------------------------------------


@pytest.mark.pure
def test_a_missing_device_is_unusable_and_its_directory_never_created(tmp_path: Path) -> None:
    device = tmp_path / "no-such-dir" / "ttyS0"
    fallback = tmp_path / "logs" / "serial.log"
    with SerialPort(str(device), str(fallback)) as port:
        assert port.target == str(fallback) and "No such file" in port.open_error
        assert port.write_line("hello", sync=True)
    assert not (tmp_path / "no-such-dir").exists()
    assert fallback.read_text() == "hello\n"


@pytest.mark.pure
def test_a_missing_device_in_an_existing_directory_is_not_created_either(tmp_path: Path) -> None:
    device = tmp_path / "ttyS0"
    with SerialPort(str(device), str(tmp_path / "fb.log")) as port:
        assert port.target.endswith("fb.log")
    assert not device.exists()


# -- real agent processes --------------------------------------------------------------------------


def _config(tmp: Path, sim: SimGCE, state: Path, run: Path) -> Path:
    return agent_config(
        tmp,
        sim,
        {**SHORT_LADDER, "state_dir": str(state), "run_dir": str(run)},
        actions={"dry_run_op": "none"},
        **LADDER_ONLY,
    )


def _run(cfg: Path, ticks: int = 4) -> subprocess.CompletedProcess[str]:
    return run_agent(cfg, "--max-ticks", str(ticks))


def _events(tmp: Path) -> list[protocol.Event]:
    return read_events(tmp / "ttyS0", forged_ok=False)


def _plant_disarm(state: Path) -> None:
    now = time.time()
    rec = {"set_at": now, "until": now + 3600, "reason": "planted", "by": "nobody"}
    (state / "disarm.json").write_text(json.dumps(rec))


@pytest.mark.process
@root_only
@pytest.mark.parametrize("kind", ["foreign", "symlink", "world-writable"])
def test_an_untrusted_state_dir_is_not_used_and_a_planted_disarm_does_nothing(
    tmp_path: Path, kind: str
) -> None:
    real = tmp_path / "planted"
    real.mkdir(mode=0o755)
    _plant_disarm(real)
    state = real
    if kind == "foreign":
        os.chown(real, nobody(), -1)
        os.chown(real / "disarm.json", nobody(), -1)
    elif kind == "symlink":
        state = tmp_path / "state"
        state.symlink_to(real)
    else:
        real.chmod(0o777)
    with SimGCE() as sim:
        cfg = _config(tmp_path, sim, state, tmp_path / "run")
        sim.outage(True)
        r = _run(cfg)
    assert r.returncode == 0, r.stderr
    assert f"state dir {state}" in r.stderr and "not used" in r.stderr
    evs = _events(tmp_path)
    warns = [e.get("what") for e in evs if e.event == "warn"]
    assert "state_dir" in warns
    # the private state dir is not the instance's: the boot is not counted there (issue 35.1)
    assert "bootcount" in warns and {e.get("bc") for e in evs} == {"-"}
    assert not (real / "boot.count").exists()
    names = [e.event for e in evs]
    # the planted disarm: ignored (a dry run decides with its own event)
    assert "dry_run_shutdown" in names and "would_shutdown" not in names
    assert not (real / "ladder.json").exists() and not (real / "seq").exists()
    private = r.stderr.split("state kept in ", 1)[1].split(" ", 1)[0]
    assert not Path(private).exists()  # the run's private state dir is removed at exit


@pytest.mark.process
@root_only
def test_a_trusted_state_dir_still_honours_its_disarm(tmp_path: Path) -> None:
    """The counterpart: the same planted file in a root-owned 0755 dir disarms (so the test
    above fails for the right reason)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    _plant_disarm(state)
    with SimGCE() as sim:
        cfg = _config(tmp_path, sim, state, tmp_path / "run")
        sim.outage(True)
        r = _run(cfg)
    assert r.returncode == 0, r.stderr
    names = [e.event for e in _events(tmp_path)]
    assert "would_shutdown" in names and "dry_run_shutdown" not in names


@pytest.mark.process
@root_only
def test_a_foreign_run_dir_runs_without_the_lock_and_says_why(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chown(run, nobody(), -1)
    with SimGCE() as sim:
        cfg = _config(tmp_path, sim, tmp_path / "state", run)
        r = _run(cfg, ticks=2)
    assert r.returncode == 0, r.stderr
    assert f"run dir {run} is owned by uid {nobody()}" in r.stderr
    assert "running without the agent lock" in r.stderr
    assert "second ladder" not in r.stderr
    assert not (run / "agent.lock").exists()
    assert any(e.event == "warn" and e.get("what") == "run_dir" for e in _events(tmp_path))


@pytest.mark.process
def test_an_unusable_run_dir_runs_without_the_lock_not_exit_75(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    with SimGCE() as sim:
        cfg = _config(tmp_path, sim, tmp_path / "state", tmp_path / "file" / "run")
        r = _run(cfg, ticks=2)
    assert r.returncode == 0, r.stderr
    assert "running without the agent lock" in r.stderr and "second ladder" not in r.stderr


@pytest.mark.process
def test_a_planted_lock_link_is_not_truncated_and_the_agent_still_runs(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    (run / "agent.lock").symlink_to(victim)
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / "seq").symlink_to(victim)
    with SimGCE() as sim:
        cfg = _config(tmp_path, sim, state, run)
        r = _run(cfg, ticks=2)
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious\n"
    assert "running without the agent lock" in r.stderr
    evs = _events(tmp_path)
    assert evs[0].event == "start" and evs[-1].event == "stop"


@pytest.mark.process
def test_a_real_second_agent_is_still_refused_with_75(tmp_path: Path) -> None:
    """The lock still does its job where it can be used."""
    with SimGCE() as sim:
        cfg = _config(tmp_path, sim, tmp_path / "state", tmp_path / "run")
        cmd = [sys.executable, "-m", "gce_watchdog", "run", "--config", str(cfg)]
        p = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.DEVNULL)
        try:
            assert wait_for(lambda: (tmp_path / "run" / "agent.lock").exists())
            assert wait_for(lambda: any(e.event == "start" for e in _events(tmp_path)))
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
            assert r.returncode == 75 and "refusing to run a second ladder" in r.stderr
        finally:
            p.terminate()
            p.wait(30)
