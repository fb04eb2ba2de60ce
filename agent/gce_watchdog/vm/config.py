"""Configuration: defaults in one place, one validation pass that reports every error at once.

The file is TOML. Each top-level table is a section below (a frozen dataclass); every key has a
default, so the agent runs with no file at all. ``docs/configuration.md`` documents every key.

To add a section: write a frozen dataclass whose fields carry defaults (and optionally
``metadata={"check": fn}`` where ``fn(value) -> str | None`` returns an error message), add it to
:class:`Config`, and put cross-field rules in :func:`_cross_checks`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gce_watchdog.lib.durations import format_duration, parse_duration
from gce_watchdog.lib.netaddr import parse_dns_server, parse_host_port
from gce_watchdog.lib.sizes import GIB, parse_size

DEFAULT_PATH = Path("/etc/gce-watchdog/config.toml")


class Duration(float):
    """Marker type: a float number of seconds that may be written as '30s', '10m', ..."""


class GiBSize(float):
    """Marker type: a float number of GiB (a number, as before) that may also be written as a
    size with its unit, ``"512MiB"``, ``"1.5GiB"`` (the one size parser, ``lib/sizes``)."""


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _at_least_one(v: int) -> str | None:
    return None if v >= 1 else "must be >= 1"


def _fmt(v: float) -> str:
    """A bound as operators write it: 100ms, 30s, 1h."""
    if v < 1:
        return f"{v * 1000:g}ms"
    if v >= 3600 and v % 3600 == 0:
        return f"{v / 3600:g}h"
    return f"{v:g}s"


def _within(
    lo: float, hi: float, lo_open: bool = False, zero_ok: bool = False, why: str = ""
) -> Callable[[float], str | None]:
    """A duration check: finite, ``lo`` (exclusive with ``lo_open``) up to ``hi``; ``zero_ok``:
    0 is also allowed (it switches the thing off). ``why`` is added to the message."""

    def check(v: float) -> str | None:
        if zero_ok and v == 0:
            return None
        ok = (v > lo if lo_open else v >= lo) and v <= hi
        if ok:
            return None
        low = f"more than {_fmt(lo)}" if lo_open else f"at least {_fmt(lo)}"
        zero = "0 or " if zero_ok else ""
        return f"must be {zero}{low} and at most {_fmt(hi)}" + (f": {why}" if why else "")

    return check


def _count(lo: int, hi: int, why: str = "") -> Callable[[int], str | None]:
    def check(v: int) -> str | None:
        if lo <= v <= hi:
            return None
        return f"must be between {lo} and {hi}" + (f": {why}" if why else "")

    return check


# Bounds on durations: a value outside them disables the agent or floods the console (issue 16).
MIN_INTERVAL = 0.1  # the floor on console output: at most 10 tick lines a second
MAX_INTERVAL = 3600.0
MAX_THRESHOLD = 10_000
DAY = 86400.0


def _host_port_list(v: list[str]) -> str | None:
    bad = [t for t in v if not _parses(parse_host_port, t)]
    return f"not host:port: {', '.join(map(repr, bad))}" if bad else None


def _dns_server_list(v: list[str]) -> str | None:
    bad = [t for t in v if not _parses(parse_dns_server, t)]
    return f"not IP, IP:PORT or [IPv6]:PORT: {', '.join(map(repr, bad))}" if bad else None


def _parses(parse: Callable[[str], object], t: str) -> bool:
    try:
        parse(t)
    except ValueError:
        return False
    return True


def _abs_path(v: str) -> str | None:
    return None if v.startswith("/") else "must be an absolute path"


def _one_of(*choices: str) -> Callable[[str], str | None]:
    def check(v: str) -> str | None:
        return None if v in choices else f"must be one of {', '.join(choices)}"

    return check


def _http_url(v: str) -> str | None:
    ok = re.match(r"^https?://[^/\s]+(/\S*)?$", v)
    return None if ok else "must be an http:// or https:// URL"


def _argv(v: list[str]) -> str | None:
    return None if v and all(v) else "must be a non-empty list of non-empty strings (an argv)"


def _check(fn: Callable[[Any], str | None], doc: str = "") -> dict[str, Any]:
    return {"check": fn, "doc": doc}


@dataclass(frozen=True)
class AgentSection:
    interval: Duration = field(
        default=Duration(30.0),
        metadata=_check(
            _within(MIN_INTERVAL, MAX_INTERVAL, why="the floor keeps the console readable")
        ),
    )
    probe_timeout: Duration = field(
        default=Duration(5.0), metadata=_check(_within(0, MAX_INTERVAL, lo_open=True))
    )
    threshold: int = field(
        default=10,
        metadata=_check(_count(1, MAX_THRESHOLD, "a higher one would never shut down")),
    )
    heartbeat_every: int = field(default=10, metadata=_check(_count(1, 1_000_000)))
    state_dir: str = field(default="/var/lib/gce-watchdog", metadata=_check(_abs_path))
    run_dir: str = field(default="/run/gce-watchdog", metadata=_check(_abs_path))
    boot_id_path: str = field(default="/proc/sys/kernel/random/boot_id", metadata=_check(_abs_path))
    action: str = field(
        default="poweroff", metadata=_check(_one_of("poweroff", "stop", "delete", "dry-run"))
    )
    # The agent acts only where this file says "Google Compute Engine" (docs/agent.md).
    dmi_product_path: str = field(
        default="/sys/class/dmi/id/product_name", metadata=_check(_abs_path)
    )
    allow_non_gce: bool = False
    boot_grace: Duration = field(default=Duration(0.0), metadata=_check(_within(0, DAY)))


@dataclass(frozen=True)
class MetadataSection:
    url: str = field(
        default="http://169.254.169.254/computeMetadata/v1/instance/id",
        metadata=_check(_http_url),
    )


@dataclass(frozen=True)
class EgressSection:
    targets: list[str] = field(
        default_factory=lambda: ["www.google.com:443", "one.one.one.one:443"],
        metadata=_check(_host_port_list),
    )
    # empty: the system's resolv.conf
    dns_servers: list[str] = field(default_factory=list, metadata=_check(_dns_server_list))
    dns_timeout: Duration = field(
        default=Duration(2.0), metadata=_check(_within(0, MAX_INTERVAL, lo_open=True))
    )


@dataclass(frozen=True)
class SerialSection:
    device: str = field(default="/dev/ttyS0", metadata=_check(_abs_path))
    fallback_file: str = field(
        default="/var/log/gce-watchdog/serial.log", metadata=_check(_abs_path)
    )
    queue_size: int = field(default=256, metadata=_check(_count(1, 65_536)))
    sync_timeout: Duration = field(
        default=Duration(5.0), metadata=_check(_within(0, 60.0, lo_open=True))
    )


@dataclass(frozen=True)
class MemorySection:
    """Memory watch (docs/memory-watch.md). Reports only, unless on_climb opts into an action."""

    enabled: bool = True
    period: Duration = field(default=Duration(30.0), metadata=_check(_within(0, DAY, lo_open=True)))
    # Samples taken during the first `warmup` after start are not judged (model load, caches).
    warmup: Duration = field(default=Duration(300.0), metadata=_check(_within(0, 7 * DAY)))
    # The team's pass band: at least 30 samples after warm-up, range < band_gib.
    window: int = field(default=30, metadata=_check(lambda v: None if v >= 30 else "must be >= 30"))
    # Samples kept per gauge (sliding window judged each period): 240 x 30 s = 2 h of history.
    max_window: int = field(default=240, metadata=_check(_count(1, 100_000)))
    band_gib: GiBSize = field(
        default=GiBSize(1.0),
        metadata=_check(lambda v: None if 0 < v <= 1e6 else "must be in (0, 1e6]"),
    )
    alpha: float = field(
        default=0.01, metadata=_check(lambda v: None if 0 < v < 0.5 else "must be in (0, 0.5)")
    )
    gpu: bool = True
    # At most one compact `mem` line per serial_every (0: none); the console is shared and slow.
    serial_every: Duration = field(
        default=Duration(600.0), metadata=_check(_within(MIN_INTERVAL, DAY, zero_ok=True))
    )
    on_climb: str = field(default="report", metadata=_check(_one_of("report", "command")))
    climb_command: list[str] = field(default_factory=list)
    climb_command_timeout: Duration = field(
        default=Duration(60.0), metadata=_check(_within(0, 3600.0, lo_open=True))
    )


@dataclass(frozen=True)
class GpuSection:
    """GPU health (docs/gpu.md): Xid records from the kernel log, NVML in a probe child."""

    # auto: on when the NVIDIA driver is loaded (driver_path exists); on; off. With it off or no
    # driver, no GPU library is imported and no probe child runs.
    enabled: str = field(default="auto", metadata=_check(_one_of("auto", "on", "off")))
    driver_path: str = field(default="/proc/driver/nvidia/version", metadata=_check(_abs_path))
    kmsg_path: str = field(default="/dev/kmsg", metadata=_check(_abs_path))
    # How often the watch reads the kernel log and asks the probe child for a sample.
    period: Duration = field(default=Duration(10.0), metadata=_check(_within(MIN_INTERVAL, 3600.0)))
    # How long one NVML sample may take in the child before a `gpu_stall` line.
    probe_timeout: Duration = field(
        default=Duration(10.0), metadata=_check(_within(0, 3600.0, lo_open=True))
    )
    # NVML unable to answer (a stall, a broken library) this long is a GPU fault.
    unanswered_window: Duration = field(
        default=Duration(300.0), metadata=_check(_within(0, DAY, lo_open=True))
    )
    # An Xid flood is one episode (one line) until this long passes without a record of it.
    episode_quiet: Duration = field(
        default=Duration(600.0), metadata=_check(_within(0, DAY, lo_open=True))
    )


@dataclass(frozen=True)
class JobSection:
    """The job started by `gce-watchdog exec` (docs/bootstrap.md, "Notices")."""

    # The signal the job gets when GCE announces a maintenance stop or a preemption (Slurm's
    # --signal and Lightning's requeue use SIGUSR1 for "checkpoint now"); "off": none.
    notice_signal: str = field(
        default="SIGUSR1",
        metadata=_check(_one_of("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "off")),
    )
    # The stuck windows (docs/job-progress.md; `exec --stuck-after` and friends override them).
    # 0: off. No progress for stuck_after while the job's process tree is idle; for stuck_max
    # whatever it does; stuck_first: the one window before the first step. Up to a week: a
    # window longer than any run is "off" said differently.
    stuck_after: Duration = field(
        default=Duration(0.0), metadata=_check(_within(10.0, 7 * 86400.0, zero_ok=True))
    )
    stuck_max: Duration = field(
        default=Duration(0.0), metadata=_check(_within(10.0, 7 * 86400.0, zero_ok=True))
    )
    stuck_first: Duration = field(
        default=Duration(0.0), metadata=_check(_within(10.0, 7 * 86400.0, zero_ok=True))
    )
    # A stuck job: "end" runs the end-of-life chain as for a wedge; "alert": the line only.
    on_stuck: str = field(default="end", metadata=_check(_one_of("end", "alert")))
    # A uid whose processes may report progress from outside the job's tree (a sidecar); -1: none.
    progress_uid: int = field(default=-1, metadata=_check(_count(-1, 2**31 - 2)))


@dataclass(frozen=True)
class ActionsSection:
    """The shutdown action chain (docs/actions.md). The action itself is ``agent.action``."""

    # Two polls of a 30 s poller plus 15 s of margin: the poller reads the verdict while RUNNING.
    linger: Duration = field(default=Duration(75.0), metadata=_check(_within(0, 3600.0)))
    # The verdict line is repeated this often during the linger (and systemd is pinged).
    repeat_every: Duration = field(
        default=Duration(5.0), metadata=_check(_within(MIN_INTERVAL, 30.0))
    )
    api_base: str = field(
        default="https://compute.googleapis.com/compute/v1", metadata=_check(_http_url)
    )
    # One API request (connect + read). google-auth's default is 120 s; a wedged VM waits it all.
    api_timeout: Duration = field(
        default=Duration(10.0), metadata=_check(_within(0, 600.0, lo_open=True))
    )
    api_attempts: int = field(default=3, metadata=_check(_count(1, 100)))
    # Hard bound on the whole API step (token + every attempt + waits between them).
    api_deadline: Duration = field(
        default=Duration(30.0), metadata=_check(_within(0, 600.0, lo_open=True))
    )
    poweroff_cmd: list[str] = field(
        default_factory=lambda: ["systemctl", "poweroff"], metadata=_check(_argv)
    )
    # A graceful poweroff stops every unit (systemd's default stop timeout is 90 s) before the
    # machine goes off; still up after this long means it is stuck: force it.
    poweroff_wait: Duration = field(
        default=Duration(120.0), metadata=_check(_within(0, 3600.0, lo_open=True))
    )
    force_cmd: list[str] = field(
        default_factory=lambda: ["systemctl", "poweroff", "--force"], metadata=_check(_argv)
    )
    force_wait: Duration = field(
        default=Duration(30.0), metadata=_check(_within(0, 3600.0, lo_open=True))
    )
    # Each command's own bound (systemctl's D-Bus timeout is 25 s).
    command_timeout: Duration = field(
        default=Duration(30.0), metadata=_check(_within(0, 600.0, lo_open=True))
    )
    # Kernel last resort, tried in order: reboot(2) POWER_OFF, then 'o' to /proc/sysrq-trigger.
    kernel: list[str] = field(
        default_factory=lambda: ["reboot", "sysrq"],
        metadata=_check(
            lambda v: (
                None
                if all(m in ("reboot", "sysrq") for m in v)
                else "each entry must be 'reboot' or 'sysrq' ([] disables the kernel step)"
            )
        ),
    )
    sysrq_path: str = field(default="/proc/sysrq-trigger", metadata=_check(_abs_path))
    # The action a dry run (agent.action = "dry-run") rehearses: its chain is the one that action
    # would really run. Default: agent.action's own default, so switching a default config to
    # dry-run reports the chain it would otherwise have run. "none" is the old name of "poweroff".
    dry_run_op: str = field(
        default="poweroff", metadata=_check(_one_of("poweroff", "delete", "stop", "none"))
    )


@dataclass(frozen=True)
class WatchSection:
    """Metadata watcher: instance identity cache, disarm attribute, preemption/maintenance."""

    enabled: bool = True
    # Metadata server root; empty: derived from metadata.url (up to /computeMetadata/v1/).
    metadata_root: str = field(
        default="", metadata=_check(lambda v: None if not v else _http_url(v))
    )
    disarm_attribute: str = field(
        default="gce-watchdog-disarm",
        metadata=_check(
            lambda v: (
                None
                if re.fullmatch(r"[A-Za-z0-9_-]{1,128}", v)
                else "must be a metadata key: letters, digits, '-' and '_'"
            )
        ),
    )
    # A metadata disarm last confirmed longer ago than this (metadata unreachable) expires.
    disarm_hold: Duration = field(
        default=Duration(7200.0),
        metadata=_check(_within(0, DAY, lo_open=True, why="every disarm expires")),
    )
    # How often instance identity and the disarm attribute are re-read while healthy.
    refresh: Duration = field(
        default=Duration(60.0), metadata=_check(_within(0, DAY, lo_open=True))
    )
    # timeout_sec of the wait-for-change long polls (the client waits 10 s longer).
    poll_timeout: Duration = field(
        default=Duration(60.0),
        metadata=_check(lambda v: None if 1 <= v <= 3600 else "must be between 1s and 1h"),
    )
    request_timeout: Duration = field(
        default=Duration(3.0), metadata=_check(_within(0, 60.0, lo_open=True))
    )
    # Apply faults requested through the instance attribute `fault_attribute`
    # (docs/fault-injection.md, "Faults through metadata").
    # Off by default: whoever can set metadata (every process on the VM, through its service
    # account) could otherwise cut the network and have the watchdog power the VM off.
    faults_from_metadata: bool = False
    # Obey the disarm and fault attributes even when this VM's service account can write its
    # own metadata (docs/actions.md, "Who may disarm through metadata"). Off: they are obeyed
    # only when the account cannot (its scopes, testIamPermissions), checked at start and
    # every few minutes, fail closed. Set it only where no untrusted process runs on the VM.
    trust_metadata: bool = False
    fault_attribute: str = field(
        default="gce-watchdog-fault",
        metadata=_check(
            lambda v: (
                None
                if re.fullmatch(r"[A-Za-z0-9_-]{1,128}", v)
                else "must be a metadata key: letters, digits, '-' and '_'"
            )
        ),
    )


def _prom_file(v: str) -> str | None:
    ok = re.fullmatch(r"[A-Za-z0-9_.-]{1,96}\.prom", v) and not v.startswith(".")
    return None if ok else "must be a plain file name ending in .prom (node_exporter reads *.prom)"


@dataclass(frozen=True)
class MetricsSection:
    """Prometheus textfile metrics (docs/report.md), rewritten atomically after every tick.

    On by default but written only where ``directory`` already exists (node_exporter's textfile
    collector is installed): the agent never creates another package's directory.
    """

    enabled: bool = True
    # Debian/Ubuntu prometheus-node-exporter's --collector.textfile.directory default.
    directory: str = field(default="/var/lib/prometheus/node-exporter", metadata=_check(_abs_path))
    filename: str = field(default="gce_watchdog.prom", metadata=_check(_prom_file))


@dataclass(frozen=True)
class Config:
    agent: AgentSection = field(default_factory=AgentSection)
    metadata: MetadataSection = field(default_factory=MetadataSection)
    egress: EgressSection = field(default_factory=EgressSection)
    serial: SerialSection = field(default_factory=SerialSection)
    memory: MemorySection = field(default_factory=MemorySection)
    gpu: GpuSection = field(default_factory=GpuSection)
    job: JobSection = field(default_factory=JobSection)
    actions: ActionsSection = field(default_factory=ActionsSection)
    watch: WatchSection = field(default_factory=WatchSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)


@dataclass(frozen=True)
class ConfigError:
    path: str
    message: str
    source: str = ""  # the file that set the key, when several files were merged

    def __str__(self) -> str:
        head = f"{self.source}: " if self.source else ""
        return f"{head}{self.path}: {self.message}"


class InvalidConfig(Exception):
    def __init__(self, errors: list[ConfigError], source: str = "") -> None:
        self.errors = errors
        self.source = source
        head = f"{source}: " if source else ""
        super().__init__(
            f"{head}{len(errors)} configuration error(s):\n" + "\n".join(f"  - {e}" for e in errors)
        )


def _close(word: str, choices: list[str]) -> list[str]:
    """The one closest choice, if any: for "did you mean" in an error message (difflib is
    imported here, not at the top: the agent reads its config, and only a typo needs it)."""
    import difflib

    return difflib.get_close_matches(word, choices, n=1, cutoff=0.6)


def _suggest(key: str, choices: list[str]) -> str:
    close = _close(key, choices)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(tp: Any) -> str:
    if tp is Duration:
        return "duration (seconds or '30s')"
    if tp is GiBSize:
        return "size (GiB as a number, or '512MiB', '1.5GiB')"
    if typing.get_origin(tp) is list:
        return "list of strings"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any) -> Any:
    """Return the value as type tp, or raise ValueError with a message."""
    if tp is Duration:
        try:
            d = parse_duration(value)
        except OverflowError:  # an integer too big for a float
            raise ValueError(f"expected a finite duration, got {value!r}") from None
        if not math.isfinite(d):
            raise ValueError(f"expected a finite duration, got {value!r}")
        return Duration(d)
    if tp is GiBSize:
        if isinstance(value, str):
            return GiBSize(parse_size(value) / GIB)  # ValueError says what a size looks like
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ValueError(f"expected a finite size, got {value!r}")
            return GiBSize(float(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                f = float(value)
            except OverflowError:
                raise ValueError(f"expected a finite number, got {value!r}") from None
            if not math.isfinite(f):
                raise ValueError(f"expected a finite number, got {value!r}")
            return f
    elif tp is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(tp) is list:
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            return list(value)
    elif isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
            try:
                return _coerce(arg, value)
            except ValueError:
                continue
    raise ValueError(f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _build_section(cls: type, name: str, raw: Any, errors: list[ConfigError]) -> Any:
    if not isinstance(raw, dict):
        errors.append(ConfigError(name, f"must be a table, got {type(raw).__name__}"))
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{name}.{key}"
        if key not in fields:
            errors.append(ConfigError(path, "unknown key" + _suggest(key, list(fields))))
            continue
        try:
            v = _coerce(hints[key], value)
        except ValueError as e:
            errors.append(ConfigError(path, str(e)))
            continue
        check = fields[key].metadata.get("check")
        msg = check(v) if check else None
        if msg:
            errors.append(ConfigError(path, msg))
            continue
        kwargs[key] = v
    return cls(**kwargs)


def _cross_checks(cfg: Config) -> list[ConfigError]:
    errs: list[ConfigError] = []
    a = cfg.agent
    if a.probe_timeout >= a.interval:
        errs.append(
            ConfigError(
                "agent.probe_timeout",
                f"must be less than agent.interval ({a.probe_timeout:g}s >= {a.interval:g}s): "
                "a tick must finish before the next one is due",
            )
        )
    if cfg.egress.dns_timeout >= a.probe_timeout:
        errs.append(
            ConfigError(
                "egress.dns_timeout",
                f"must be less than agent.probe_timeout ({cfg.egress.dns_timeout:g}s >= "
                f"{a.probe_timeout:g}s): the egress probe resolves, then connects, in one timeout",
            )
        )
    if not cfg.egress.targets:
        errs.append(ConfigError("egress.targets", "needs at least one host:port"))
    for hook in _EXTRA_CHECKS:
        errs.extend(hook(cfg))
    return errs


# Sections added later register cross-field checks here (kept as data, run in one pass).
_EXTRA_CHECKS: list[Callable[[Config], list[ConfigError]]] = []


def register_check(fn: Callable[[Config], list[ConfigError]]) -> None:
    _EXTRA_CHECKS.append(fn)


def _memory_checks(cfg: Config) -> list[ConfigError]:
    m = cfg.memory
    errs: list[ConfigError] = []
    if m.max_window < m.window:
        errs.append(
            ConfigError(
                "memory.max_window", f"must be >= memory.window ({m.max_window} < {m.window})"
            )
        )
    if m.on_climb == "command" and _argv(m.climb_command):
        errs.append(
            ConfigError("memory.climb_command", "on_climb = 'command' needs an argv list here")
        )
    return errs


register_check(_memory_checks)


def _actions_checks(cfg: Config) -> list[ConfigError]:
    a = cfg.actions
    errs: list[ConfigError] = []
    if a.repeat_every > 30:
        errs.append(
            ConfigError(
                "actions.repeat_every",
                f"must be at most 30s ({a.repeat_every:g}s): it also paces the systemd watchdog "
                "pings during the linger",
            )
        )
    if a.api_timeout > a.api_deadline:
        errs.append(
            ConfigError(
                "actions.api_timeout",
                f"must not exceed actions.api_deadline ({a.api_timeout:g}s > "
                f"{a.api_deadline:g}s): one request could never finish within the step",
            )
        )
    w = cfg.watch
    if w.request_timeout >= w.refresh:
        errs.append(
            ConfigError(
                "watch.request_timeout",
                f"must be less than watch.refresh ({w.request_timeout:g}s >= {w.refresh:g}s)",
            )
        )
    return errs


register_check(_actions_checks)


def _unknown_top_level(name: str, value: object, sections: dict[str, Any]) -> str:
    """What an unknown top-level name most likely is. A table: a misspelt section. A value: a
    key written outside its section (``interval = 30`` above any ``[agent]``), possibly
    misspelt too; TOML puts every key before the first table header at the top level."""
    hints = typing.get_type_hints(Config)
    keys: dict[str, str] = {}
    for sec in sections:  # the first section wins a shared key name (none today)
        for f in dataclasses.fields(hints[sec]):
            keys.setdefault(f.name, sec)
    if isinstance(value, dict):
        return "unknown section" + _suggest(name, list(sections))
    if name in keys:
        return f"a key outside its section: it belongs under [{keys[name]}]"
    close = _close(name, list(keys))
    if close:
        return (
            f"unknown key outside any section (did you mean {close[0]!r} under [{keys[close[0]]}]?)"
        )
    near = _close(name, list(sections))
    return "unknown key outside any section" + (
        f" (did you mean the [{near[0]}] section?)" if near else ""
    )


def _build(raw: dict[str, Any]) -> tuple[Config, list[ConfigError]]:
    """A Config from parsed TOML and the errors of its keys (no cross-field rules)."""
    errors: list[ConfigError] = []
    sections = {f.name: f for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in sections:
            errors.append(ConfigError(name, _unknown_top_level(name, value, sections)))
            continue
        kwargs[name] = _build_section(hints[name], name, value, errors)
    return Config(**kwargs), errors


def from_dict(raw: dict[str, Any], source: str = "") -> Config:
    """Build a Config from parsed TOML; raises InvalidConfig listing every error found."""
    cfg, errors = _build(raw)
    if not errors:
        errors = _cross_checks(cfg)
    else:
        errors.extend(e for e in _cross_checks(cfg) if e not in errors)
    if errors:
        raise InvalidConfig(errors, source)
    return cfg


# A config file is a few KiB; a bigger one is not a config (and /dev/zero has no end).
CONFIG_MAX_BYTES = 1024 * 1024

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_config_bytes(p: Path, dropin: bool = False) -> bytes:
    """The bytes of a config file: a regular file (a symlink to one is fine) of at most
    CONFIG_MAX_BYTES. FIFOs, devices (a link to /dev/zero), sockets and directories are refused
    without reading them (opened non-blocking: a FIFO with no writer never hangs the check).
    ``dropin``: a world-writable file is refused too (any local user could rewrite it); the
    mode is that of the file opened, so a link swapped in between changes nothing."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise InvalidConfig([ConfigError(str(p), f"is {kind}, not a regular file: refused")])
        if dropin and mode & stat.S_IWOTH:
            raise InvalidConfig([ConfigError(str(p), _world_writable(mode))])
        chunks: list[bytes] = []
        size = 0
        while size <= CONFIG_MAX_BYTES:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
            size += len(b)
        if size > CONFIG_MAX_BYTES:
            raise InvalidConfig(
                [ConfigError(str(p), f"larger than {CONFIG_MAX_BYTES // 1024} KiB: not a config")]
            )
        return b"".join(chunks)
    finally:
        os.close(fd)


def _world_writable(mode: int) -> str:
    return (
        f"world-writable (mode {stat.S_IMODE(mode):04o}): any local user could change the "
        "agent's config: refused (chmod o-w)"
    )


def _parse(p: Path, data: bytes) -> dict[str, Any]:
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InvalidConfig([ConfigError(str(p), f"not valid TOML: {e}")]) from None
    except RecursionError:
        raise InvalidConfig(
            [ConfigError(str(p), "nested too deeply (arrays or tables within each other)")]
        ) from None


def _read_file(p: Path, explicit: bool, dropin: bool = False) -> dict[str, Any] | None:
    """One file's TOML; None for a missing default file. Raises InvalidConfig."""
    try:
        data = read_config_bytes(p, dropin=dropin)
    except FileNotFoundError:
        if os.path.islink(p):
            raise InvalidConfig(
                [ConfigError(str(p), f"a dangling symlink (to {os.readlink(p)}): refused")]
            ) from None
        if explicit:
            raise InvalidConfig([ConfigError(str(p), "file not found")]) from None
        return None
    except OSError as e:
        raise InvalidConfig([ConfigError(str(p), f"cannot read: {e.strerror or e}")]) from None
    return _parse(p, data)


# Drop-ins: <the config file's directory>/config.d/*.toml, read after the file, in byte order
# of their names (C-locale `ls`: "10-a" < "50-metadata" < "9-z"; number them with two digits).
DROPIN_DIR = "config.d"
DROPIN_SUFFIX = ".toml"
DEFAULT_SOURCE = "default"


def dropin_dir(config_path: str | Path | None = None) -> Path:
    """The drop-in directory of a config file: ``config.d`` beside it."""
    return Path(config_path if config_path is not None else DEFAULT_PATH).parent / DROPIN_DIR


@dataclass(frozen=True)
class Loaded:
    """The merged config and where it came from.

    ``files``: every file read, in order (the config file, when it exists, then the drop-ins);
    ``sources``: ``"section.key"`` -> the file that set the key last (a key in none: the
    default); ``ignored``: ``(path, why)`` for entries of ``config.d/`` that were not read.
    """

    config: Config
    files: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)
    ignored: tuple[tuple[str, str], ...] = ()

    def source_of(self, key: str) -> str:
        return self.sources.get(key, DEFAULT_SOURCE)


def list_dropins(
    d: Path, extra: Path | None = None
) -> tuple[list[Path], list[tuple[str, str]], list[ConfigError]]:
    """The drop-ins to read, in order; the entries left out and why; the errors.

    Read: names ending in ``.toml`` that do not start with a dot. Left out (reported): other
    names (``README``, ``50-x.toml.dpkg-old``, ``x.toml~``); dot files (the temporary name of an
    atomic write) are left out silently. ``extra`` (``config check --drop-in``) takes the place
    of the drop-in with its name, or its own place in the order.
    """
    files: dict[str, Path] = {}
    ignored: list[tuple[str, str]] = []
    errors: list[ConfigError] = []
    try:
        st = os.stat(d)
    except FileNotFoundError:
        st = None
    except OSError as e:
        errors.append(ConfigError(str(d), f"cannot read: {e.strerror or e}"))
        st = None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            errors.append(ConfigError(str(d), "is not a directory: refused"))
        elif st.st_mode & stat.S_IWOTH:
            errors.append(ConfigError(str(d), _world_writable(st.st_mode)))
        else:
            try:
                names = os.listdir(d)
            except OSError as e:
                errors.append(ConfigError(str(d), f"cannot read: {e.strerror or e}"))
                names = []
            for name in names:
                if name.startswith("."):
                    continue
                if not name.endswith(DROPIN_SUFFIX) or name == DROPIN_SUFFIX:
                    ignored.append((str(d / name), f"not a *{DROPIN_SUFFIX} name: not read"))
                    continue
                files[name] = d / name
    if extra is not None:
        files[extra.name] = extra
    return [files[n] for n in sorted(files)], ignored, errors


def load_sources(path: str | Path | None = None, extra_dropin: str | Path | None = None) -> Loaded:
    """Read the config file, then its drop-ins in order, merged per key inside sections (a key
    in a later file replaces the earlier value, lists included; the other keys of the section
    stay). Every file's errors are reported at once, each with its file; the cross-field rules
    run on the merged result. A missing default file is no file (drop-ins still apply); a
    missing file named with ``--config`` is an error (a typo must not silently run the
    defaults)."""
    explicit = path is not None
    p = Path(path) if path is not None else DEFAULT_PATH
    main = _read_file(p, explicit)
    d = dropin_dir(p)
    extra = Path(extra_dropin) if extra_dropin is not None else None
    dropins, ignored, errors = list_dropins(d, extra)
    if not dropins and not errors:  # the single-file case, messages as they always were
        cfg = from_dict(main or {}, str(p))
        files = (str(p),) if main is not None else ()
        return Loaded(cfg, files, _keys_of(main or {}, str(p)), tuple(ignored))
    layers: list[tuple[str, dict[str, Any]]] = []
    if main is not None:
        layers.append((str(p), main))
    for f in dropins:
        try:
            raw = _read_file(f, explicit=True, dropin=True)
        except InvalidConfig as e:
            errors.extend(e.errors)
            continue
        assert raw is not None
        layers.append((str(f), raw))
    for src, raw in layers:  # each file's own mistakes, named with its file
        _, errs = _build(raw)
        errors.extend(dataclasses.replace(e, source=src) for e in errs)
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for src, raw in layers:
        for sec, table in raw.items():
            if isinstance(table, dict):
                merged.setdefault(sec, {}).update(table)
        sources.update(_keys_of(raw, src))
    # The cross-field rules on the merged keys that are valid (a bad key keeps its default).
    cfg, _ = _build(merged)
    errors += [dataclasses.replace(e, source=sources.get(e.path, "")) for e in _cross_checks(cfg)]
    if errors:
        raise InvalidConfig(errors, f"{p} and {d}/")
    return Loaded(cfg, tuple(src for src, _ in layers), sources, tuple(ignored))


def _keys_of(raw: dict[str, Any], src: str) -> dict[str, str]:
    return {
        f"{sec}.{key}": src
        for sec, table in raw.items()
        if isinstance(table, dict)
        for key in table
    }


def load(path: str | Path | None = None) -> Config:
    """The merged config (:func:`load_sources`); raises InvalidConfig listing every error."""
    return load_sources(path).config


def replace(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy of cfg with some keys changed, e.g. ``replace(cfg, agent={"interval": 1.0})``."""
    out: dict[str, Any] = {}
    for name, changes in sections.items():
        out[name] = dataclasses.replace(getattr(cfg, name), **changes)
    return dataclasses.replace(cfg, **out)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _toml_string(v: str) -> str:
    """A TOML basic string: ``\\`` and ``"`` escaped, control characters (and DEL) as
    ``\\uXXXX``; everything else, astral characters included, as itself (JSON's surrogate-pair
    escapes are not valid TOML)."""
    out = []
    for ch in v:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v: object, duration: bool) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if duration and isinstance(v, int | float):
        return _toml_string(format_duration(float(v)))  # "30s", "1h30m": as people write them
    if isinstance(v, int | float):
        return repr(v)  # an int stays an int, a float keeps its point (1.0)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x, False) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def to_toml(cfg: Config, sources: Loaded | None = None) -> str:
    """The effective config as TOML that :func:`load` reads back to the same values (durations
    as ``"30s"``, booleans as ``true``): what ``config show`` prints. With ``sources`` each key
    ends with a comment naming the file that set it, or ``default``."""
    hints = typing.get_type_hints(Config)
    out: list[str] = []
    for sec in dataclasses.fields(Config):
        section = getattr(cfg, sec.name)
        types = typing.get_type_hints(hints[sec.name])
        out.append(f"[{sec.name}]")
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            line = f"{f.name} = {_toml_value(value, types[f.name] is Duration)}"
            if sources is not None:
                # A file name may hold any byte but "/" and NUL: one comment line, printable.
                src = "".join(
                    c if c.isprintable() else "?" for c in sources.source_of(f"{sec.name}.{f.name}")
                )
                line += f"  # {src}"
            out.append(line)
        out.append("")
    return "\n".join(out)


def digest(cfg: Config) -> str:
    """Short, stable digest of the effective config (reported in the `start` line)."""
    import hashlib
    import json

    blob = json.dumps(to_dict(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
