"""Commands exit non-zero when their line could not be written (issue 16, item 4).

`phase`, `setup-failed` and `fault` used to exit 0 with nothing on the console, so the start-up
script never fell back to its own emitter. Now they exit 74 (EX_IOERR). Real processes; the port
that refuses every write is the kernel's /dev/full (ENOSPC), the one that cannot be opened is a
path under /proc.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gce_watchdog.vm.state import read_phase
from gce_watchdog.wire import protocol
from kit.netns import Topology
from kit.paths import REPO

PY = sys.executable


def _config(tmp: Path, device: str, fallback: str) -> Path:
    cfg = tmp / "config.toml"
    cfg.write_text(
        f'[agent]\nstate_dir = "{tmp}/state"\nrun_dir = "{tmp}/run"\n'
        f'[serial]\ndevice = "{device}"\nfallback_file = "{fallback}"\nsync_timeout = 2\n'
    )
    return cfg


def _cli(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "gce_watchdog", *args, "--config", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


PORTS = {
    # neither the device nor the fallback file can be opened
    "unopenable": ("/proc/no-such-dir/ttyS0", "/proc/no-such-dir/serial.log"),
    # the device opens, every write fails (ENOSPC)
    "dev-full": ("/dev/full", "/proc/no-such-dir/serial.log"),
}


@pytest.mark.process
@pytest.mark.parametrize("port", sorted(PORTS))
def test_phase_exits_74_when_its_line_was_not_written(tmp_path: Path, port: str) -> None:
    cfg = _config(tmp_path, *PORTS[port])
    r = _cli(cfg, "phase", "bootstrap")
    assert r.returncode == 74, r.stderr
    assert "the phase line was not confirmed written" in r.stderr
    assert read_phase(tmp_path / "state") == "bootstrap"  # the state file still says it


@pytest.mark.process
@pytest.mark.parametrize("port", sorted(PORTS))
def test_setup_failed_exits_74_when_its_line_was_not_written(tmp_path: Path, port: str) -> None:
    cfg = _config(tmp_path, *PORTS[port])
    r = _cli(cfg, "setup-failed", "--step", "install", "--reason", "pip failed")
    assert r.returncode == 74, r.stderr
    assert "the setup_failed line was not confirmed written" in r.stderr


@pytest.mark.process
def test_a_written_line_still_exits_0(tmp_path: Path) -> None:
    """The counterpart: the same commands with a usable port (the device missing, the fallback
    file used) exit 0 and the lines are there."""
    cfg = _config(tmp_path, str(tmp_path / "absent-tty"), str(tmp_path / "fallback.log"))
    assert _cli(cfg, "phase", "bootstrap").returncode == 0
    r = _cli(cfg, "setup-failed", "--step", "install", "--reason", "pip failed")
    assert r.returncode == 0, r.stderr
    evs, _ = protocol.decode_all((tmp_path / "fallback.log").read_bytes())
    assert [e.event for e in evs] == ["key", "key", "phase", "setup_failed"]
    assert not (tmp_path / "absent-tty").exists()


@pytest.mark.netns
def test_fault_inject_exits_74_when_its_line_was_not_written(
    topo: Topology, tmp_path: Path
) -> None:
    """The fault is applied (real iptables in the test's namespace), but the console does not
    say so: exit 74, and `fault clear` (same port) likewise."""
    cfg = _config(tmp_path, "/dev/full", "/proc/no-such-dir/serial.log")
    r = topo.run_in(
        topo.vm, [PY, "-m", "gce_watchdog", "fault", "inject", "--dns", "--ttl", "5m",
                  "--config", str(cfg)]
    )  # fmt: skip
    try:
        assert r.returncode == 74, r.stderr
        assert "serial line(s) not written (exit 74)" in r.stderr
        rules = topo.run_in(topo.vm, ["iptables", "-S"], check=True).stdout
        assert "gcewd-fault id=" in rules  # applied all the same
    finally:
        c = topo.run_in(topo.vm, [PY, "-m", "gce_watchdog", "fault", "clear", "--config", str(cfg)])
    assert c.returncode == 74, c.stderr
    rules = topo.run_in(topo.vm, ["iptables", "-S"], check=True).stdout
    assert "gcewd-fault id=" not in rules
