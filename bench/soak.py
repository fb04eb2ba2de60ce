"""Memory soak: 20,000 ticks of the real agent, healthy then in an outage, RSS sampled as it goes.

Run by ``make bench`` (``bench.run``) under the interpreter being measured (the as-shipped venv
when there is one), or by hand: ``python -m bench.soak --ticks 20000``. Prints one JSON object.

The agent is the real one (``build_agent``: real probes against the simulated GCE, the metadata
watcher, the memory monitor, the metrics exporter, the serial writer, the state files), except for
its clock: ``wait`` moves a virtual offset instead of sleeping, so 20,000 ticks at the minimum
interval (0.1 s, 33 minutes of agent time) take a minute or two of real time. The first half is
healthy; then the simulated GCE refuses both paths (connections refused at once: no probe waits
out its timeout) and the ladder climbs for the second half (threshold 10,000, the maximum: no
decision, a tick line and a state-file write every tick). The simulated GCE runs as its own
process. Files go to /dev/shm when it exists (fsync on a disk would measure the disk, not the
agent).

Growth is RSS at the end minus RSS after a warm-up of 1,000 ticks (imports, first connections,
caches filled): the issue's bound is 1 MiB.

``--procs N`` starts N idle processes (``sleep``) beside the agent first, as a GPU VM runs many: the
memory watch scans /proc for the largest process every period, and its RSS must not grow with their
number (issue 38: the target is 32 MiB at the end with 300). The result says whether a GPU library
(``pynvml``) was imported: on a VM with no GPU driver it must not be (``[gpu] enabled = auto``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import exit_on_sigterm

WARMUP_TICKS = 1000
MIB = 1024 * 1024


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class FastClock:
    """Real monotonic/wall time plus a virtual offset that ``wait`` advances instead of sleeping."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def wall(self) -> float:
        return time.time() + self.offset

    def sleep(self, seconds: float) -> None:
        self.offset += max(0.0, seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """lib/clock.Clock's order: the event, then the seconds."""
        self.offset += max(0.0, seconds)
        return event.is_set()


def start_sim(work: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any], str]:
    """The simulated GCE in its own process (its threads and buffers must not count in the
    agent's RSS); returns the process, its ports and its control socket."""
    ready, control = work / "sim.ready", str(work / "sim.sock")
    argv = [
        sys.executable, "-m", "gce_watchdog.testing.simgce",
        "--metadata", "127.0.0.1:0", "--tcp", "127.0.0.1:0",
        "--control", control, "--ready-file", str(ready),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the simulated GCE did not start")
        time.sleep(0.02)
    return proc, json.loads(ready.read_text()), control


def start_idle(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` idle processes on the machine (each ends within an hour even if the bench dies)."""
    return [
        subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        for _ in range(n)
    ]


def soak(ticks: int, work: Path, procs: int = 0) -> dict[str, Any]:
    idle = start_idle(procs)
    try:
        return _soak(ticks, work) | {
            "idle_procs": procs,
            "procs_on_machine": sum(1 for e in os.scandir("/proc") if e.name.isdigit()),
        }
    finally:
        for p in idle:
            p.kill()
        for p in idle:
            p.wait(10)


def _soak(ticks: int, work: Path) -> dict[str, Any]:
    from gce_watchdog.daemon.app import build_agent
    from gce_watchdog.testing.simgce import send_command
    from gce_watchdog.vm import config as cfgmod
    from gce_watchdog.vm.runtime import make_emitter

    half = ticks // 2
    samples: list[tuple[int, int]] = []
    sim, ports, control = start_sim(work)
    try:
        (work / "ttyS0").touch()
        (work / "prom").mkdir()
        cfg = cfgmod.from_dict(
            {
                "agent": {
                    "interval": "100ms",
                    "probe_timeout": "50ms",
                    "threshold": 10_000,
                    "heartbeat_every": 10,
                    "state_dir": str(work / "state"),
                    "run_dir": str(work / "run"),
                    "action": "dry-run",
                },
                "metadata": {
                    "url": f"http://127.0.0.1:{ports['metadata']}/computeMetadata/v1/instance/id"
                },
                "egress": {"targets": [f"127.0.0.1:{ports['tcp']}"], "dns_timeout": "20ms"},
                "serial": {"device": str(work / "ttyS0")},
                "metrics": {"directory": str(work / "prom")},
                "watch": {"refresh": "1s", "request_timeout": "0.5s"},
                # The memory monitor's window fills within the warm-up (it runs on real time).
                "memory": {"period": "0.2s", "warmup": 0, "window": 30, "max_window": 30},
            },
            "soak",
        )
        emitter, port = make_emitter(cfg)
        agent, prober = build_agent(cfg, emitter, _NoNotify())
        agent.d.clock = FastClock()
        t0 = time.monotonic()

        def hook(report: Any) -> None:
            n = report.n
            if n in (WARMUP_TICKS, ticks) or n % 1000 == 0:
                samples.append((n, rss_bytes()))
            if n == half:  # both paths refused at once: failing ticks, no timeouts waited out
                send_command(control, op="outage", down=True, mode="refuse")

        agent.d.tick_hooks.append(hook)
        try:
            agent.run(threading.Event(), max_ticks=ticks)
        finally:
            prober.close()
            port.close()
        real_s = time.monotonic() - t0
        lines = (work / "ttyS0").read_bytes().count(b"\n")
    finally:
        sim.terminate()
        sim.wait(10)
    by_tick = dict(samples)
    base = by_tick.get(WARMUP_TICKS) or samples[0][1]
    end = samples[-1][1]
    healthy_end = by_tick.get(half, end)
    return {
        "ticks": ticks,
        "interval_s": cfg.agent.interval,
        "healthy_ticks": half,
        "outage_ticks": ticks - half,
        "real_s": round(real_s, 1),
        "ms_per_tick_real": round(real_s * 1000 / ticks, 3),
        "serial_lines": lines,
        "tick_errors": agent.tick_errors,
        "rung_at_end": agent.state.rung,
        "rss_mib": {str(n): round(b / MIB, 3) for n, b in samples},
        "rss_after_warmup_mib": round(base / MIB, 3),
        "rss_end_healthy_mib": round(healthy_end / MIB, 3),
        "rss_end_mib": round(end / MIB, 3),
        "growth_mib": round((end - base) / MIB, 3),
        "growth_healthy_mib": round((healthy_end - base) / MIB, 3),
        "growth_outage_mib": round((end - healthy_end) / MIB, 3),
        "python": sys.executable,
        "gpu_library_imported": "pynvml" in sys.modules,
    }


class _NoNotify:
    watchdog_interval = 0.0

    def notify(self, *assignments: str) -> bool:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticks", type=int, default=20_000)
    ap.add_argument("--procs", type=int, default=0, help="idle processes beside the agent")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(
        prefix="gcewd-soak-", dir=str(shm) if shm.is_dir() else None
    ) as d:
        print(json.dumps(soak(args.ticks, Path(d), args.procs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
