"""``make bench``: the agent against monit and watchdog(8), side by side, in one run.

Usage::

    python -m bench.run [--quick | --tiny] [--out bench/results/latest.json]
                        [--doc docs/performance.md | --no-doc] [--no-peers]

Everything runs in a fresh vm/gce network-namespace pair (tests/kit/netns.py) with the simulated GCE
(testing.simgce) in the gce namespace: the agent sees the real metadata address and resolves names
through the fake DNS, exactly as on a VM. Faults are a black hole at the far end: iptables DROP in
the gce namespace's INPUT for every packet to 169.254.169.254 and to the 443 host, so probes
time out as they do when a VM's network wedges (a DROP on the VM's own OUTPUT fails some sends
at once with EPERM instead, which no watcher would then have to wait for).

Sections (all in one run; ``results["sections"]`` lists what ran and why something was skipped):

1. startup: spawn to ``start`` line and to the first tick, RSS after the first tick, and
   ``python -X importtime`` of the same command.
2. overhead: the default config (per-tick work from a fast run of the same config, and one whole
   30 s period at the real interval), and at 1 s side by side with the peers (CPU per check cycle,
   RSS/PSS/USS after ~100 cycles).
3. blackhole: tick wall time with both paths black-holed (bench/tickwall.py).
4. detection: fault instant to shutdown action, every watcher watching the same fault.
5. decode: bench/bench_decode.py (the poller's decoder vs ``grep -F -c``).
6. journal: bench/journal.py, the poller's output for 1,000 VMs at 30 s, ``--log every`` against
   ``--log changes``, in bytes a day (a simulated fleet, no network; issue 38).
7. fleet: bench/bench_fleet.py in its own process (the central side: polling 1,000 and 5,000
   VMs, and the Pub/Sub path, 3 workers at twice the stream of 5,000 VMs, on the emulator and
   PostgreSQL), so that its figures are targets of the same run (issue 38 item 4).

Every process and namespace is torn down on exit, also on errors, Ctrl-C and SIGTERM (which
unwinds like Ctrl-C; a section's own process gets SIGTERM and a grace first: ``run_child``);
every wait is bounded. Needs root (namespaces, iptables); without it the network sections are
skipped with the reason and the decode section still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import platform
import queue
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "agent"))
sys.path.insert(0, str(REPO / "tests"))

from bench import analysis, exit_on_sigterm, peers, report  # noqa: E402
from bench.peers import Watcher  # noqa: E402

PY = (
    str(REPO / ".venv" / "bin" / "python")
    if (REPO / ".venv/bin/python").exists()
    else (sys.executable)
)
# The agent as it ships: the start-up script makes a venv from the VM's own python3 (Debian's
# /usr/bin/python3) and pip-installs a wheel into it. `make bench` builds the same thing here
# (.bench-venv: system python3, non-editable install); the dev venv above is a different CPython
# build (pyenv) with an editable install, whose memory figures differ by a few MiB.
DEPLOY_PY_PATH = REPO / ".bench-venv" / "bin" / "python"
DEFAULT_OUT = REPO / "bench" / "results" / "latest.json"
DEFAULT_DOC = REPO / "docs" / "performance.md"
# Names the default config probes; the fake DNS answers them with the 443 stand-in's address.
DEFAULT_TARGETS = ["www.google.com:443", "one.one.one.one:443"]
POLL = 0.02  # how often the runner looks at files and processes (it is not the code under test)
MIB = 1024 * 1024


@dataclass(frozen=True)
class Plan:
    """How much of everything a mode runs."""

    mode: str
    startup_runs: int
    fast_ticks: int  # ticks of the fast run (per-tick work); a multiple of 10
    period_s: float  # interval of the one-whole-period run (30 s: the default)
    side_s: float  # side-by-side healthy phase at 1 s
    side_window_s: float
    blackhole_ticks: int
    blackhole_timeout: float
    detect_runs: int
    threshold: int
    decode_repeats: int
    soak_ticks: int = 20_000  # issue 16: healthy then outage, RSS growth <= 1 MiB
    # issue 38: the dump parse --json and grep -F -c read as whole processes
    decode_process_bytes: int = 64 << 20
    journal_hours: float = 2.0  # issue 38: simulated hours of a 1,000-VM fleet's poller output
    # issue 38 item 7: the detection section again with the machine loaded (busy processes)
    loaded_runs: int = 6
    # issue 38 item 4: bench/bench_fleet.py's arguments (None: the section is skipped; the tiny
    # mode's smoke of it is tests/integration/test_bench_fleet_smoke.py)
    fleet_args: tuple[str, ...] | None = ()


QUICK = ("--sizes", "1000", "--pubsub-sizes", "5000")  # the quick mode's fleet: ~4 minutes
PLANS = {
    "full": Plan("full", 7, 100, 30.0, 100.0, 10.0, 10, 1.0, 10, 10, 15),
    "quick": Plan(
        "quick", 3, 30, 30.0, 20.0, 5.0, 4, 1.0, 3, 10, 5, loaded_runs=3, fleet_args=QUICK
    ),
    "tiny": Plan(
        "tiny", 1, 10, 2.0, 3.0, 1.0, 2, 0.3, 1, 3, 1, 2_000, 1 << 20, 0.05, 1, fleet_args=None
    ),
}


# -- processes -----------------------------------------------------------------------------------


def wait_for(cond: Callable[[], Any], within: float, what: str) -> Any:
    """Poll cond until truthy (returned) or raise TimeoutError after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {within:g}s: {what}")
        time.sleep(POLL)


def own_cpu_ms(pid: int) -> float | None:
    """CPU time of a process's live threads in ms, from /proc/PID/task/*/schedstat (ns
    resolution; /proc/PID/stat counts 10 ms clock ticks, too coarse for a few ms per tick).
    Threads that already exited are not in it: the watchers here keep theirs."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total / 1e6


def proc_usage(pid: int) -> dict[str, float]:
    """CPU (own, and reaped children, ms) and memory (MiB) of a live process."""
    import psutil

    p = psutil.Process(pid)
    t = p.cpu_times()
    m = p.memory_full_info()
    own = own_cpu_ms(pid)
    return {
        "cpu_ms": own if own is not None else (t.user + t.system) * 1000,
        "cpu_children_ms": (t.children_user + t.children_system) * 1000,
        "rss_mib": m.rss / MIB,
        "pss_mib": getattr(m, "pss", 0.0) / MIB,
        "uss_mib": getattr(m, "uss", 0.0) / MIB,
    }


def target_pid(w: Watcher, popen_pid: int) -> int:
    """The watcher's own pid: ``ip netns exec`` execs in place; unshare --fork has one child."""
    if w.kind != "watchdog":
        return popen_pid
    import psutil

    def child() -> int | None:
        for c in psutil.Process(popen_pid).children(recursive=True):
            if c.name() == "watchdog":
                return int(c.pid)
        return None

    return int(wait_for(child, 5.0, "watchdog started under unshare"))


def run_child(
    argv: list[str], timeout: float, grace: float = 30.0, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, text=True, timeout=timeout, **kw)``, but a child cut short (its
    timeout, or SIGTERM or Ctrl-C here) gets SIGTERM and ``grace`` seconds to tear down what it
    started (a soak's idle processes, the fleet's emulator and database) before SIGKILL, which
    subprocess.run sends at once."""
    with subprocess.Popen(argv, text=True, **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            p.terminate()
            try:
                p.communicate(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
            raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def stop_procs(procs: list[subprocess.Popen[Any]], grace: float = 3.0) -> None:
    """SIGTERM, a bounded wait, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.01, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def events(serial: Path) -> list[Any]:
    from gce_watchdog.wire.protocol import decode_all

    try:
        data = serial.read_bytes()
    except FileNotFoundError:
        return []
    return decode_all(data)[0]


def first_event(serial: Path, name: str, pred: Callable[[Any], bool] = lambda e: True) -> Any:
    for e in events(serial):
        if e.event == name and pred(e):
            return e
    return None


def fired_at(w: Watcher, fired: Path) -> float | None:
    """Wall-clock time of the watcher's first shutdown action, or None."""
    if w.kind == "agent":
        from gce_watchdog.wire import vocab

        # The bench's agents run the dry-run action, whose decision is its own event (issue 15).
        decided = (vocab.SHUTDOWN, vocab.DRY_RUN_SHUTDOWN)
        e = next((e for e in events(fired) if e.event in decided), None)
        return e.ts_ms / 1000 if e else None
    try:
        first = fired.read_text().split()
    except FileNotFoundError:
        return None
    return float(first[0]) if first else None


def script_cycles(counter: Path | None) -> int:
    try:
        return len(counter.read_bytes()) if counter else 0
    except FileNotFoundError:
        return 0


class Lines:
    """A process's stdout lines through a reader thread, so every read is bounded."""

    def __init__(self, p: subprocess.Popen[str]) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        assert p.stdout is not None
        out = p.stdout

        def pump() -> None:
            for line in out:
                self.q.put(line)

        threading.Thread(target=pump, daemon=True).start()

    def get(self, within: float, what: str) -> str:
        try:
            return self.q.get(timeout=within)
        except queue.Empty:
            raise TimeoutError(f"no output within {within:g}s: {what}") from None


DEPS_FLOOR_LABEL = "named deps alone: psutil + structlog + dns.message"
NO_BIG_DEPS_LABEL = "run's imports without structlog and dnspython"

# What each import adds to a bare interpreter's RSS (each in a fresh process): where the agent's
# memory goes. The last entry is what `gce-watchdog run` loads before its first tick.
IMPORT_PROBES = [
    ("python (bare)", ""),
    ("psutil", "import psutil"),
    ("structlog", "import structlog"),
    ("dns.message (the probe's DNS codec)", "import dns.message"),
    ("dns.resolver", "import dns.resolver"),
    ("concurrent.futures", "import concurrent.futures"),
    ("ssl (libssl + libcrypto)", "import ssl"),
    ("asyncio (imports ssl)", "import asyncio"),
    # The floor: only the named dependencies the daemon must load (memory watch, the structlog
    # mirror, dnspython resolution), not one line of the agent. Above the RSS target, it makes
    # that target unreachable for any agent that keeps them on its path.
    (DEPS_FLOOR_LABEL, "import psutil, structlog, dns.message"),
    # What `run` loads with neither of the two big ones: what the agent would weigh if the
    # structlog mirror and dnspython resolution were taken off the daemon's path.
    (NO_BIG_DEPS_LABEL,
     "import psutil, gce_watchdog.cli, gce_watchdog.daemon.service, gce_watchdog.daemon.probes,"
     " gce_watchdog.vm.runtime, gce_watchdog.daemon.sdnotify"),
    ("gce_watchdog.daemon.probes", "import gce_watchdog.daemon.probes"),
    ("gce_watchdog.daemon.service", "import gce_watchdog.daemon.service"),
    ("gce_watchdog.vm.logs", "import gce_watchdog.vm.logs"),
    ("gce_watchdog.daemon.actions", "import gce_watchdog.daemon.actions"),
    ("cli parser (all commands)", "import gce_watchdog.cli; gce_watchdog.cli.build_parser()"),
    # what `run` builds: its own module's commands only (cli.COMMAND_MODULES)
    ("cli parser (run's module)",
     "import gce_watchdog.cli as c; c.build_parser(c.modules_for(['run']))"),
    ("run's imports (cli + daemon + probes + logs + dns)",
     "import gce_watchdog.cli as c; c.build_parser(c.modules_for(['run']));"
     " import gce_watchdog.daemon.app, gce_watchdog.daemon.service,"
     " gce_watchdog.daemon.probes, gce_watchdog.vm.logs,"
     " gce_watchdog.vm.runtime, gce_watchdog.daemon.sdnotify, dns.message"),
]  # fmt: skip


def rss_by_import(py: str = PY) -> list[dict[str, Any]]:
    code = (
        "{imp}\nimport re\n"
        "print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    out: list[dict[str, Any]] = []
    base: float | None = None
    for label, imp in IMPORT_PROBES:
        vals = []
        for _ in range(3):  # the median of three fresh interpreters
            r = subprocess.run([py, "-c", code.format(imp=imp)], capture_output=True, text=True,
                               timeout=60, check=False, cwd="/")  # fmt: skip
            if r.returncode == 0 and r.stdout.strip().isdigit():
                vals.append(int(r.stdout.strip()) / 1024)
        m = analysis.summarize(vals)["median"]
        if base is None:
            base = m
        out.append({"import": label, "rss_mib": m,
                    "added_mib": None if m is None or base is None else m - base})  # fmt: skip
    return out


def deploy_py() -> str | None:
    """The shipped-like interpreter (``make bench`` builds it), or None when it is missing."""
    return str(DEPLOY_PY_PATH) if DEPLOY_PY_PATH.exists() else None


def interpreter(py: str) -> dict[str, Any]:
    r = subprocess.run(
        [py, "-c", "import sys, sysconfig; print(sys.version.split()[0], sys.base_prefix,"
         " sysconfig.get_config_var('Py_ENABLE_SHARED'))"],
        capture_output=True, text=True, timeout=30, check=False, cwd="/",
    )  # fmt: skip
    parts = r.stdout.split()
    return {
        "path": py,
        "version": parts[0] if parts else "?",
        "base_prefix": parts[1] if len(parts) > 1 else "?",
        "shared_libpython": parts[2] == "1" if len(parts) > 2 else None,
    }


# -- the fault -----------------------------------------------------------------------------------


def _waiting_for_rules(pid: int) -> bool:
    """Whether pid is iptables-restore itself (``ip netns exec`` has exec'd it) and asleep:
    blocked reading its rules from stdin."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return "tables" in Path(exe).name and state == "S"


def blackhole(topo: Any, on: bool) -> tuple[float, float]:
    """Drop (or stop dropping) every packet to the metadata address and the 443 host at the far
    end, atomically (one iptables-restore commit). Returns wall times before and after.

    To go in, iptables-restore is started first and waits for its rules on stdin; the times
    bracket only writing them, its parse and its commit: not the start of ``ip netns exec`` and
    of iptables-restore, which took up to 60 ms on a loaded machine and would widen the
    uncertainty of the fault instant (issue 38 item 7)."""
    from kit.netns import EGRESS_IP, METADATA_IP

    if not on:
        t0 = time.time()
        r = topo.run_in(topo.gce, ["iptables", "-w", "5", "-F", "INPUT"])
        t1 = time.time()
        if r.returncode != 0:
            raise RuntimeError(f"iptables in {topo.gce}: rc={r.returncode}: {r.stderr.strip()}")
        return t0, t1
    rules = (
        "*filter\n"
        f"-I INPUT -d {METADATA_IP}/32 -j DROP\n"
        f"-I INPUT -d {EGRESS_IP}/32 -j DROP\n"
        "COMMIT\n"
    )
    argv = ["iptables-restore", "-w", "5", "--noflush"]
    p = topo.popen_in(topo.gce, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: _waiting_for_rules(p.pid) or p.poll() is not None, 10, "iptables-restore")
        t0 = time.time()
        _, err = p.communicate(rules, timeout=30)
        t1 = time.time()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    if p.returncode != 0:
        raise RuntimeError(f"iptables-restore in {topo.gce}: rc={p.returncode}: {err.strip()}")
    return t0, t1


# The load of the loaded detection run (issue 38 item 7): this many busy processes per core, at
# the default priority, in the root namespace (the machine's CPUs are what they share).
LOAD_PER_CORE = 2
BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_load(n: int) -> Any:
    """n processes spinning on the CPU for the duration of the block; each is killed (by its own
    pid) and reaped when the block ends, also on errors."""
    procs: list[subprocess.Popen[Any]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", BUSY_LOOP],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


@dataclass
class Tally:
    """What the detection runs collected, per watcher name: latencies from the end of the
    injection (``lat``) and from its start (``lat_before``), early and missed runs, the agents'
    tick lines; per run: the injection's duration and the 1-min load average."""

    lat: dict[str, list[float]]
    lat_before: dict[str, list[float]]
    early: dict[str, int]
    missed: dict[str, int]
    ticks: dict[str, list[str]]
    inject_ms: list[float]
    loadavg: list[float]

    @classmethod
    def of(cls, ws: list[Watcher]) -> Tally:
        names = [w.name for w in ws]
        agents = [w.name for w in ws if w.kind == "agent"]
        return cls({n: [] for n in names}, {n: [] for n in names}, dict.fromkeys(names, 0),
                   dict.fromkeys(names, 0), {n: [] for n in agents}, [], [])  # fmt: skip


# -- sections ------------------------------------------------------------------------------------


class Bench:
    def __init__(
        self, plan: Plan, work: Path, topo: Any, with_peers: bool, log: Callable[..., None]
    ):
        self.plan = plan
        self.work = work
        self.topo = topo
        self.with_peers = with_peers
        self.log = log

    def spawn(self, argv: list[str], d: Path, **kw: Any) -> subprocess.Popen[Any]:
        d.mkdir(parents=True, exist_ok=True)
        out = open(d / "stdout.log", "wb")  # noqa: SIM115 - handed to the child, closed below
        try:
            kw.setdefault("stdout", out)
            kw.setdefault("stderr", subprocess.STDOUT)
            proc: subprocess.Popen[Any] = self.topo.popen_in(self.topo.vm, argv, **kw)
            return proc
        finally:
            out.close()

    # 1. start-up ----------------------------------------------------------------------------
    def startup(self) -> dict[str, Any]:
        p = self.plan
        to_start, to_tick, rss, wall_exec = [], [], [], []
        for i in range(p.startup_runs):
            d = self.work / "startup" / str(i)
            cfg = peers.agent_config(d, 30.0, 5.0, 10, DEFAULT_TARGETS, heartbeat_every=1)
            t_spawn = time.time()
            proc = self.spawn([PY, "-m", "gce_watchdog", "run", "--config", str(cfg)], d)
            try:
                serial = d / "serial.log"
                hb = wait_for(
                    functools.partial(first_event, serial, "heartbeat"), 20, "first heartbeat"
                )
                st = first_event(d / "serial.log", "start")
                to_start.append((st.ts_ms / 1000 - t_spawn) * 1000)
                to_tick.append((hb.ts_ms / 1000 - t_spawn) * 1000)
                rss.append(proc_usage(proc.pid)["rss_mib"])
            finally:
                stop_procs([proc])
        for _ in range(3):  # what `ip netns exec` itself adds to every spawn above
            t0 = time.monotonic()
            self.topo.run_in(self.topo.vm, ["true"])
            wall_exec.append((time.monotonic() - t0) * 1000)
        d = self.work / "startup" / "importtime"
        cfg = peers.agent_config(d, 30.0, 5.0, 10, DEFAULT_TARGETS, heartbeat_every=1)
        r = self.topo.run_in(
            self.topo.vm,
            [
                PY,
                "-X",
                "importtime",
                "-m",
                "gce_watchdog",
                "run",
                "--config",
                str(cfg),
                "--max-ticks",
                "1",
            ],
            timeout=60,
        )
        imports = analysis.import_breakdown(analysis.parse_importtime(r.stderr))
        dpy = deploy_py()
        return {
            "rss_by_import_mib": rss_by_import(),
            "rss_by_import_deployed_mib": rss_by_import(dpy) if dpy else None,
            "interpreters": {"dev": interpreter(PY), "deployed": interpreter(dpy) if dpy else None},
            "config": "defaults (30 s interval, 5 s probe timeout, 2 names via DNS), "
            "heartbeat_every = 1",
            "runs": p.startup_runs,
            "spawn_to_start_ms": analysis.summarize(to_start),
            "spawn_to_first_tick_ms": analysis.summarize(to_tick),
            "rss_after_first_tick_mib": analysis.summarize(rss),
            "netns_exec_ms": analysis.summarize(wall_exec),
            "imports": imports,
            "importtime_rc": r.returncode,
        }

    # 2a. the default config: per-tick work (fast run) and one whole 30 s period -------------
    def fast_run(self, py: str, d: Path) -> dict[str, Any]:
        """The default config at a 0.2 s interval for ``fast_ticks`` ticks under interpreter py:
        CPU per tick (probes + ladder + line) and memory after the run."""
        p = self.plan
        interval, timeout = 0.2, 0.15
        cfg = peers.agent_config(d, interval, timeout, 10, DEFAULT_TARGETS, dns_timeout=0.08)
        # cwd "/": a shipped-like venv must import its installed agent, not this checkout's.
        proc = self.spawn([py, "-m", "gce_watchdog", "run", "--config", str(cfg)], d, cwd="/")
        samples: list[tuple[float, float]] = []
        seen = 0
        dns_ok = 0
        try:
            deadline = time.monotonic() + p.fast_ticks * interval * 3 + 20
            while seen < p.fast_ticks:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fast run: {seen}/{p.fast_ticks} ticks in time")
                hbs = [e for e in events(d / "serial.log") if e.event == "heartbeat"]
                if hbs and int(hbs[-1].get("ticks") or 0) > seen:
                    seen = int(hbs[-1].get("ticks") or 0)
                    samples.append((seen, proc_usage(proc.pid)["cpu_ms"]))
                    dns_ok = sum(1 for e in hbs if e.get("dns") == "ok")
                time.sleep(POLL)
            mem = proc_usage(proc.pid)
            ticks_total = len([e for e in events(d / "serial.log") if e.event == "tick"])
        finally:
            stop_procs([proc])
        # The first window includes start-up (imports, first connections): left out.
        per_tick = (
            analysis.per_window_rates(samples[1:])
            if len(samples) > 2
            else (analysis.per_window_rates(samples))
        )
        return {
            "python": py,
            "interval_s": interval,
            "probe_timeout_s": timeout,
            "ticks": seen,
            "cpu_ms_per_tick": analysis.summarize(per_tick),
            "rss_mib": mem["rss_mib"],
            "pss_mib": mem["pss_mib"],
            "uss_mib": mem["uss_mib"],
            "heartbeats_dns_ok": dns_ok,
            "unhealthy_ticks": ticks_total,
        }

    def overhead_default(self) -> dict[str, Any]:
        p = self.plan
        fast = self.fast_run(PY, self.work / "overhead" / "fast")
        dpy = deploy_py()
        deployed = self.fast_run(dpy, self.work / "overhead" / "fast-deployed") if dpy else None
        # One whole period at the real interval: CPU from right after the first tick's line to
        # right after the second's = one tick's work + everything the agent does in between
        # (memory sampling, metadata watcher, exporter), measured, not extrapolated.
        d = self.work / "overhead" / "period"
        per = p.period_s
        cfg = peers.agent_config(d, per, min(5.0, per / 2), 10, DEFAULT_TARGETS, heartbeat_every=1)
        serial = d / "serial.log"

        def hb(n: int) -> Any:
            return first_event(serial, "heartbeat", lambda e: int(e.get("ticks") or 0) >= n)

        proc = self.spawn([PY, "-m", "gce_watchdog", "run", "--config", str(cfg)], d)
        try:
            wait_for(functools.partial(hb, 1), 20, "first tick (period)")
            a = proc_usage(proc.pid)
            t0 = time.monotonic()
            wait_for(functools.partial(hb, 2), per + 20, "second tick (period)")
            b = proc_usage(proc.pid)
            span = time.monotonic() - t0
        finally:
            stop_procs([proc])
        cpu = b["cpu_ms"] - a["cpu_ms"]
        return {
            "fast": fast,
            "fast_deployed": deployed,
            "period": {
                "interval_s": per,
                "measured_s": span,
                "cpu_ms": cpu,
                "rss_mib": b["rss_mib"],
                "pss_mib": b["pss_mib"],
                "uss_mib": b["uss_mib"],
            },
            "cpu_ms_per_30s_tick": cpu if per == 30.0 else None,
            "cpu_percent": cpu / (span * 10.0) if span else None,
        }

    # 2b. side by side at 1 s, healthy ----------------------------------------------------------
    def overhead_side(self) -> dict[str, Any]:
        from kit.netns import EGRESS_IP

        p = self.plan
        ws = [Watcher("agent-1s", "agent", 1.0, p.threshold, 0.5, True, "")]
        if self.with_peers:
            ws += peers.peer_watchers(p.threshold, 0.5)
        started = self._start(ws, self.work / "overhead" / "side", EGRESS_IP)
        rows: dict[str, Any] = {}
        try:
            time.sleep(2.0)  # warm-up: imports done, first cycles behind us
            pids = {w.name: target_pid(w, pr.pid) for w, (pr, _) in started.items()}
            by = {w.name: w for w in started}
            launches = {w.name: ln for w, (_, ln) in started.items()}
            t_first = time.monotonic()
            snaps: dict[str, list[tuple[float, float, int]]] = {n: [] for n in pids}

            def snap() -> None:
                now = time.monotonic()
                for n, pid in pids.items():
                    u = proc_usage(pid)
                    snaps[n].append((now, u["cpu_ms"] + u["cpu_children_ms"],
                                     script_cycles(launches[n].counter)))  # fmt: skip

            snap()
            end = t_first + p.side_s
            while time.monotonic() < end:
                time.sleep(min(p.side_window_s, max(0.0, end - time.monotonic())))
                snap()
            for n, pid in pids.items():
                mem = proc_usage(pid)
                s = snaps[n]
                own = mem["cpu_ms"]
                per_cycle = []
                for (ta, ca, na), (tb, cb, nb) in itertools.pairwise(s):
                    period = (tb - ta) / (nb - na) if nb > na else by[n].interval
                    per_cycle.append((cb - ca) / (tb - ta) * period)
                total_s = s[-1][0] - s[0][0]
                counted = s[-1][2] - s[0][2]
                rows[n] = {
                    "kind": by[n].kind,
                    "interval_s": by[n].interval,
                    "cpu_ms_per_cycle": analysis.summarize(per_cycle),
                    "cpu_ms_per_s": (s[-1][1] - s[0][1]) / total_s if total_s else None,
                    "cycles_counted": counted or None,
                    "period_s": total_s / counted if counted else by[n].interval,
                    "rss_mib": mem["rss_mib"],
                    "pss_mib": mem["pss_mib"],
                    "uss_mib": mem["uss_mib"],
                    "own_cpu_ms_total": own,
                    "children_cpu_ms_total": mem["cpu_children_ms"],
                }
            agent_serial = launches["agent-1s"].fired
            hbs = [e for e in events(agent_serial) if e.event == "heartbeat"]
            rows["agent-1s"]["ticks"] = int(hbs[-1].get("ticks") or 0) if hbs else 0
        finally:
            stop_procs([pr for pr, _ in started.values()])
            self._sweep()
        return {"duration_s": p.side_s, "window_s": p.side_window_s, "watchers": rows}

    # 3. tick wall time, black-holed --------------------------------------------------------------
    def blackhole_ticks(self) -> dict[str, Any]:
        p = self.plan
        d = self.work / "blackhole"
        t = p.blackhole_timeout
        # A threshold above the tick count: the ladder must not fire (the action chain's linger
        # would then hold the tick); the tick's own cost is what is measured here.
        thr = p.blackhole_ticks + 5
        cfg = peers.agent_config(d, max(2.0, 2 * t), t, thr, DEFAULT_TARGETS, dns_timeout=0.4 * t)
        proc = self.spawn(
            [PY, "-m", "bench.tickwall", "--config", str(cfg), "--ticks", str(p.blackhole_ticks)],
            d, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
        )  # fmt: skip
        lines = Lines(proc)
        try:
            ready = json.loads(lines.get(20, "tickwall ready"))
            blackhole(self.topo, True)
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = json.loads(lines.get(p.blackhole_ticks * (t + 2) + 10, "tickwall ticks"))
        finally:
            with contextlib.suppress(Exception):
                blackhole(self.topo, False)
            stop_procs([proc])
        durs = [r["duration_s"] for r in out["ticks"]]
        limit = t + 0.1
        return {
            "probe_timeout_s": t,
            "dns_timeout_s": 0.4 * t,
            "targets": DEFAULT_TARGETS,
            "first_tick_egress": ready.get("healthy_first"),
            "ticks": out["ticks"],
            "tick_wall_s": analysis.summarize(durs),
            "target_s": limit,
            "all_within_target": all(x <= limit for x in durs),
        }

    # 4. detection latency -----------------------------------------------------------------------
    def watchers(self) -> list[Watcher]:
        p = self.plan
        ws = [
            Watcher("agent-0.5s", "agent", 0.5, p.threshold, 0.25, True,
                    "one tick probes both; the ladder climbs only when both fail"),
            Watcher("agent-1s", "agent", 1.0, p.threshold, 0.5, True,
                    "one tick probes both; the ladder climbs only when both fail"),
            # Probe timeouts close to the interval (issue 16): a failing tick overruns its slot
            # and the next one starts at once; detection must stay within the policy bounds.
            Watcher("agent-1s-t0.9", "agent", 1.0, p.threshold, 0.9, True,
                    "timeout/interval 0.9: failing ticks end at 0.9 s"),
            Watcher("agent-1s-t0.99", "agent", 1.0, p.threshold, 0.99, True,
                    "timeout/interval 0.99: failing ticks overrun the 1 s slot"),
        ]  # fmt: skip
        if self.with_peers:
            ws += peers.peer_watchers(p.threshold, 0.5)
        return ws

    def detection(self) -> dict[str, Any]:
        return self._detection(self.plan.detect_runs, "detect")

    def detection_loaded(self, procs: int | None = None) -> dict[str, Any]:
        """The detection section again with the machine loaded (issue 38 item 7): ``procs`` busy
        processes (LOAD_PER_CORE per core by default) spin for the whole section."""
        n = procs if procs is not None else LOAD_PER_CORE * (os.cpu_count() or 1)
        with busy_load(n):
            res = self._detection(self.plan.loaded_runs, "detect-loaded")
        res["load"] = {
            "busy_procs": n,
            "cores": os.cpu_count(),
            "how": f"{n} x `python -c '{BUSY_LOOP}'` at the default priority, "
            "started before the watchers and killed after the last run",
        }
        return res

    def _detection(self, runs: int, sub: str) -> dict[str, Any]:
        from kit.netns import EGRESS_IP

        ws = self.watchers()
        t = Tally.of(ws)
        for i in range(runs):
            started = self._start(ws, self.work / sub / str(i), EGRESS_IP, hb_every=1)
            try:
                self._detect_once(i, started, t)
                t.loadavg.append(os.getloadavg()[0])
                self.log(f"  {sub} run {i + 1}/{runs}: " + ", ".join(
                    f"{n}={v[-1]:.3f}s" for n, v in t.lat.items() if v))  # fmt: skip
            finally:
                with contextlib.suppress(Exception):
                    blackhole(self.topo, False)
                stop_procs([pr for pr, _ in started.values()])
                self._sweep()
        rows = {}
        for w in ws:
            lo, hi = analysis.policy_bounds(w.interval, w.threshold, w.timeout)
            v, vb = t.lat[w.name], t.lat_before[w.name]
            rows[w.name] = {
                **asdict(w),
                "bounds_s": [lo, hi],
                "latency_s": analysis.summarize(v),
                "values_s": v,
                "within_bounds": sum(1 for x in v if lo - 0.05 <= x <= hi + 0.05),
                # No slack, and from the instant the rules were handed to iptables-restore (the
                # earliest the fault can have been in): a value inside is inside whenever the
                # commit happened.
                "within_bounds_strict": sum(1 for x in vb if lo - 0.05 <= x <= hi),
                "past_bound_ms": max((x - hi) * 1000 for x in vb) if vb else None,
                "fired_before_fault": t.early[w.name],
                "missed": t.missed[w.name],
            }
            if w.name in t.ticks:  # the agent's tick lines after the fault, per run (s after it)
                rows[w.name]["tick_lines_s"] = t.ticks[w.name]  # up to its decision
        return {
            "runs": runs,
            "threshold": self.plan.threshold,
            "fault": "iptables DROP in the gce namespace (INPUT) of all packets to "
            "169.254.169.254 and the 443 host; one iptables-restore commit",
            "inject_uncertainty_ms": analysis.summarize(t.inject_ms),
            "inject_ms": t.inject_ms,
            "loadavg_1m": analysis.summarize(t.loadavg),
            "watchers": rows,
        }

    def _detect_once(
        self, i: int, started: dict[Watcher, tuple[subprocess.Popen[Any], peers.Launch]], t: Tally
    ) -> None:
        """One run: every watcher healthy, the fault in, each one's first action waited for."""
        from gce_watchdog.wire import vocab

        for w, (_, ln) in started.items():
            if w.kind == "agent":
                wait_for(functools.partial(first_event, ln.fired, "heartbeat"), 20,
                         f"{w.name} healthy")  # fmt: skip
        # Peers: at least two healthy cycles before the fault. The random part spreads the
        # fault instant over a whole tick of every watcher (1 s), so the runs sample
        # the policy window instead of always landing at the same tick phase.
        time.sleep(2.5 + random.Random(i).uniform(0.0, 1.0))  # noqa: S311 - not crypto
        t_before, t_inj = blackhole(self.topo, True)
        t.inject_ms.append((t_inj - t_before) * 1000)
        # Bounded: a peer checks serially, so under the fault a cycle can stretch to
        # interval + both timeouts; whoever has not fired by then (+5 s) counts as missed.
        longest = max(w.threshold * (w.interval + 2 * w.timeout) + w.interval for w in started)
        deadline = time.monotonic() + longest + 5
        pending = dict(started)
        decided: dict[str, float] = {}
        while pending and time.monotonic() < deadline:
            for w, (_, ln) in list(pending.items()):
                at = fired_at(w, ln.fired)
                if at is not None:
                    decided[w.name] = at
                    if at < t_before:
                        t.early[w.name] += 1
                    else:
                        t.lat[w.name].append(at - t_inj)
                        t.lat_before[w.name].append(at - t_before)
                    del pending[w]
            time.sleep(POLL)
        for w in pending:
            t.missed[w.name] += 1
        for w, (_, ln) in started.items():
            if w.name in t.ticks:  # up to the decision: where each failing tick's line landed
                end = decided.get(w.name, t_inj + longest + 5)
                t.ticks[w.name].append(" ".join(
                    f"{e.ts_ms / 1000 - t_inj:.3f}" for e in events(ln.fired)
                    if e.event == vocab.TICK and t_before <= e.ts_ms / 1000 <= end
                ))  # fmt: skip

    def _start(self, ws: list[Watcher], base: Path, eg_ip: str, hb_every: int = 10
               ) -> dict[Watcher, tuple[subprocess.Popen[Any], peers.Launch]]:  # fmt: skip
        started: dict[Watcher, tuple[subprocess.Popen[Any], peers.Launch]] = {}
        try:
            for w in ws:
                d = base / w.name
                ln = peers.launch(w, d, PY, eg_ip, hb_every=hb_every)
                started[w] = (self.spawn(ln.argv, d), ln)
        except BaseException:
            stop_procs([pr for pr, _ in started.values()])
            raise
        return started

    def _sweep(self) -> None:
        """Whatever a watcher left behind in the vm namespace (a script's curl) goes too."""
        from kit.netns import kill_ns_pids

        kill_ns_pids(self.topo.vm)


# -- the run ---------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    def first(path: str, key: str) -> str:
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
        return "?"

    def cmd(argv: list[str]) -> str:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return "missing"
        return (r.stdout or r.stderr).strip().splitlines()[0] if (r.stdout or r.stderr) else "?"

    return {
        "cpu": first("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "memory": first("/proc/meminfo", "MemTotal"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "monit": cmd(["monit", "-V"]) if shutil.which("monit") else "missing",
        "watchdog": cmd(["dpkg-query", "-W", "-f", "${Version}", "watchdog"])
        if shutil.which("watchdog")
        else "missing",
        "commit": cmd(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
    }


def peers_unavailable() -> str | None:
    missing = [b for b in ("monit", "watchdog", "unshare", "curl") if shutil.which(b) is None]
    return f"missing: {', '.join(missing)} (make bench installs them)" if missing else None


def run_decode(plan: Plan, work: Path) -> dict[str, Any]:
    script = REPO / "bench" / "bench_decode.py"
    if not script.exists():
        return {"skipped": "bench/bench_decode.py is missing"}
    out = work / "decode.json"
    argv = [PY, str(script), str(out), "--repeats", str(plan.decode_repeats)]
    argv += ["--process-size", str(plan.decode_process_bytes)]
    r = run_child(argv, 900, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if r.returncode == 2 or not out.exists():
        return {"skipped": (r.stderr or r.stdout).strip() or f"rc={r.returncode}"}
    res: dict[str, Any] = json.loads(out.read_text())
    res["rc"] = r.returncode
    return res


FLEET_TIMEOUT_S = 3600  # polling 1,000 and 5,000 VMs and two Pub/Sub streams: ~10 min here


def run_fleet(plan: Plan, work: Path, extra: list[str], log: Callable[..., None]) -> dict[str, Any]:
    """bench/bench_fleet.py in its own process (it starts the fake Compute API, the Pub/Sub
    emulator and PostgreSQL itself), with the plan's arguments and then ``extra``: its results,
    its exit status (``rc``: 1 when a decision was not exactly once) and its argv. Its progress
    lines go to this run's log."""
    out = work / "fleet.json"
    argv = [PY, "-m", "bench.bench_fleet", str(out), *(plan.fleet_args or ()), *extra]
    r = run_child(argv, FLEET_TIMEOUT_S, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in r.stdout.splitlines()[-20:]:
        log(f"bench: fleet: {line[:300]}")
    if not out.exists():
        raise RuntimeError(f"bench_fleet wrote no results (rc {r.returncode}): {r.stdout[-400:]}")
    res: dict[str, Any] = json.loads(out.read_text())
    res["rc"] = r.returncode
    res["args"] = argv[4:]
    return res


def run_journal(plan: Plan) -> dict[str, Any]:
    """bench/journal.py in this process: 1,000 simulated VMs polled every 30 s for
    plan.journal_hours, both --log modes, bytes a day."""
    from bench import journal

    return journal.simulate(1000, 30.0, plan.journal_hours)


SOAK_IDLE_PROCS = 300  # issue 38: a GPU VM runs many processes; the memory watch scans them all


def run_soak(plan: Plan) -> dict[str, Any]:
    """bench/soak.py under the as-shipped interpreter when there is one (else the dev venv): the
    real agent for plan.soak_ticks ticks, healthy then in an outage, RSS growth; with
    SOAK_IDLE_PROCS idle processes beside it, then with none (``without_idle``): the end RSS must
    not depend on their number."""
    py = deploy_py() or PY

    def one(procs: int, python: str = py) -> dict[str, Any]:
        argv = [python, "-m", "bench.soak", "--ticks", str(plan.soak_ticks), "--procs", str(procs)]
        r = run_child(argv, 3600, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if r.returncode != 0:
            raise RuntimeError(f"soak failed (rc {r.returncode}): {r.stderr[-400:]}")
        res: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
        return res

    out = one(SOAK_IDLE_PROCS)
    out["without_idle"] = one(0)
    out["as_shipped"] = py != PY
    deb = deb_package()
    if deb is not None:  # the same soak under the .deb's own venv, unpacked as dpkg would
        with tempfile.TemporaryDirectory(prefix="gcewd-bench-deb-") as root:
            subprocess.run(["dpkg-deb", "-x", str(deb), root], check=True, timeout=300)
            venv_py = f"{root}{DEB_VENV}/bin/python"
            # what the package's postinst does (packaging/debian): without its .pyc files every
            # start compiles every module, 3-4 MiB more RSS (measured, this machine's
            # PYTHONDONTWRITEBYTECODE=1 aside)
            lib = f"{root}{DEB_VENV}/lib"
            subprocess.run([venv_py, "-m", "compileall", "-q", "-j", "1", lib], check=True,
                           capture_output=True, timeout=600)  # fmt: skip
            out["deb_tree"] = one(SOAK_IDLE_PROCS, venv_py)
            out["deb_tree"]["package"] = deb.name
    return out


DEB_VENV = "/opt/gce-watchdog"  # the .deb's self-contained venv (docs/packaging.md)


def deb_package() -> Path | None:
    """The bookworm .deb ``make deb`` left in build/deb (the agent as the .deb installs it), or
    None: the bench does not build it (about 14 minutes)."""
    debs = sorted((REPO / "build" / "deb").glob("gce-watchdog_*~deb12u*_amd64.deb"))
    return debs[-1] if debs else None


NET_SECTIONS = ("startup", "overhead", "blackhole", "detection", "detection_loaded")
DETECTION_SECTIONS = frozenset({"detection", "detection_loaded"})  # --only-detection


def run(
    plan: Plan,
    with_peers: bool,
    log: Callable[..., None],
    only: frozenset[str] | None = None,
    load: int | None = None,
    fleet: list[str] | None = None,
) -> dict[str, Any]:
    """Every section (``only``: just those of NET_SECTIONS, nothing else); ``load``: busy
    processes of the loaded detection (default LOAD_PER_CORE per core); ``fleet``: more
    arguments of bench_fleet (None: the fleet section is skipped)."""
    from kit.netns import EGRESS_IP, Topology, iptables_unavailable, netns_unavailable

    t_all = time.monotonic()
    res: dict[str, Any] = {
        "schema": 1,
        "mode": plan.mode,
        "plan": asdict(plan),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "sections": {},
    }
    secs: dict[str, str] = res["sections"]
    why = netns_unavailable() or iptables_unavailable()
    peer_why = peers_unavailable() if with_peers else "disabled (--no-peers)"
    res["peers_skipped"] = peer_why
    with tempfile.TemporaryDirectory(prefix="gcewd-bench-") as tmp:
        work = Path(tmp)
        if why:
            for s in NET_SECTIONS:
                if only is None or s in only:
                    secs[s] = f"skipped: {why}"
        else:
            with Topology() as topo:
                records = {n.split(":")[0]: EGRESS_IP for n in DEFAULT_TARGETS}
                topo.start_simgce(work / "sim", records=records)
                b = Bench(plan, work, topo, peer_why is None, log)
                steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
                    ("startup", b.startup),
                    (
                        "overhead",
                        lambda: {
                            "default": b.overhead_default(),
                            "side_by_side": b.overhead_side(),
                        },
                    ),
                    ("blackhole", b.blackhole_ticks),
                    ("detection", b.detection),
                    ("detection_loaded", functools.partial(b.detection_loaded, load)),
                ]
                for name, fn in steps:
                    if only is not None and name not in only:
                        continue
                    t0 = time.monotonic()
                    log(f"bench: {name} ...")
                    try:
                        res[name] = fn()
                        secs[name] = f"ok in {time.monotonic() - t0:.1f}s"
                    except Exception as e:  # one section failing must not lose the others
                        secs[name] = f"failed: {type(e).__name__}: {e}"
                    log(f"bench: {name}: {secs[name]}")
        if only is not None:
            res["duration_s"] = time.monotonic() - t_all
            return res
        t0 = time.monotonic()
        log(f"bench: soak ({plan.soak_ticks} ticks) ...")
        try:
            res["soak"] = run_soak(plan)
            secs["soak"] = f"ok in {time.monotonic() - t0:.1f}s"
        except Exception as e:
            secs["soak"] = f"failed: {type(e).__name__}: {e}"
        log(f"bench: soak: {secs['soak']}")
        t0 = time.monotonic()
        log("bench: decode ...")
        res["decode"] = run_decode(plan, work)
        secs["decode"] = (
            f"skipped: {res['decode']['skipped']}"
            if "skipped" in res["decode"]
            else f"ok in {time.monotonic() - t0:.1f}s"
        )
        t0 = time.monotonic()
        log("bench: journal ...")
        try:
            res["journal"] = run_journal(plan)
            secs["journal"] = f"ok in {time.monotonic() - t0:.1f}s"
        except Exception as e:
            secs["journal"] = f"failed: {type(e).__name__}: {e}"
        log(f"bench: journal: {secs['journal']}")
        if plan.fleet_args is None or fleet is None:
            why_not = "--no-fleet" if fleet is None else f"{plan.mode} mode"
            secs["fleet"] = f"skipped: {why_not} (make bench runs it)"
        else:
            t0 = time.monotonic()
            log("bench: fleet ...")
            try:
                res["fleet"] = run_fleet(plan, work, fleet, log)
                rc = res["fleet"]["rc"]
                secs["fleet"] = (
                    f"failed: bench_fleet exited {rc} (a decision not exactly once; its "
                    "results are kept)"
                    if rc
                    else f"ok in {time.monotonic() - t0:.1f}s"
                )
            except Exception as e:
                secs["fleet"] = f"failed: {type(e).__name__}: {e}"
            log(f"bench: fleet: {secs['fleet']}")
    res["targets"] = report.targets(res)
    res["duration_s"] = time.monotonic() - t_all
    return res


def rerun_decode(plan: Plan, results: Path, log: Callable[..., None]) -> dict[str, Any]:
    """The results file with its decode section measured again (after a decoder change): the
    other sections, their date and their mode stay as they were; the decode section carries
    its own date and mode."""
    res: dict[str, Any] = json.loads(results.read_text())
    with tempfile.TemporaryDirectory(prefix="gcewd-bench-") as tmp:
        t0 = time.monotonic()
        log("bench: decode (alone) ...")
        dec = run_decode(plan, Path(tmp))
    dec["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    dec["mode"] = f"{plan.mode}, re-run alone (--only-decode) at {machine().get('commit', '?')}"
    res["decode"] = dec
    res.setdefault("sections", {})["decode"] = (
        f"skipped: {dec['skipped']}"
        if "skipped" in dec
        else f"ok in {time.monotonic() - t0:.1f}s (re-run alone {dec['date']})"
    )
    res["targets"] = report.targets(res)
    return res


def rerun_detection(
    plan: Plan, results: Path, with_peers: bool, load: int | None, log: Callable[..., None]
) -> dict[str, Any]:
    """The results file with its two detection sections (quiet and loaded, side by side with
    the peers) measured again (``make bench-peers``); the other sections stay as they were."""
    try:
        res: dict[str, Any] = json.loads(results.read_text())
    except FileNotFoundError:
        res = {"schema": 1, "mode": plan.mode, "sections": {}}
    new = run(plan, with_peers, log, only=DETECTION_SECTIONS, load=load)
    when = f"re-run alone {new['date']} at {new['machine'].get('commit', '?')}"
    for name in DETECTION_SECTIONS:
        if name in new:
            res[name] = dict(new[name], date=new["date"], mode=f"{plan.mode}, {when}")
        msg = new["sections"].get(name, "not run")
        res.setdefault("sections", {})[name] = f"{msg} ({when})" if msg.startswith("ok") else msg
    res["peers_skipped"] = new["peers_skipped"]
    res.setdefault("machine", new["machine"])
    res["targets"] = report.targets(res)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="fewer repeats (about 2 minutes)")
    g.add_argument("--tiny", action="store_true", help="smoke mode (seconds): proves it runs")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON path")
    ap.add_argument("--doc", default=str(DEFAULT_DOC), help="markdown file whose tables to update")
    ap.add_argument("--no-doc", action="store_true", help="do not touch the markdown file")
    ap.add_argument("--no-peers", action="store_true", help="agent only (no monit/watchdog)")
    ap.add_argument(
        "--only-decode",
        action="store_true",
        help="re-run the decode section alone, into the results file's other sections",
    )
    ap.add_argument(
        "--only-detection",
        action="store_true",
        help="re-run the detection sections alone (quiet and loaded, beside the peers), into "
        "the results file's other sections (make bench-peers)",
    )
    ap.add_argument(
        "--fleet-args",
        default="",
        metavar="ARGS",
        help="more arguments of bench/bench_fleet.py, e.g. '--sizes 1000' (split like a shell's "
        "words, never run by one)",
    )
    ap.add_argument("--no-fleet", action="store_true", help="skip the fleet section")
    ap.add_argument(
        "--load",
        type=int,
        default=None,
        metavar="N",
        help=f"busy processes of the loaded detection (default {LOAD_PER_CORE} per core)",
    )
    a = ap.parse_args(argv)
    plan = PLANS["tiny" if a.tiny else "quick" if a.quick else "full"]
    exit_on_sigterm()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if a.only_decode:
        res = rerun_decode(plan, Path(a.out), log)
    elif a.only_detection:
        res = rerun_detection(plan, Path(a.out), not a.no_peers, a.load, log)
    else:
        fleet = None if a.no_fleet else shlex.split(a.fleet_args)
        res = run(plan, not a.no_peers, log, load=a.load, fleet=fleet)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    log(f"bench: results -> {out} ({res.get('duration_s', 0):.0f}s)")
    if not a.no_doc:
        doc = Path(a.doc)
        # --only-detection: the detection tables alone; every other table stays as the run that
        # made it left it (the results file may predate some of them)
        only = DETECTION_SECTIONS if a.only_detection else None
        n = report.update_doc(doc, res, only)
        log(f"bench: {n} table(s) regenerated in {doc}")
    print(report.summary(res))
    failed = [s for s, v in res["sections"].items() if v.startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
