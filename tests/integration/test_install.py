"""`gce-watchdog install` / `uninstall` into a temporary root (never the host's systemd).

The offline path uses the real `systemctl --root=DIR enable` when systemctl exists; the live path
(daemon-reload / enable / start) is checked with a recording runner standing in for systemctl.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gce_watchdog.bootstrap.install import (
    UNIT,
    InstallError,
    InstallOptions,
    default_exec,
    install,
    template,
    uninstall,
)
from gce_watchdog.lib.cli import EX_CONFIG
from gce_watchdog.lib.proc import RunResult
from kit.agent import AGENT, agent_in
from kit.cli import agent_env, gcewd

UNIT_PATH = Path("etc/systemd/system") / UNIT
WANTS = Path("etc/systemd/system/multi-user.target.wants") / UNIT
CONFIG = Path("etc/gce-watchdog/config.toml")


@dataclass
class Systemctl:
    """Records systemctl argv; fails the verbs listed in ``fail``."""

    fail: set[str] = field(default_factory=set)
    calls: list[list[str]] = field(default_factory=list)

    def __call__(self, argv: list[str], timeout: float) -> RunResult:
        self.calls.append(list(argv))
        verb = next((a for a in argv[1:] if not a.startswith("-")), "")
        return RunResult(1, f"{verb} refused (fake)") if verb in self.fail else RunResult(0)


def quiet(_: str) -> None:
    pass


def opts(root: Path, **kw: object) -> InstallOptions:
    base: dict[str, object] = {"root": root, "exec_path": AGENT}
    base.update(kw)
    exe = str(base["exec_path"])
    if root != Path("/") and exe.startswith(str(root) + "/"):
        exe = exe[len(str(root)) :]
    if exe.startswith(("/opt/", "/usr/local/")) and root != Path("/"):
        agent_in(root, exe)
    return InstallOptions(**base)  # type: ignore[arg-type]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.process
def test_image_tree_without_a_runnable_agent_is_refused_before_writing(tmp_path: Path) -> None:
    # No agent in the tree at all.
    with pytest.raises(InstallError, match="no agent at"):
        install(InstallOptions(root=tmp_path, exec_path=AGENT), runner=Systemctl(), out=quiet)
    assert tree(tmp_path) == []
    # An agent whose interpreter is the build host's (a venv made outside the image).
    agent = tmp_path / AGENT.lstrip("/")
    agent.parent.mkdir(parents=True)
    agent.write_text(f"#!{sys.executable}\n")
    agent.chmod(0o755)
    before = tree(tmp_path)
    with pytest.raises(InstallError, match="not in the image tree"):
        install(InstallOptions(root=tmp_path, exec_path=AGENT), runner=Systemctl(), out=quiet)
    assert tree(tmp_path) == before, "nothing written"
    # Through the CLI: exit 1, and still nothing written.
    p = subprocess.run(
        [sys.executable, "-m", "gce_watchdog", "install", "--root", str(tmp_path), "--exec", AGENT],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 1 and "not in the image tree" in p.stderr
    assert tree(tmp_path) == before


@pytest.mark.pure
def test_run_from_a_hidden_venv_refuses_before_writing_the_config(tmp_path: Path) -> None:
    # The case: run from a venv in /tmp (or a home directory), without --exec.
    with pytest.raises(InstallError, match="sandbox hides"):
        install(
            InstallOptions(root=tmp_path, exec_path="/tmp/venv/bin/gce-watchdog"),
            runner=Systemctl(),
            out=quiet,
        )
    assert tree(tmp_path) == [], "no config written before the refusal"


@pytest.mark.process
def test_install_into_a_root_then_again_changes_nothing(tmp_path: Path) -> None:
    lines: list[str] = []
    assert install(opts(tmp_path), out=lines.append) == 0
    unit = (tmp_path / UNIT_PATH).read_text()
    assert f"ExecStart={AGENT} run\n" in unit
    assert (tmp_path / CONFIG).read_text() == template("config.toml")
    link = tmp_path / WANTS
    assert link.is_symlink() and os.readlink(link) == f"/{UNIT_PATH}"
    assert any("not started" in x for x in lines)
    before = {
        p: (p.stat().st_ino, p.read_bytes()) for p in (tmp_path / UNIT_PATH, tmp_path / CONFIG)
    }
    lines.clear()
    assert install(opts(tmp_path), out=lines.append) == 0
    after = {p: (p.stat().st_ino, p.read_bytes()) for p in before}
    assert after == before  # not even rewritten with the same bytes
    assert any("unchanged" in x for x in lines)


def write_config(root: Path, text: str) -> Path:
    """The operator's config file, already in the image tree under root."""
    cfg = root / CONFIG
    cfg.parent.mkdir(parents=True)
    cfg.write_text(text)
    return cfg


@pytest.mark.process
def test_an_existing_config_is_kept_and_shapes_the_unit(tmp_path: Path) -> None:
    text = '[agent]\nstate_dir = "/srv/wd"\naction = "delete"\n[serial]\ndevice = "/dev/ttyS1"\n'
    cfg = write_config(tmp_path, text)
    install(opts(tmp_path), out=quiet)
    assert cfg.read_text() == text
    unit = (tmp_path / UNIT_PATH).read_text()
    assert "DeviceAllow=/dev/ttyS1 rw\n" in unit
    assert "DeviceAllow=/dev/ttyS0 rw" not in unit
    assert "ReadWritePaths=-/srv/wd\n" in unit


@pytest.mark.process
def test_an_invalid_config_stops_the_install(tmp_path: Path) -> None:
    write_config(tmp_path, '[agent]\ninterval = "soon"\n')
    with pytest.raises(InstallError) as e:
        install(opts(tmp_path), out=quiet)
    assert e.value.code == EX_CONFIG
    assert "agent.interval" in str(e.value)
    assert not (tmp_path / UNIT_PATH).exists()


@pytest.mark.process
def test_a_non_default_config_path_goes_into_exec_start(tmp_path: Path) -> None:
    install(opts(tmp_path, config_path="/etc/gce-watchdog/other.toml"), out=quiet)
    unit = (tmp_path / UNIT_PATH).read_text()
    assert f"ExecStart={AGENT} run --config /etc/gce-watchdog/other.toml\n" in unit
    assert (tmp_path / "etc/gce-watchdog/other.toml").exists()


@pytest.mark.process
@pytest.mark.parametrize(
    "path", ["/home/me/.venv/bin/gce-watchdog", "/tmp/x/gce-watchdog", "relative/gce", "/a b/c"]
)
def test_agent_paths_the_sandbox_hides_are_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(InstallError):
        install(opts(tmp_path, exec_path=path), out=quiet)
    assert not (tmp_path / UNIT_PATH).exists()


@pytest.mark.process
def test_exec_inside_the_root_is_written_as_seen_from_it(tmp_path: Path) -> None:
    agent = tmp_path / "opt/gce-watchdog/bin/gce-watchdog"
    install(opts(tmp_path, exec_path=str(agent)), out=quiet)
    assert f"ExecStart={AGENT} run\n" in (tmp_path / UNIT_PATH).read_text()


@pytest.mark.process
def test_live_systemd_first_install_then_update_then_no_start(tmp_path: Path) -> None:
    sc = Systemctl()
    install(opts(tmp_path, live=True), runner=sc, out=quiet)
    assert sc.calls == [
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", UNIT],
        ["systemctl", "restart", UNIT],
    ]
    sc.calls.clear()
    install(opts(tmp_path, live=True), runner=sc, out=quiet)  # nothing changed
    assert sc.calls == [["systemctl", "enable", UNIT], ["systemctl", "start", UNIT]]
    sc.calls.clear()
    install(
        opts(tmp_path, live=True, start=False, exec_path="/usr/local/bin/gce-watchdog"),
        runner=sc,
        out=quiet,
    )
    assert sc.calls == [["systemctl", "daemon-reload"], ["systemctl", "enable", UNIT]]


@pytest.mark.process
def test_live_systemd_failure_is_reported(tmp_path: Path) -> None:
    with pytest.raises(InstallError) as e:
        install(opts(tmp_path, live=True), runner=Systemctl(fail={"restart"}), out=quiet)
    assert "systemctl restart" in str(e.value) and "refused" in str(e.value)


@pytest.mark.process
def test_offline_without_a_usable_systemctl_links_by_hand(tmp_path: Path) -> None:
    sc = Systemctl(fail={"enable"})
    lines: list[str] = []
    install(opts(tmp_path), runner=sc, out=lines.append)
    assert sc.calls[0][:2] == ["systemctl", f"--root={tmp_path}"]
    assert os.readlink(tmp_path / WANTS) == f"/{UNIT_PATH}"
    assert "enabled (wants symlink)" in lines


@pytest.mark.process
def test_uninstall_keeps_config_unless_purged_and_is_idempotent(tmp_path: Path) -> None:
    install(opts(tmp_path), out=quiet)
    (tmp_path / "var/lib/gce-watchdog").mkdir(parents=True)
    assert uninstall(tmp_path, out=quiet) == 0
    assert not (tmp_path / UNIT_PATH).exists()
    assert not (tmp_path / WANTS).is_symlink()
    assert (tmp_path / CONFIG).exists()
    assert uninstall(tmp_path, out=quiet) == 0
    assert uninstall(tmp_path, purge=True, out=quiet) == 0
    assert not (tmp_path / "etc/gce-watchdog").exists()
    assert not (tmp_path / "var/lib/gce-watchdog").exists()


@pytest.mark.process
def test_uninstall_live_disables_and_stops(tmp_path: Path) -> None:
    install(opts(tmp_path), out=quiet)
    sc = Systemctl()
    uninstall(tmp_path, runner=sc, out=quiet, live=True)
    assert sc.calls == [
        ["systemctl", "disable", "--now", UNIT],
        ["systemctl", "daemon-reload"],
    ]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return gcewd(*args, timeout=120, env=agent_env(**(env or {})))


@pytest.mark.process
@pytest.mark.skipif(shutil.which("systemctl") is None, reason="systemctl not installed")
def test_cli_install_and_uninstall_with_gcewd_root(tmp_path: Path) -> None:
    agent_in(tmp_path)
    p = _cli("install", "--no-start", "--exec", AGENT, env={"GCEWD_ROOT": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert (tmp_path / WANTS).is_symlink()  # real `systemctl --root=... enable`
    assert "enabled (systemctl --root)" in p.stdout
    p = _cli("uninstall", "--root", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / UNIT_PATH).exists() and not (tmp_path / WANTS).is_symlink()


@pytest.mark.process
def test_cli_refuses_an_invalid_config_with_exit_78(tmp_path: Path) -> None:
    write_config(tmp_path, "[agnet]\n")
    agent_in(tmp_path)
    p = _cli("install", "--root", str(tmp_path), "--exec", AGENT)
    assert p.returncode == 78
    assert "did you mean 'agent'" in p.stderr


@pytest.mark.pure
def test_default_exec_is_this_environments_console_script() -> None:
    exe = default_exec()
    assert exe.endswith("/gce-watchdog")
    if Path(sys.executable).parent.joinpath("gce-watchdog").is_file():
        assert Path(exe).parent == Path(sys.executable).parent


@pytest.mark.process
def test_a_serial_device_that_would_add_unit_lines_is_refused(tmp_path: Path) -> None:
    write_config(tmp_path, '[serial]\ndevice = "/dev/ttyS1 rw\\nExecStartPre=/bin/sh -c id"\n')
    with pytest.raises(InstallError) as e:
        install(opts(tmp_path), out=quiet)
    assert "serial.device" in str(e.value)
    assert not (tmp_path / UNIT_PATH).exists()
