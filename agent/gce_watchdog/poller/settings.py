"""``gce-watchdog poll``'s settings: one frozen value, built and checked once.

:func:`poll_settings` turns the parsed options (a mapping, e.g. ``vars(args)``: this module does
not know argparse) into a :class:`PollSettings`, or raises :class:`InvalidSettings` listing every
problem at once, the way ``vm/config.py`` checks a config file. Nothing downstream reads the
command line again: :mod:`gce_watchdog.poller.app` builds everything from this value.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gce_watchdog.lib.compute import label_filter as label_filter_of
from gce_watchdog.lib.compute import parse_label, validate_target
from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.poller.brake import BrakeRule, parse_share
from gce_watchdog.poller.journal import LOG_CHANGES, LOG_EVERY, LOG_MODES
from gce_watchdog.poller.verdict import Policy

# The values of the options, parsed here and nowhere else: the modules they configure import
# them from this one, never the other way round.

# A topic's resource name (Pub/Sub resource names: a topic id starts with a letter, 3-255 of
# letters, digits and - _ . ~ + %).
TOPIC_RE = re.compile(r"projects/[^/\s]+/topics/[A-Za-z][-A-Za-z0-9._~%+]{2,254}\Z")
SUBSCRIPTION_RE = re.compile(
    r"projects/[a-z][-a-z0-9:.]{4,61}[a-z0-9]/subscriptions/[A-Za-z][-\w.~+%]{2,254}\Z"
)
# The URI schemes libpq accepts (PostgreSQL docs, "Connection URIs": postgresql:// or
# postgres://). Any other scheme://... is refused, never taken for a SQLite file name.
POSTGRES_SCHEMES = ("postgresql", "postgres")
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


# The verdict's policy options: (argparse dest, the value that turns the Policy field on, the
# field). One table for every mode of ``poll`` (instance names, --label, --pubsub: one
# PollSettings) and for ``parse`` (which has none of these flags: poll's defaults).
POLICY_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("on_ended_unread", "failover", "ended_unread_failover"),
    ("on_unverified", "failover", "unverified_failover"),
    ("on_planned_stop", "wait", "planned_stop_wait"),
    ("on_gpu_fault", "report", "gpu_fault_report"),
    ("on_job_stuck", "report", "job_stuck_report"),
)


def policy_of(v: Mapping[str, Any]) -> Policy:
    """The verdict's policy from parsed options (an option not given: poll's default);
    ValueError for a bad ``drain_timeout``."""
    on = {field: v.get(dest) == value for dest, value, field in POLICY_OPTIONS}
    return Policy(drain_timeout_s=parse_duration(v["drain_timeout"]), **on)


def ledger_backend(spec: str | Path) -> str:
    """``"postgresql"`` or ``"sqlite"`` for a ``--ledger`` value; ValueError for a URL of any other
    scheme (``mysql://``, ``postgresql+psycopg://``, ``sqlite:///``). A SQLite path there would
    give each host a private ledger, and exactly-once across hosts would be lost without a word.
    The message names only the scheme: the URL may carry a password."""
    if isinstance(spec, Path):
        return "sqlite"
    m = _SCHEME_RE.match(spec)
    if m is None:
        return "sqlite"
    if m.group(1) in POSTGRES_SCHEMES:
        return "postgresql"
    raise ValueError(
        f"unknown URL scheme {m.group(1)!r}: want a postgresql:// URL or a SQLite file path"
    )


class Mode(enum.Enum):
    """What one ``poll`` runs: one loop per mode in :mod:`gce_watchdog.poller.app`."""

    INSTANCES = "instances"  # --project --zone INSTANCE...
    FLEET = "fleet"  # --label KEY[=VALUE] --project P...
    PUBSUB = "pubsub"  # --pubsub projects/P/subscriptions/S [--label ... for the sweep]


@dataclass(frozen=True)
class ApiSettings:
    """How the Compute API is reached."""

    base: str | None  # None: lib.compute.DEFAULT_API_BASE
    token_file: str | None  # a bearer token's file; None: application default credentials
    attempts: int  # attempts per call on rate limits and transient errors


@dataclass(frozen=True)
class PubSubSettings:
    subscription: str  # projects/P/subscriptions/S
    settle_s: float  # how long a gap in a boot's line numbers is waited for
    sweep_s: float  # with --label: time between Compute API sweeps


@dataclass(frozen=True)
class EvidenceSettings:
    """Where the poller looks before it says ``ended_unread`` (docs/poller.md, "Evidence")."""

    peer_cursor_dirs: tuple[str, ...] = ()  # --peer-cursor-dir, read only
    logging: bool = False  # --logging-evidence: Cloud Logging's serial export
    logging_api_base: str | None = None  # None: cloudlogging.DEFAULT_LOGGING_API_BASE


@dataclass(frozen=True)
class HealthSettings:
    """``--health-port``: GET /healthz for Cloud Run's probes (docs/poller.md, "Cloud Run")."""

    address: str
    port: int
    stall_s: float  # no progress for this long: 503


@dataclass(frozen=True)
class PollSettings:
    projects: tuple[str, ...]
    zone: str | None
    instances: tuple[str, ...]
    label_filter: str | None  # the aggregatedList filter --label makes; None: no --label
    pubsub: PubSubSettings | None
    workers: int  # polls running at once
    budget: float  # Compute API requests per minute per project
    once: bool
    interval_s: float  # time between rounds (with --once: what the budget is planned for)
    max_polls: int  # rounds before stopping; 0: until SIGTERM
    ledger: str | None  # a SQLite path or a postgresql:// URL; None: the default file
    announce_lease_s: float
    cursor_dir: str | None  # None: the default directory
    json: bool
    reap: bool
    api: ApiSettings
    policy: Policy
    # --on-failover: the dispatcher's argv, run per announced decision (poller/hooks.py)
    on_failover: tuple[str, ...] = ()
    on_failover_timeout_s: float = 60.0
    brake: BrakeRule | None = None  # --brake; None: off (poll_settings: on by default)
    publish: str | None = None  # --publish projects/P/topics/T
    evidence: EvidenceSettings = EvidenceSettings()
    health: HealthSettings | None = None  # --health-port; None: no health endpoint
    # --log: every outcome every round, or only changes and a summary per round
    # (poller/journal.py); without --log: every with --json (as it always was), else changes
    log: str = LOG_EVERY

    @property
    def mode(self) -> Mode:
        if self.pubsub is not None:
            return Mode.PUBSUB
        return Mode.FLEET if self.label_filter is not None else Mode.INSTANCES

    @property
    def wait_s(self) -> float:
        """The wait between rounds: none with ``--once`` (one round, then exit)."""
        return 0.0 if self.once else self.interval_s


class InvalidSettings(ValueError):
    """Every problem with the options, each a line for stderr."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = tuple(errors)


def poll_settings(v: Mapping[str, Any]) -> PollSettings:
    """The settings from ``poll``'s parsed options (their argparse ``dest`` names)."""
    errs: list[str] = []
    projects = tuple(v["project"])
    instances = tuple(v["instances"])
    zone: str | None = v["zone"]
    pubsub: PubSubSettings | None = None
    if v["pubsub"] is not None:
        pubsub = _pubsub(v, errs)
    label_filter: str | None = None
    if v["label"] is not None:
        if instances or zone:
            errs.append("--label polls every zone: give neither INSTANCE names nor --zone")
        try:
            label_filter = label_filter_of(*parse_label(v["label"]))
        except ValueError as exc:
            errs.append(f"--label: {exc}")
        if not projects:  # (it would list nothing and poll nothing, every round)
            errs.append("--label needs at least one --project: the projects it lists")
        for project in projects:  # (any valid zone: only the project is checked here)
            errs += validate_target(project, "us-central1-a", [])
    elif v["pubsub"] is not None:  # --project: where a deciding instance's id is looked up
        for project in projects:
            errs += validate_target(project, "us-central1-a", [])
    elif len(projects) != 1 or not zone or not instances:
        errs.append("give one --project, --zone and INSTANCE names, or --label")
    else:
        errs += validate_target(projects[0], zone, list(instances))
    if v["workers"] < 1:
        errs.append("--workers must be >= 1")
    if not v["budget"] > 0:
        errs.append("--budget must be > 0 requests per minute")
    interval_s, policy = 0.0, None
    try:
        interval_s = parse_duration(v["interval"])
        if interval_s <= 0:
            errs.append("--interval must be > 0")
        policy = policy_of(v)
    except ValueError as exc:
        errs.append(str(exc))
    lease_s = 0.0
    try:
        lease_s = parse_duration(v["announce_lease"])
        if lease_s <= 0:
            errs.append("--announce-lease must be > 0")
    except ValueError as exc:
        errs.append(f"--announce-lease: {exc}")
    backend = "sqlite"
    if v["ledger"] is not None:
        try:
            backend = ledger_backend(v["ledger"])
        except ValueError as exc:
            errs.append(f"--ledger: {exc}")
    shared = str(v.get("shared_ledger") or "")
    if shared not in ("", "required"):
        errs.append(f"GCE_WATCHDOG_SHARED_LEDGER={shared!r}: want `required` or empty")
    elif shared == "required" and backend != "postgresql":
        errs.append(
            "GCE_WATCHDOG_SHARED_LEDGER=required (the container image): its replicas share no "
            "disk and none outlives a restart, so a SQLite ledger would decide and announce "
            "every failover again; give --ledger postgresql://... (or $GCE_WATCHDOG_LEDGER), or "
            "set GCE_WATCHDOG_SHARED_LEDGER= for one replica with a durable volume"
        )
    health = _health(v, errs)
    if v["api_attempts"] < 1:
        errs.append("--api-attempts must be >= 1")
    if v["max_polls"] < 0:
        errs.append("--max-polls must be >= 0")
    on_failover, hook_timeout_s = _on_failover(v, errs)
    brake = _brake(v.get("brake") or "on", errs)
    publish: str | None = v.get("publish")
    if publish is not None and not TOPIC_RE.match(publish):
        errs.append(f"--publish {publish!r}: want projects/PROJECT/topics/NAME")
    evidence = _evidence(v, errs)
    log = v.get("log")
    if log is None:
        log = LOG_EVERY if v["json"] else LOG_CHANGES
    elif log not in LOG_MODES:
        errs.append(f"--log {log!r}: want {' or '.join(LOG_MODES)}")
    if errs or policy is None:
        raise InvalidSettings(errs)
    return PollSettings(
        projects=projects,
        zone=zone,
        instances=instances,
        label_filter=label_filter,
        pubsub=pubsub,
        workers=v["workers"],
        budget=v["budget"],
        once=v["once"],
        interval_s=interval_s,
        max_polls=v["max_polls"],
        ledger=v["ledger"],
        announce_lease_s=lease_s,
        cursor_dir=v["cursor_dir"],
        json=v["json"],
        reap=v["reap"],
        api=ApiSettings(v["api_base"], v["access_token_file"], v["api_attempts"]),
        policy=policy,
        on_failover=on_failover,
        on_failover_timeout_s=hook_timeout_s,
        brake=brake,
        publish=publish,
        evidence=evidence,
        health=health,
        log=log,
    )


def _evidence(v: Mapping[str, Any], errs: list[str]) -> EvidenceSettings:
    peers = tuple(str(d) for d in v.get("peer_cursor_dir") or ())
    own = v.get("cursor_dir")
    for d in peers:
        if not d.strip():
            errs.append("--peer-cursor-dir needs a directory")
        elif own is not None and d.rstrip("/") == str(own).rstrip("/"):
            errs.append(f"--peer-cursor-dir {d!r} is this poller's own --cursor-dir")
    base = v.get("logging_api_base")
    if base is not None and not str(base).startswith(("https://", "http://")):
        errs.append(f"--logging-api-base {base!r}: want an http(s):// URL")
    return EvidenceSettings(peers, bool(v.get("logging_evidence")), base)


def _on_failover(v: Mapping[str, Any], errs: list[str]) -> tuple[tuple[str, ...], float]:
    import shlex

    raw = v.get("on_failover")
    timeout_s = 60.0
    try:
        timeout_s = parse_duration(v.get("on_failover_timeout") or "60s")
        if timeout_s <= 0:
            errs.append("--on-failover-timeout must be > 0")
    except ValueError as exc:
        errs.append(f"--on-failover-timeout: {exc}")
    if raw is None:
        return (), timeout_s
    try:
        argv = tuple(shlex.split(raw))  # an argv: no shell ever sees it
    except ValueError as exc:
        errs.append(f"--on-failover {raw!r}: {exc}")
        return (), timeout_s
    if not argv:
        errs.append("--on-failover needs a command")
    return argv, timeout_s


def _health(v: Mapping[str, Any], errs: list[str]) -> HealthSettings | None:
    port = v.get("health_port")
    stall_s = 600.0
    try:
        stall_s = parse_duration(v.get("health_stall") or "10m")
        if stall_s <= 0:
            errs.append("--health-stall must be > 0")
    except ValueError as exc:
        errs.append(f"--health-stall: {exc}")
    if port is None:
        return None
    if not 0 < int(port) < 65536:
        errs.append(f"--health-port {port}: want 1..65535")
        return None
    return HealthSettings(str(v.get("health_address") or "0.0.0.0"), int(port), stall_s)


def _brake(raw: str, errs: list[str]) -> BrakeRule | None:
    """``--brake``: ``on`` (the defaults), ``off``, or ``SHARE/WINDOW[/FLOOR]``."""
    if raw == "off":
        return None
    if raw == "on":
        return BrakeRule()
    parts = raw.split("/")
    try:
        if len(parts) not in (2, 3):
            raise ValueError("want on, off or SHARE/WINDOW[/FLOOR], e.g. 10%/10m/3")
        floor = int(parts[2]) if len(parts) == 3 else BrakeRule().floor
        return BrakeRule(parse_share(parts[0]), parse_duration(parts[1]), floor)
    except ValueError as exc:
        errs.append(f"--brake {raw!r}: {exc}")
        return None


def _pubsub(v: Mapping[str, Any], errs: list[str]) -> PubSubSettings | None:
    subscription: str = v["pubsub"]
    if not SUBSCRIPTION_RE.match(subscription):
        errs.append(f"--pubsub {subscription!r}: want projects/PROJECT/subscriptions/NAME")
    if v["instances"] or v["zone"]:
        errs.append("--pubsub takes no INSTANCE names nor --zone (--label for the sweep)")
    try:
        settle_s = parse_duration(v["settle"])
        sweep_s = parse_duration(v["sweep_interval"])
        if sweep_s <= 0:
            errs.append("--sweep-interval must be > 0")
    except ValueError as exc:
        errs.append(str(exc))
        return None
    return PubSubSettings(subscription, settle_s, sweep_s)
