"""`make demo`: the real agent against a simulated GCE on loopback, in under a minute, no root.

1. healthy ticks, then both paths go down: the ladder climbs 1/10 .. 10/10 to a (dry-run) shutdown;
2. a second VM whose 9-tick outage clears in time: it recovers, no shutdown;
3. both captured serial logs decoded again, whole, with the poller's verdict on each.

Each line is shown once, as the agent writes it. The serial logs and the agents' own logs are kept
(the last lines say where, and how to make a report of them); ``--clean`` removes them instead,
and says so.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.poller.verdict import InstanceState, Policy
from gce_watchdog.testing.simgce import SimGCE, SimInstance
from gce_watchdog.wire.protocol import MARKER, VERSION, Event, StreamDecoder, decode_all
from gce_watchdog.wire.vocab import human_fields

TICK = 1.0
BOLD, DIM, RED, GREEN, YELLOW, RESET = (
    "\033[1m",
    "\033[2m",
    "\033[31m",
    "\033[32m",
    "\033[33m",
    "\033[0m",
)
if not sys.stdout.isatty() or os.environ.get("NO_COLOR"):
    BOLD = DIM = RED = GREEN = YELLOW = RESET = ""


def say(msg: str) -> None:
    print(f"\n{BOLD}== {msg}{RESET}", flush=True)


def colour(e: Event) -> str:
    if e.event in ("shutdown", "dry_run_shutdown", "action"):
        return RED
    if e.event == "tick":
        return YELLOW
    if e.event in ("recovered", "heartbeat", "start"):
        return GREEN
    return DIM


def show(e: Event, t0: float) -> None:
    fields = human_fields(e.fields, skip=("v", "cfg", "pid"))
    text = f"  {DIM}| {e.text}{RESET}" if e.text else ""
    dt = max(e.ts_ms / 1000 - t0, 0.0)
    print(f"  {dt:6.1f}s  #{e.seq:<3} {colour(e)}{e.event:<10}{RESET} {fields}{text}", flush=True)


def write_config(d: Path, sim: SimGCE) -> Path:
    assert sim.tcp is not None
    p = d / "config.toml"
    (d / "ttyS0").touch()  # the "serial device": a missing one is unusable (fallback file)
    p.write_text(
        f"""# demo config: 1 s ticks instead of 30 s, dry-run instead of a real poweroff
[agent]
interval = "{TICK}s"
probe_timeout = "0.5s"
threshold = 10
heartbeat_every = 1
state_dir = "{d}/state"
run_dir = "{d}/run"
boot_id_path = "{d}/boot_id"
action = "dry-run"

[metadata]
url = "{sim.metadata.url}"

[egress]
targets = ["127.0.0.1:{sim.tcp.port}"]
dns_timeout = "0.2s"

[actions]
linger = "3s"        # production: 75 s, so a 30 s poller reads the verdict twice
repeat_every = "1s"

[serial]
device = "{d}/ttyS0"
fallback_file = "{d}/serial-fallback.log"
"""
    )
    (d / "boot_id").write_text(os.urandom(16).hex() + "\n")
    return p


class Watch:
    """Follows the agent's serial file and prints each decoded line as it appears."""

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0 = path, t0
        self.dec = StreamDecoder()
        self.offset = 0
        self.events: list[Event] = []

    def poll(self) -> list[Event]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        new = self.dec.feed(data)
        for e in new:
            show(e, self.t0)
        self.events += new
        return new

    def until(self, pred: Callable[[Event], bool], timeout: float) -> Event | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for e in self.poll():
                if pred(e):
                    return e
            time.sleep(0.05)
        return None


def run_agent(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    # The job's phase, as the start-up script records it; the agent's heartbeats carry it.
    subprocess.run(
        [sys.executable, "-m", "gce_watchdog", "phase", "workload", "--config", str(cfg)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "gce_watchdog", "run", "--config", str(cfg)], stderr=err
        )


def stop_agent(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


# One simulated instance per VM, named the same in the headings and in the agent's own lines
# (its `instance` line, the chain's delete step).
VM1 = SimInstance(id="4520031799277582145", name="sim-vm-1")
VM2 = SimInstance(id="4520031799277582146", name="sim-vm-2")


def scenario_wedge(d: Path) -> Path:
    say(f"VM 1 ({VM1.name}): healthy, then BOTH paths go dark (metadata hangs, 443 refused)")
    with SimGCE(info=VM1) as sim:
        cfg = write_config(d, sim)
        p = run_agent(cfg, d / "agent.log")
        w = Watch(d / "ttyS0", time.time())
        try:
            w.until(lambda e: e.event == "heartbeat" and int(e.get("ticks") or 0) >= 3, 15)
            print(f"  {BOLD}-- outage starts: metadata server hangs, 443 refused --{RESET}")
            sim.outage(True)
            # the chain: shutdown line, linger (3 s here), then each step, in dry-run
            got = w.until(lambda e: e.event == "action" and e.get("step") == "kernel", 40)
        finally:
            stop_agent(p)
            w.poll()
    if got is None:
        raise SystemExit(f"demo failed: no shutdown seen; agent log: {d / 'agent.log'}")
    return d / "ttyS0"


def scenario_recovery(d: Path) -> Path:
    say(f"VM 2 ({VM2.name}): a 9-tick outage that clears before 10/10")
    with SimGCE(info=VM2) as sim:
        cfg = write_config(d, sim)
        p = run_agent(cfg, d / "agent.log")
        w = Watch(d / "ttyS0", time.time())
        try:
            w.until(lambda e: e.event == "heartbeat" and int(e.get("ticks") or 0) >= 2, 15)
            print(f"  {BOLD}-- outage starts, for 9 ticks --{RESET}")
            # the simulated GCE ends it itself at the 10th probe: exact, however loaded the host
            sim.outage_for(9)
            w.until(lambda e: e.event == "tick" and e.get("rung") == "9/10", 20 + 10 * TICK)
            print(f"  {BOLD}-- network comes back before the 10th tick --{RESET}")
            w.until(lambda e: e.event == "recovered", 10 + 2 * TICK)
            w.until(lambda e: e.event == "heartbeat", 5)
        finally:
            stop_agent(p)
            w.poll()
    return d / "ttyS0"


def poller_verdict(path: Path, status: str) -> str:
    """What the central poller would decide on this log (agent/poller, pure)."""

    now = time.time()  # judged as of now, the log received now: the same rule as the poller's
    tl = parse_bytes(path.read_bytes(), rx=now)
    v = tl.judge(InstanceState(status), now, Policy())
    action = "FAIL OVER (exactly once, via the ledger)" if v.failover else "no failover"
    return f"{v.kind.value}: {action}; {v.reason}"


def summary(path: Path, title: str, status: str) -> None:
    """The whole log decoded again (each line was shown once, live): what a poller concludes."""
    events, stats = decode_all(path.read_bytes())
    say(f"{title}: the serial log decoded again, whole")
    t0 = events[0].ts_ms / 1000 if events else 0.0
    shut = [e for e in events if e.event in ("shutdown", "dry_run_shutdown") and not e.get("rep")]
    rec = [e for e in events if e.event == "recovered"]
    seqs = [e.seq for e in events]
    gaps = sum(b - a - 1 for a, b in itertools.pairwise(seqs) if b > a + 1)
    dry = " (dry run: nothing powered off)" if shut and shut[0].event == "dry_run_shutdown" else ""
    verdict = (
        f"{RED}SHUTDOWN decided{dry} at {shut[0].get('rung')} "
        f"({shut[0].ts_ms / 1000 - t0:.1f}s after start){RESET}"
        if shut
        else f"{GREEN}no shutdown; recovered from {rec[0].get('from')}/10{RESET}"
        if rec
        else "no shutdown"
    )
    print(f"  => {verdict}; {stats.events} lines, {stats.rejected} rejected, {gaps} sequence gaps")
    what = f"instance {status}"
    print(f"  => poller, {what}: {BOLD}{poller_verdict(path, status)}{RESET}")
    if dry:  # what the same decision means armed: the agent writes `shutdown`, the VM goes off
        print(
            f"  => a dry-run decision is never a failover (protocol v{VERSION}: its own event); "
            f"armed, the agent writes `shutdown` and the poller says: {BOLD}self_shutdown: FAIL "
            f"OVER{RESET}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gce_watchdog.testing.demo",
        description="The real agent against a simulated GCE on loopback (what `make demo` runs).",
    )
    ap.add_argument("--dir", help="where to keep the logs (default: a new directory in $TMPDIR)")
    ap.add_argument("--clean", action="store_true", help="remove the logs at the end")
    args = ap.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gce-watchdog-demo-"))
    (root / "vm1").mkdir(parents=True, exist_ok=True)
    (root / "vm2").mkdir(parents=True, exist_ok=True)
    print(
        f"{BOLD}gce-watchdog demo{RESET}: the real agent (`gce-watchdog run`) probing a "
        "simulated GCE on 127.0.0.1\n(fake metadata server + a 443 stand-in), 1 s ticks, "
        "threshold 10, action dry-run."
    )
    s1 = scenario_wedge(root / "vm1")
    s2 = scenario_recovery(root / "vm2")
    # A real chain would have left VM 1 TERMINATED: the poller is asked about that case.
    summary(s1, f"VM 1 ({VM1.name})", "RUNNING")  # a dry run powers nothing off
    summary(s2, f"VM 2 ({VM2.name})", "RUNNING")
    print(
        "\nWhat you saw: both probes must fail in the same tick to climb; one passing probe "
        f"resets the ladder.\nEvery line is protocol v{VERSION} (docs/serial-protocol.md): the "
        f"poller finds it among kernel output\nwith `grep -F {MARKER}`, checks its CRC and its "
        "Ed25519 signature (a key only root on the VM\ncan read, pinned by the poller: no other "
        "process can write a line that counts), and tells\na wedge (fail over) from a recovery."
    )
    if args.clean:
        shutil.rmtree(root)
        print(f"\nThe logs were removed ({root}).")
    else:
        print(f"\nLogs kept in {root}:")
        for vm in ("vm1", "vm2"):
            print(f"  {root / vm / 'ttyS0'}  (serial), {root / vm / 'agent.log'}  (journal lines)")
        print(f"Report: gce-watchdog report {s1} --html vm1.html   Remove: rm -r {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
