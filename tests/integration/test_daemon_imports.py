"""What ``gce-watchdog run`` loads (docs/performance.md, "The RSS target").

The agent as shipped must stay within 32 MiB RSS, and the named dependencies alone (dnspython,
psutil, PyNaCl; structlog, with the asyncio it imported, until issue 39) take most of them. So
the daemon's path leaves out what it does not use: the other commands' modules, the modules of
rare paths (imported where they are used), and the Compute API client until the chain calls it.
These are module-set checks on a real daemon process, never an RSS threshold: RSS is measured by
``make bench`` only.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from gce_watchdog.testing.simgce import SimGCE
from kit.agent import agent_config
from kit.cli import agent_env
from kit.paths import REPO

pytestmark = pytest.mark.process

# What the agent must not load at steady state, and why.
OTHER_COMMANDS = (  # cli.COMMAND_MODULES: `run` registers the daemon's commands only
    "gce_watchdog.bootstrap.cli",
    "gce_watchdog.bootstrap.fetch",
    "gce_watchdog.bootstrap.install",
    "gce_watchdog.bootstrap.phases",
    "gce_watchdog.faults.cli",
    "gce_watchdog.faults.firewall",
    "gce_watchdog.memory.cli",
    "gce_watchdog.memory.memwatch",
    "gce_watchdog.poller.cli",
    "gce_watchdog.poller.ledger_cli",
    "gce_watchdog.report.cli",
    "gce_watchdog.validate.cli",
    "gce_watchdog.validate.plan",
)
RARE_PATHS = (
    "decimal",  # lib.durations: a duration that is not whole milliseconds, written back
    "difflib",  # vm.config: "did you mean" in a config error
    "getpass",  # daemon.app: who ran disarm/arm
    "gce_watchdog.lib.compute",  # the chain's first Compute API call
    "google.auth",
    "requests",
)
DROPPED = (
    "structlog",  # issue 39: stdlib logging is the one path (vm/logs.py, docs/performance.md)
    "asyncio",  # structlog imported it (and ssl with it); nothing on the daemon's path does
)
NOT_LOADED = OTHER_COMMANDS + RARE_PATHS + DROPPED
# What a daemon that ticked with the default sections does load: without these the test would
# pass for a process that never got as far as a tick.
LOADED = (
    "gce_watchdog.daemon.service",
    "gce_watchdog.daemon.metawatch",
    "gce_watchdog.memory.monitor",
    "gce_watchdog.vm.logs",
    "dns.message",
    "psutil",
    "nacl.signing",
)

# `gce-watchdog run` exactly as __main__ runs it, and at exit (after --max-ticks) the module set.
RUN = """
import atexit, json, sys
out = sys.argv.pop()
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
from gce_watchdog.cli import main
raise SystemExit(main(sys.argv[1:]))
"""

# The real composition root, stopped right after build_agent: what is loaded before any thread of
# the agent runs (dnspython and psutil must be, see lib.dns.preload and memory.samplers.preload).
BUILT = """
import json, sys
from gce_watchdog.daemon import app
from gce_watchdog.daemon.sdnotify import Notifier
from gce_watchdog.vm.runtime import load_config_or_exit, open_console
cfg = load_config_or_exit(sys.argv[1])
console = open_console(cfg)
agent, prober = app.build_agent(cfg, console.emitter, Notifier(), config_path=sys.argv[1])
mods = sorted(sys.modules)
prober.close()
console.close()
open(sys.argv[2], "w").write(json.dumps(mods))
"""


def _unexpected(mods: set[str]) -> list[str]:
    """The names of NOT_LOADED in ``mods``."""
    return sorted(m for m in NOT_LOADED if m in mods)


def _config(tmp_path: Path, sim: SimGCE) -> Path:
    """The default sections (metadata watch, memory watch, exporter) and one egress target by
    name, resolved through the simulated DNS as the default targets are on a VM."""
    assert sim.tcp is not None and sim.dns is not None
    return agent_config(
        tmp_path,
        sim,
        egress={
            "targets": [f"egress.test:{sim.tcp.port}"],
            "dns_servers": [f"127.0.0.1:{sim.dns.port}"],
        },
    )


def _sim() -> SimGCE:
    return SimGCE(dns=("127.0.0.1", 0), records={"egress.test": ["127.0.0.1"]})


def _modules(
    tmp_path: Path, script: str, args: Callable[[Path], list[str]], timeout: float
) -> set[str]:
    """The module set that ``script`` (RUN or BUILT) writes at its end, run with ``args(config)``
    and the output path against the simulated GCE of ``_sim`` and ``_config``."""
    out = tmp_path / "modules.json"
    with _sim() as sim:
        cfg = _config(tmp_path, sim)
        r = subprocess.run(
            [sys.executable, "-c", script, *args(cfg), str(out)],
            cwd=REPO,
            env=agent_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    assert r.returncode == 0, r.stderr
    return set(json.loads(out.read_text()))


def test_the_daemon_leaves_out_what_it_does_not_use(tmp_path: Path) -> None:
    mods = _modules(
        tmp_path, RUN, lambda cfg: ["run", "--config", str(cfg), "--max-ticks", "3"], 120
    )
    serial = (tmp_path / "ttyS0").read_text()
    assert " heartbeat " in serial and " dns=ok " in serial, serial[-2000:]
    assert [m for m in LOADED if m not in mods] == []
    assert _unexpected(mods) == []


def test_dnspython_and_psutil_load_before_the_threads_start(tmp_path: Path) -> None:
    mods = _modules(tmp_path, BUILT, lambda cfg: [str(cfg)], 60)
    assert {"dns.message", "dns.rdatatype", "psutil"} <= mods
    assert _unexpected(mods) == []


def test_the_names_are_real_and_the_full_parser_loads_the_other_commands() -> None:
    # A renamed module would make the checks above pass for nothing.
    for name in NOT_LOADED + LOADED:
        assert importlib.util.find_spec(name) is not None, name
    r = subprocess.run(
        [sys.executable, "-c", "import json, sys, gce_watchdog.cli as c; c.build_parser();"
         " print(json.dumps(sorted(sys.modules)))"],
        cwd=REPO, env=agent_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    mods = set(json.loads(r.stdout))
    assert [m for m in OTHER_COMMANDS if m not in mods] == []
