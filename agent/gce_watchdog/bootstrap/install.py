"""``gce-watchdog install`` / ``uninstall``: lay down the systemd unit and a default config.

Idempotent: files are rewritten only when their content changes, a present config is never
overwritten (it is validated instead: a unit that would exit 78 in a loop is not installed), and
``systemctl enable``/``start`` are no-ops when already done. ``--root DIR`` installs into an image
or a test directory (``systemctl --root=DIR enable``, nothing started); the default root is
``$GCEWD_ROOT`` (the bootstrap scripts' variable) or ``/``.

The unit's ``ExecStart=`` is the ``gce-watchdog`` of the environment this command runs from (the
start-up script installs the agent under ``/opt/gce-watchdog``), unless ``--exec`` names another.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gce_watchdog.lib.cli import EX_CONFIG, EX_FAIL, EX_OK
from gce_watchdog.lib.files import atomic_write
from gce_watchdog.lib.proc import run_command
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.platform import Platform, detect

if TYPE_CHECKING:  # imported lazily: the CLI imports this module on every command
    from gce_watchdog.lib.proc import RunResult

UNIT = "gce-watchdog.service"
UNIT_DIR = "etc/systemd/system"
WANTS_DIR = "etc/systemd/system/multi-user.target.wants"
DEFAULT_EXEC = "/opt/gce-watchdog/bin/gce-watchdog"
# Paths the unit's sandbox hides or replaces: an agent installed there could not start.
HIDDEN_PREFIXES = ("/home/", "/root/", "/run/user/", "/tmp/", "/var/tmp/")
_SAFE_PATH = re.compile(r"/[A-Za-z0-9/._+-]*\Z")
SYSTEMCTL_TIMEOUT_S = 90.0  # `systemctl start` waits for READY=1 (TimeoutStartSec=60s) + margin
Out = Callable[[str], None]
Runner = Callable[[Sequence[str], float], "RunResult"]


class InstallError(Exception):
    def __init__(self, message: str, code: int = EX_FAIL) -> None:
        super().__init__(message)
        self.code = code


def template(name: str) -> str:
    """A file shipped in ``agent/gce_watchdog/data`` (the unit, the default config)."""
    import importlib.resources

    return importlib.resources.files("gce_watchdog").joinpath("data", name).read_text()


def default_exec() -> str:
    """The ``gce-watchdog`` console script beside this interpreter (a venv), else the default."""
    cand = Path(sys.executable).parent / "gce-watchdog"
    return str(cand) if cand.is_file() else DEFAULT_EXEC


def check_exec(path: str) -> None:
    if not _SAFE_PATH.match(path):
        raise InstallError(
            f"agent path {path!r} must be absolute and use only letters, digits and /._+-"
        )
    if path.startswith(HIDDEN_PREFIXES):
        raise InstallError(
            f"agent path {path} is under a directory the unit's sandbox hides "
            "(ProtectHome=/PrivateTmp=): install the agent under /opt (`make install` does)"
        )


def _under_root(root: Path, p: str) -> Path:
    return root / p.lstrip("/")


def resolve_in_root(root: Path, path: str, hops: int = 40) -> Path:
    """path as the image sees it: symlinks followed, absolute ones relative to root."""
    cur = _under_root(root, path)
    for _ in range(hops):
        if not cur.is_symlink():
            return cur
        target = os.readlink(cur)
        cur = _under_root(root, target) if target.startswith("/") else cur.parent / target
    raise InstallError(f"{path}: too many symlinks in the image tree")


def check_agent_in_root(root: Path, exec_path: str) -> None:
    """An image tree must already hold an agent that can run there; refuse otherwise (before
    anything is written). A unit pointing at an agent the image lacks, or at one whose
    interpreter exists only on the build host, would crash-loop at every boot of the image."""
    if root == Path("/"):
        return
    how = "install it first: bake-image.sh --root DIR, or the .deb with dpkg inside DIR"
    agent = resolve_in_root(root, exec_path)
    if not agent.is_file() or not os.access(agent, os.X_OK):
        raise InstallError(f"no agent at {exec_path} in the image tree {root} ({how})")
    with open(agent, "rb") as f:
        head = f.read(256).split(b"\n", 1)[0]
    if head.startswith(b"#!"):
        interp = head[2:].strip().split(b" ", 1)[0].decode(errors="replace")
        if not interp.startswith("/") or not resolve_in_root(root, interp).is_file():
            raise InstallError(
                f"the agent at {exec_path} runs {interp}, which is not in the image tree {root} "
                f"(a venv made on this host?): {how}"
            )


def render_unit(text: str, exec_path: str, config_path: str, cfg: cfgmod.Config) -> str:
    """The shipped unit with this install's ExecStart, serial device and extra writable paths."""
    check_exec(exec_path)
    cmd = f"ExecStart={exec_path} run"
    if config_path != str(cfgmod.DEFAULT_PATH):
        if not _SAFE_PATH.match(config_path):
            raise InstallError(f"config path {config_path!r} must be a plain absolute path")
        cmd += f" --config {config_path}"
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            line = cmd
        elif line == "DeviceAllow=/dev/ttyS0 rw" and cfg.serial.device.startswith("/dev/"):
            if not _SAFE_PATH.match(cfg.serial.device):  # a newline would add unit lines
                raise InstallError(
                    f"serial.device {cfg.serial.device!r} must be a plain absolute path"
                )
            line = f"DeviceAllow={cfg.serial.device} rw"
        elif line.startswith("ReadWritePaths="):
            out.append(line)
            line = "\n".join(f"ReadWritePaths=-{d}" for d in extra_writable(cfg))
            if not line:
                continue
        out.append(line)
    return "\n".join(out) + "\n"


def extra_writable(cfg: cfgmod.Config) -> list[str]:
    """Directories the config writes that the unit's StateDirectory= etc. do not already cover."""
    covered = ("/var/lib/gce-watchdog", "/run/gce-watchdog", "/var/log/gce-watchdog")
    dirs = [cfg.agent.state_dir, cfg.agent.run_dir, str(Path(cfg.serial.fallback_file).parent)]
    if cfg.metrics.directory != "/var/lib/prometheus/node-exporter":  # already in the unit
        dirs.append(cfg.metrics.directory)
    out: list[str] = []
    for d in dirs:
        d = d.rstrip("/") or "/"
        if any(d == c or d.startswith(c + "/") for c in covered) or d in out:
            continue
        if not _SAFE_PATH.match(d):
            raise InstallError(f"path {d!r} in the config must be a plain absolute path")
        out.append(d)
    return out


def write_if_changed(path: Path, text: str, mode: int = 0o644) -> bool:
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    atomic_write(path, text.encode(), mode)
    return True


def systemd_running(root: Path) -> bool:
    return root == Path("/") and Path("/run/systemd/system").is_dir()


@dataclass(frozen=True)
class InstallOptions:
    root: Path = Path("/")
    exec_path: str | None = None
    config_path: str = str(cfgmod.DEFAULT_PATH)
    start: bool = True
    live: bool | None = None  # a running systemd to talk to; None: detect (only for root /)
    # The machine the unit will run on; None: read its DMI product name when root is / (an image
    # built under --root runs elsewhere).
    platform: Platform | None = None


def install(opts: InstallOptions, runner: Runner | None = None, out: Out = print) -> int:
    """Install (or update) the unit and the default config; enable it, start it if possible."""
    runner = runner or _real_runner()
    root = opts.root
    # Everything is checked before anything is written: a refused install leaves no trace.
    exec_path = opts.exec_path or default_exec()
    if root != Path("/") and exec_path.startswith(str(root).rstrip("/") + "/"):
        exec_path = "/" + exec_path[len(str(root).rstrip("/")) + 1 :]
    check_exec(exec_path)
    check_agent_in_root(root, exec_path)
    cfg_file = _under_root(root, opts.config_path)
    new_config = not cfg_file.exists()
    if new_config:
        import tomllib

        cfg = cfgmod.from_dict(tomllib.loads(template("config.toml")), "default config")
    else:
        try:
            cfg = cfgmod.load(cfg_file)
        except cfgmod.InvalidConfig as e:
            raise InstallError(f"{e}\nfix the config, then run install again", EX_CONFIG) from None
    plat = opts.platform
    if plat is None and root == Path("/"):
        plat = detect(cfg.agent.dmi_product_path)
    if plat is not None and not plat.gce:
        if cfg.agent.allow_non_gce and cfg.agent.action != "dry-run":
            out(f"warning: not a GCE VM ({plat.why}); agent.allow_non_gce = true: it WILL act")
        else:
            out(
                f"warning: not a GCE VM ({plat.why}): installed disarmed, the agent watches and "
                "reports but never acts here (agent.allow_non_gce = true to change that)"
            )
    unit_text = render_unit(template(UNIT), exec_path, opts.config_path, cfg)
    if new_config:
        write_if_changed(cfg_file, template("config.toml"))
        out(f"config: {opts.config_path} written (defaults)")
    else:
        out(f"config: {opts.config_path} kept (valid)")
    unit_file = root / UNIT_DIR / UNIT
    changed = write_if_changed(unit_file, unit_text)
    out(f"unit: /{UNIT_DIR}/{UNIT} {'written' if changed else 'unchanged'} (ExecStart={exec_path})")

    live = systemd_running(root) if opts.live is None else opts.live
    if not live:
        _enable_offline(root, runner, out)
        out("systemd is not running here (or --root was given): enabled, not started")
        return EX_OK
    if changed:
        _systemctl(runner, out, "daemon-reload")
    _systemctl(runner, out, "enable", UNIT)
    if opts.start:
        # restart picks up a changed unit; start is a no-op for a running one.
        _systemctl(runner, out, "restart" if changed else "start", UNIT)
        out("started")
    return EX_OK


def uninstall(
    root: Path,
    purge: bool = False,
    runner: Runner | None = None,
    out: Out = print,
    live: bool | None = None,
) -> int:
    runner = runner or _real_runner()
    unit_file = root / UNIT_DIR / UNIT
    live = systemd_running(root) if live is None else live
    if live and unit_file.exists():
        _systemctl(runner, out, "disable", "--now", UNIT)
    elif unit_file.exists():
        r = runner(["systemctl", f"--root={root}", "disable", UNIT], SYSTEMCTL_TIMEOUT_S)
        if not r.ok:
            out(f"systemctl --root disable: {r.detail or r.rc}; removing the link by hand")
    for p in (root / WANTS_DIR / UNIT, unit_file):
        if p.is_symlink() or p.exists():
            p.unlink()
            out(f"removed /{p.relative_to(root)}")
    if live:
        _systemctl(runner, out, "daemon-reload")
    if purge:
        for d in ("etc/gce-watchdog", "var/lib/gce-watchdog", "var/log/gce-watchdog"):
            p = root / d
            if p.exists():
                shutil.rmtree(p)
                out(f"removed /{d}")
    else:
        out("config and state kept (--purge removes them)")
    return EX_OK


def _real_runner() -> Runner:
    return run_command


def _enable_offline(root: Path, runner: Runner, out: Out) -> None:
    r = runner(["systemctl", f"--root={root}", "enable", UNIT], SYSTEMCTL_TIMEOUT_S)
    link = root / WANTS_DIR / UNIT
    if r.ok and link.is_symlink():
        out("enabled (systemctl --root)")
        return
    # No usable systemctl (a minimal image build host): the same symlink `enable` would make.
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(f"/{UNIT_DIR}/{UNIT}")
    out("enabled (wants symlink)")


def _systemctl(runner: Runner, out: Out, *args: str) -> None:
    r = runner(["systemctl", *args], SYSTEMCTL_TIMEOUT_S)
    if not r.ok:
        raise InstallError(f"systemctl {' '.join(args)} failed (rc {r.rc}): {r.detail}")
