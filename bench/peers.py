"""The watchers compared by the benchmark: this agent, monit and watchdog(8), as files and argv.

Every watcher gets its own folder; nothing here touches /etc/monit, /etc/watchdog.conf or
/dev/watchdog. The "shutdown action" of a peer is :data:`RECORD_SH`: it appends the wall-clock
time to a file and exits 0, which is all it does.

The rule all of them approximate: "both the metadata server (HTTP with ``Metadata-Flavor:
Google``) and TCP 443 failed on N consecutive checks" (AND across two checks).

- agent: expresses it natively (one tick probes both, the ladder climbs only when both fail).
- monit, native: one ``check host`` per path, each ``if failed ... for N cycles then exec``. Monit
  has no AND across services, so this is OR: either path down for N cycles fires.
- monit, script: ``check program`` running :data:`BOTH_SH` (which exits 1 only when both paths
  fail) ``if status != 0 for N cycles then exec``: AND, but the logic lives in a shell script.
- watchdog(8), ping: ``ping =`` both addresses; ICMP only (no port, no HTTP header), and each
  target is its own error source: OR. ``retry-timeout`` is wall-clock seconds of persisting error,
  not a count of checks.
- watchdog(8), test-binary: :data:`BOTH_SH` as ``test-binary``, the recorder as
  ``repair-binary``: AND via the script, wall-clock retry as above.

watchdog(8) is run so that it cannot act on this machine: no ``watchdog-device`` (keep-alive
disabled, /dev/watchdog never opened), ``-q`` (no reboot or halt; repair still runs), a repair
binary that always reports success with ``repair-maximum = 0`` (a successful repair always
blocks a reboot), no pid file (``-f``), its own log and test directories, and inside its own PID
and mount namespace (``unshare --pid --fork --mount-proc``), where even a soft reboot's
``kill(-1)`` or ``reboot(2)`` would only end that namespace.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

METADATA_IP = "169.254.169.254"
METADATA_PATH = "/computeMetadata/v1/instance/id"

RECORD_SH = """#!/bin/sh
# The peers' "shutdown action": record when it ran, do nothing else.
date +%s.%N >> {fired}
exit 0
"""

# Both probes at once, each bounded; exit 1 only when BOTH fail (the agent's climb rule).
BOTH_SH = """#!/bin/bash
printf . >> {counter}
curl -s -o /dev/null -D - -m {timeout} -H 'Metadata-Flavor: Google' \\
  'http://{md_ip}{md_path}' 2>/dev/null | grep -qi '^metadata-flavor: *google' &
m=$!
timeout {timeout} bash -c '</dev/tcp/{eg_ip}/{eg_port}' 2>/dev/null &
e=$!
wait $m; rm=$?
wait $e; re=$?
[ $rm -eq 0 ] || [ $re -eq 0 ]
"""


@dataclass(frozen=True)
class Watcher:
    """One contestant: how it is configured and what it can express."""

    name: str
    kind: str  # "agent" | "monit" | "watchdog"
    interval: float  # seconds between checks (cycle length for the peers)
    threshold: int  # consecutive failed checks that fire
    timeout: float  # per-probe timeout
    expresses_and: bool
    how: str  # one line: how the rule is written for this watcher


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    fired: Path  # peers: the recorder's file; agent: its serial file
    counter: Path | None  # script check invocations (one per cycle), when there is a script
    workdir: Path


def _write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


def _exe(path: Path, text: str) -> Path:
    return _write(path, text, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH)


def _secs(x: float) -> str:
    return f"{x:g}s"


def agent_config(
    d: Path,
    interval: float,
    timeout: float,
    threshold: int,
    targets: list[str],
    dns_timeout: float | None = None,
    heartbeat_every: int = 10,
) -> Path:
    """An agent config: dry-run action, every path in d, real metadata URL (169.254.169.254)."""
    dns = dns_timeout if dns_timeout is not None else min(2.0, timeout / 2)
    tg = ", ".join(f'"{t}"' for t in targets)
    d.mkdir(parents=True, exist_ok=True)
    (d / "serial.log").touch()  # the "serial device": a missing one is unusable (fallback file)
    return _write(
        d / "agent.toml",
        f"""[agent]
interval = "{_secs(interval)}"
probe_timeout = "{_secs(timeout)}"
threshold = {threshold}
heartbeat_every = {heartbeat_every}
state_dir = "{d}/state"
run_dir = "{d}/run"
action = "dry-run"

[egress]
targets = [{tg}]
dns_timeout = "{_secs(dns)}"

[serial]
device = "{d}/serial.log"
fallback_file = "{d}/serial-fallback.log"
""",
    )


def agent_launch(py: str, cfg: Path) -> Launch:
    d = cfg.parent
    argv = [py, "-m", "gce_watchdog", "run", "--config", str(cfg)]
    return Launch(argv, d / "serial.log", None, d)


def both_script(d: Path, timeout: float, eg_ip: str, eg_port: int = 443) -> tuple[Path, Path]:
    counter = d / "cycles"
    path = _exe(
        d / "both.sh",
        BOTH_SH.format(
            counter=counter, timeout=f"{timeout:g}", md_ip=METADATA_IP, md_path=METADATA_PATH,
            eg_ip=eg_ip, eg_port=eg_port,
        ),
    )  # fmt: skip
    return path, counter


def record_script(d: Path) -> tuple[Path, Path]:
    fired = d / "fired"
    return _exe(d / "record.sh", RECORD_SH.format(fired=fired)), fired


def monit_launch(d: Path, w: Watcher, eg_ip: str, script: bool) -> Launch:
    """monit in the foreground (``-I``) with a control file of its own (mode 0600, as monit
    requires). Cycle: ``set daemon`` (whole seconds); network timeout: ``set limits``."""
    rec, fired = record_script(d)
    ms = max(1, round(w.timeout * 1000))
    head = f"""set daemon {max(1, round(w.interval))}
set init
set logfile {d}/monit.log
set pidfile {d}/monit.pid
set idfile {d}/monit.id
set statefile {d}/monit.state
set limits {{ networktimeout: {ms} ms }}
"""
    counter: Path | None = None
    secs = max(1, math.ceil(w.timeout))  # a port test's timeout is whole seconds
    if script:
        both, counter = both_script(d, w.timeout, eg_ip)
        ptimeout = max(2, round(w.timeout) + 1)  # whole seconds; the script bounds itself
        body = f"""check program both with path "{both}" with timeout {ptimeout} seconds
  if status != 0 for {w.threshold} cycles then exec "{rec}"
"""
    else:
        body = f"""check host metadata with address {METADATA_IP}
  if failed port 80 protocol http
     with http headers [Metadata-Flavor: Google]
     and request "{METADATA_PATH}"
     with timeout {secs} seconds
     for {w.threshold} cycles
  then exec "{rec}"
check host egress with address {eg_ip}
  if failed port 443 with timeout {secs} seconds for {w.threshold} cycles then exec "{rec}"
"""
    rc = _write(d / "monitrc", head + body, 0o600)
    return Launch(["monit", "-I", "-c", str(rc)], fired, counter, d)


def watchdog_launch(d: Path, w: Watcher, eg_ip: str, script: bool) -> Launch:
    """watchdog(8) with no device, no action, its own dirs, inside its own PID namespace.

    ``retry-timeout``: an error source fires once it has persisted MORE than this many seconds;
    with checks every ``interval`` the N-th consecutive failure comes (N-1) intervals after the
    first, so (N-1)*interval - 1 fires on the N-th check when each cycle takes exactly one
    interval (a slow check stretches the cycle: the rule is wall-clock, not a count).
    """
    rec, fired = record_script(d)
    (d / "testdir").mkdir(parents=True, exist_ok=True)
    (d / "log").mkdir(parents=True, exist_ok=True)
    retry = max(1, round((w.threshold - 1) * w.interval) - 1)
    lines = [
        f"interval = {max(1, round(w.interval))}",
        f"retry-timeout = {retry}",
        f"repair-binary = {rec}",
        "repair-timeout = 5",
        "repair-maximum = 0",
        f"log-dir = {d}/log",
        f"test-directory = {d}/testdir",
        "admin =",
        "realtime = no",
        "verbose = 0",
    ]
    counter: Path | None = None
    if script:
        both, counter = both_script(d, w.timeout, eg_ip)
        lines += [f"test-binary = {both}", f"test-timeout = {max(1, round(w.timeout) + 1)}"]
    else:
        lines += [f"ping = {METADATA_IP}", f"ping = {eg_ip}", "ping-count = 1"]
    conf = _write(d / "watchdog.conf", "\n".join(lines) + "\n")
    argv = ["unshare", "--pid", "--fork", "--mount-proc",
            "watchdog", "-F", "-q", "-f", "-c", str(conf)]  # fmt: skip
    return Launch(argv, fired, counter, d)


def launch(w: Watcher, d: Path, py: str, eg_ip: str, hb_every: int = 10) -> Launch:
    """Files and argv for watcher w in folder d (created)."""
    d.mkdir(parents=True, exist_ok=True)
    if w.kind == "agent":
        cfg = agent_config(
            d, w.interval, w.timeout, w.threshold, [f"{eg_ip}:443"], heartbeat_every=hb_every
        )
        return agent_launch(py, cfg)
    if w.kind == "monit":
        return monit_launch(d, w, eg_ip, script=w.name.endswith("script"))
    if w.kind == "watchdog":
        return watchdog_launch(d, w, eg_ip, script=w.name.endswith("test"))
    raise ValueError(f"unknown watcher kind {w.kind!r}")


def peer_watchers(threshold: int, timeout: float) -> list[Watcher]:
    """The four peer set-ups, at their shortest cycle (1 s: both count whole seconds).

    monit's port tests take whole seconds of timeout (``set limits { networktimeout }`` does not
    shorten them), so its native set-up runs with max(1, ceil(timeout)).
    """
    return [
        Watcher("monit-native", "monit", 1.0, threshold, float(max(1, math.ceil(timeout))), False,
                "two `check host` (HTTP with header; port 443), each `for N cycles then exec`"),
        Watcher("monit-script", "monit", 1.0, threshold, timeout, True,
                "`check program` (both-probes script) `if status != 0 for N cycles then exec`"),
        Watcher("watchdog-ping", "watchdog", 1.0, threshold, timeout, False,
                "`ping =` both addresses, `retry-timeout`, `repair-binary`"),
        Watcher("watchdog-test", "watchdog", 1.0, threshold, timeout, True,
                "`test-binary` (both-probes script), `retry-timeout`, `repair-binary`"),
    ]  # fmt: skip
