#!/usr/bin/env python3
"""Fleet benchmark (issue 19): the central side at 1,000 and 5,000 VMs, and the Pub/Sub path.

Usage::

    python -m bench.bench_fleet RESULTS.json [--sizes 1000,5000] [--budget 20000]
                                [--workers 32] [--pubsub-sizes 1000,5000]
                                [--pubsub-workers 3] [--no-polling] [--tiny]

Polling mode, per fleet size N, against the fake Compute API (testing.simcompute) served by a
**separate process** (so the server does not share the poller's interpreter lock):

1. N labelled VMs over 4 zones, each with a healthy agent's first lines (~1 KB);
2. round 1: ``gce-watchdog poll --label ... --once`` reads every console from the start (cold);
3. 10 % of the VMs write their ``shutdown`` line; the server reports the wall time it did so;
4. round 2 (steady state): the same command again. Reported: the round's time (the poller's own
   "polled in" figure: discovery and every poll), API requests in the round and the rate they
   make at a 30 s interval, and the **decision latency** of each wedged VM: from the moment its
   shutdown line was readable through the API to the ledger claim (``decided_at``). Every
   decision's count is checked (exactly the wedged VMs, once).

Pub/Sub mode, per ``--pubsub-sizes`` fleet size, on the real emulator: ``--pubsub-workers``
(3) worker processes (tests/kit/pubsub_worker.py: the product's PubSubWorker behind the
service-like subscriber, pulls of 1..``--pubsub-pull-max``) share one subscription and one
PostgreSQL ledger (tests/kit/pgserver.py; SQLite where no server is installed). A publisher
process emits the fleet's exported LogEntry messages (kit/pubsub_service.py ``fleet_stream``:
3 in 5 VMs wedged, 1 in 5 finished, 1 in 5 healthy; journald copies, duplicates, noise; the VMs
side by side, each message delayed in transit by up to ``--pubsub-jitter`` seconds (2: the
reordering of an export and a subscription without an ordering key; ``--pubsub-spread N``
gives the earlier model, each message displaced by up to N of its VM's lines, a delay that
grows with the fleet: 12.5 s at 5,000 VMs) at ``--pubsub-rate`` (1,200 messages/s: twice the
stream of 5,000 VMs, issue 38's target; ``make bench`` runs this file as its fleet section).
Reported: every wedged VM decided once and no other, messages
per second over all workers, decision latency p50/p99 (publish time of the shutdown line to the
claim), each worker's peak RSS and the machine's 1-minute load average over the run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "agent"))
sys.path.insert(0, str(REPO / "tests"))

from gce_watchdog.poller.ledgers import open_ledger  # noqa: E402
from gce_watchdog.testing.simcompute import FakeComputeAPI  # noqa: E402
from gce_watchdog.testing.synth import SYNTH_KEY, Writer  # noqa: E402

from bench import exit_on_sigterm  # noqa: E402

ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "europe-west4-a")
PROJECT = "bench-project"
WEDGED_EVERY = 10  # one VM in ten shuts down between the rounds
ROUND_TIMEOUT_S = 600
PUBSUB_TIMEOUT_S = 900
LOAD_EVERY_S = 10.0  # the Pub/Sub run samples the machine's load average this often


def _serve(n: int, conn: Any) -> None:
    """The fake API in its own process; commands over a pipe: wedge, calls, stop."""
    with FakeComputeAPI(token="bench") as api:  # noqa: S106 (the fake server's test token)
        writers = {}
        for i in range(n):
            name = f"vm-{i:05d}"
            api.add_instance(name, project=PROJECT, zone=ZONES[i % len(ZONES)],
                             labels={"gce-watchdog": "on"})  # fmt: skip
            w = Writer(boot=f"{i:08x}")
            w.ts_ms = int(time.time() * 1000)
            first = w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"})
            api.append_serial(name, first + b"[   1.0] systemd[1]: Started job.service\r\n" * 8)
            writers[name] = w
        conn.send(("ready", api.base_url))
        while True:
            cmd, arg = conn.recv()
            if cmd == "wedge":
                at = {}
                for name in arg:
                    w = writers[name]
                    w.ts_ms = int(time.time() * 1000)
                    api.append_serial(
                        name, w.line("shutdown", {"reason": "ladder", "rung": "10/10"})
                    )
                    at[name] = time.time()  # readable through the API from now on
                conn.send(at)
            elif cmd == "calls":
                counts: dict[str, int] = {}
                for c in api.calls:
                    counts[c.endpoint] = counts.get(c.endpoint, 0) + 1
                conn.send(counts)
            else:
                conn.send("bye")
                return


def _poll_once(base: str, work: Path, args: argparse.Namespace) -> tuple[float, str]:
    tok = work / "token"
    tok.write_text("bench\n")
    argv = [sys.executable, "-m", "gce_watchdog", "poll", "--label", "gce-watchdog=on",
            "--project", PROJECT, "--api-base", base, "--access-token-file", str(tok),
            "--ledger", str(work / "ledger.sqlite"), "--cursor-dir", str(work / "cursors"),
            "--json", "--once", "--interval", "30s", "--workers", str(args.workers),
            # a throughput bench where one VM in ten fails over: the brake would hold some
            "--budget", str(args.budget), "--brake", "off"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    t0 = time.monotonic()
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=ROUND_TIMEOUT_S,
                       check=False)  # fmt: skip
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.monotonic() - t0
    args.last_cpu_s = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    if r.returncode != 0:
        raise RuntimeError(f"poll exited {r.returncode}: {r.stderr[-2000:]}")
    m = re.search(r"polled in ([0-9.]+)s", r.stderr)
    return (float(m.group(1)) if m else wall), r.stdout


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _latency_summary(xs: list[float]) -> dict[str, float | int]:
    """p50, p99 and max of latencies in seconds (to the millisecond), and how many there were."""
    return {
        "p50": round(pct(xs, 50) or 0, 3),
        "p99": round(pct(xs, 99) or 0, 3),
        "max": round(max(xs, default=0), 3),
        "n": len(xs),
    }


def bench_polling(n: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(n, child), daemon=True)
    server.start()
    try:
        tag, base = parent.recv()
        assert tag == "ready"
        with tempfile.TemporaryDirectory(prefix="gcewd-bench-fleet-") as d:
            work = Path(d)
            cold_s, _ = _poll_once(base, work, args)
            parent.send(("calls", None))
            calls_before = parent.recv()
            wedged = [f"vm-{i:05d}" for i in range(0, n, WEDGED_EVERY)]
            parent.send(("wedge", wedged))
            readable_at: dict[str, float] = parent.recv()
            steady_s, out = _poll_once(base, work, args)
            steady_cpu_s = args.last_cpu_s
            parent.send(("calls", None))
            calls_after = parent.recv()
            with open_ledger(work / "ledger.sqlite") as led:
                decisions = led.decisions.all()
        lat = [d.decided_at - readable_at[d.instance.rsplit("/", 1)[1]] for d in decisions]
        announced = sum(1 for x in out.splitlines() if '"action": "failover"' in x)
        round_calls = {k: calls_after.get(k, 0) - calls_before.get(k, 0) for k in calls_after}
        total = sum(round_calls.values())
        return {
            "vms": n,
            "wedged": len(wedged),
            "decisions": len(decisions),
            "announced": announced,
            "exactly_once": len(decisions) == len(wedged) == announced,
            "round_cold_s": round(cold_s, 2),
            "round_steady_s": round(steady_s, 2),
            # the poller process's CPU (user + system) in round 2, its start included
            "cpu_ms_per_vm_steady": round(steady_cpu_s / n * 1000, 2),
            "api_calls_per_round": round_calls,
            "api_calls_per_minute_at_30s": total * 2,
            "decision_latency_s": {
                "p50": round(pct(lat, 50) or 0, 2),
                "p99": round(pct(lat, 99) or 0, 2),
                "max": round(max(lat, default=0), 2),
            },
            "budget_per_min": args.budget,
            "workers": args.workers,
            "within_30s": steady_s <= 30.0,
        }
    finally:
        parent.send(("stop", None))
        server.join(timeout=30)
        if server.is_alive():
            server.kill()


def _publish(host: str, topic: str, msgs: list[bytes], rate: float) -> None:
    os.environ["PUBSUB_EMULATOR_HOST"] = host
    from google.cloud import pubsub_v1

    pub = pubsub_v1.PublisherClient()
    t0 = time.monotonic()
    futs = []
    for i, m in enumerate(msgs):
        due = t0 + i / rate
        if (wait := due - time.monotonic()) > 0:
            time.sleep(wait)
        futs.append(pub.publish(topic, m))
    for f in futs:
        f.result(timeout=60)


def _ledger_server() -> Any:
    """A PostgreSQL server (tests/kit/pgserver.py) as a context manager, or None."""
    from kit import pgserver

    return None if pgserver.unavailable() else pgserver.postgres_server()


def vm_hwm_kib(pid: int) -> int | None:
    """A live process's own peak RSS: ``VmHWM`` of /proc/PID/status (KiB), or None. Not
    ``ru_maxrss``: that carries the parent's peak over fork and exec (a worker started by this
    bench reported the bench's own)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(m.group(1)) if m else None


def cpu_s(pid: int) -> float | None:
    """A live process's own CPU time so far (user + system, /proc/PID/stat), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_pubsub(
    vms: int,
    rate: float,
    workers: int,
    pull_max: int,
    jitter_s: float = 2.0,
    spread: float = 0.0,
    profile: Path | None = None,
) -> dict[str, Any]:
    """``workers`` worker processes (tests/kit/pubsub_worker.py: the product's PubSubWorker
    behind the service-like subscriber, pulls of at most ``pull_max``) on one subscription of
    the real emulator, sharing a PostgreSQL ledger (SQLite where no server is installed)."""
    import contextlib

    from kit import pubsub_emulator
    from kit.identities import TableIdentities
    from kit.pubsub_service import fleet_stream

    why = pubsub_emulator.unavailable()
    if why:
        return {"skipped": why}
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    transit = int(jitter_s * rate)  # a delay in transit of up to jitter_s, in messages
    fleet = fleet_stream(random.Random(6), vms, PROJECT, spread=spread, transit=transit)  # noqa: S311
    with contextlib.ExitStack() as stack:
        host = stack.enter_context(pubsub_emulator.pubsub_emulator())
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gcewd-bench-ps-")))
        server = _ledger_server()
        if server is not None:
            import psycopg

            admin = stack.enter_context(server)
            with psycopg.connect(admin, autocommit=True) as c:
                c.execute("CREATE DATABASE bench")
            ledger, backend = admin.rsplit("/", 1)[0] + "/bench", "postgresql"
        else:
            ledger, backend = str(d / "ledger.sqlite"), "sqlite"
        os.environ["PUBSUB_EMULATOR_HOST"] = host
        with open_ledger(ledger) as led:  # the poll path pins each VM (byte 0 of its port)
            for iid in fleet.names:
                led.pins.place_pin(iid, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        from google.cloud import pubsub_v1

        pub, sub = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        topic = pub.topic_path(PROJECT, "serial")
        subn = sub.subscription_path(PROJECT, "watchdog")
        pub.create_topic(request={"name": topic})
        sub.create_subscription(request={"name": subn, "topic": topic, "ack_deadline_seconds": 30})
        sub.close()
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'agent'}:{REPO / 'tests'}"}
        logs = [d / f"w{i}.out" for i in range(workers)]
        names = d / "names.json"  # who each id is, as the Compute API would say
        TableIdentities.of(fleet.names, PROJECT).save(names)
        procs = []
        for i, log in enumerate(logs):
            argv = [sys.executable, "-m", "kit.pubsub_worker", "--subscription", subn,
                    "--ledger", ledger, "--max", str(pull_max), "--seed", str(i),
                    "--settle", "60", "--owner", f"w{i}", "--names", str(names)]  # fmt: skip
            if profile is not None:
                argv += ["--profile", str(profile / f"worker{i}.prof")]
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env))
        ctx = mp.get_context("spawn")
        publisher = ctx.Process(target=_publish, args=(host, topic, fleet.messages, rate))
        try:
            with open_ledger(ledger) as led:
                while not all(x.read_text().startswith('{"ready"') for x in logs):
                    if any(p.poll() is not None for p in procs):
                        raise RuntimeError(f"a worker exited: {[x.read_text() for x in logs]}")
                    time.sleep(0.2)
                publisher.start()
                t0 = time.monotonic()
                closed = fleet.wedged | fleet.finished
                deadline = t0 + PUBSUB_TIMEOUT_S
                load = [os.getloadavg()[0]]  # the machine's 1-min load, every LOAD_EVERY_S
                while time.monotonic() < deadline:
                    done = {i for i, _, st in led.assembly.boots() if st != "open"}
                    if done >= closed and not led.decisions.pending_announcements():
                        break
                    if time.monotonic() - t0 >= len(load) * LOAD_EVERY_S:
                        load.append(os.getloadavg()[0])
                    time.sleep(0.5)
                load.append(os.getloadavg()[0])
                elapsed = time.monotonic() - t0
                publisher.join(timeout=120)
                decisions = led.decisions.all()
                states = {i: st for i, _, st in led.assembly.boots()}
            hwm = [vm_hwm_kib(p.pid) for p in procs]  # before they exit
            cpu = [cpu_s(p.pid) for p in procs]
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(timeout=120)
        stats = [
            json.loads(x)["stats"]
            for log in logs
            for x in log.read_text().splitlines()
            if x.startswith('{"stats"')
        ]
    lat = [x for st in stats for x in st["latencies"]]
    ready = [x for st in stats for x in st["ready_latencies"]]
    decided = sorted(x.instance_id for x in decisions)
    handled = sum(st["messages"] for st in stats)
    return {
        "vms": vms,
        "workers": workers,
        "ledger": backend,
        "pull_max": pull_max,
        "published": len(fleet.messages),
        "messages_handled": handled,
        "publish_rate_per_s": rate,
        "wedged": len(fleet.wedged),
        "decisions": len(decisions),
        "exactly_once": decided == sorted(fleet.wedged),
        "finished_ended": all(states.get(i) == "ended" for i in fleet.finished),
        "healthy_undecided": not (set(decided) & fleet.healthy),
        "elapsed_s": round(elapsed, 2),
        "messages_per_s": round(handled / elapsed, 1) if elapsed else None,
        "stream": f"interleaved, spread {spread:g} lines, transit up to {jitter_s:g} s",
        "decision_latency_s": _latency_summary(lat),
        # from the publish of the last line the decision needed (a line before the shutdown,
        # displaced after it in the stream, included): the pipeline's own share
        "ready_latency_s": _latency_summary(ready),
        # each worker's own peak RSS (VmHWM), read while it ran
        "worker_rss_mib": [None if k is None else round(k / 1024, 1) for k in hwm],
        "per_worker_messages": [st["messages"] for st in stats],
        # signature checks the workers' caches of verified lines answered (copies, duplicates)
        "verified_again": sum(st.get("verified_again", 0) for st in stats),
        # each worker's own CPU (user + system) over the run, and messages per CPU second:
        # what one core handles, whatever else the machine runs
        "worker_cpu_s": cpu,
        "messages_per_cpu_s": round(handled / sum(c or 0 for c in cpu), 1) if any(cpu) else None,
        "loadavg_1m": {"min": min(load), "max": max(load), "samples": load},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sizes", default="1000,5000")
    ap.add_argument("--budget", type=float, default=20000)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--pubsub-sizes", default="1000,5000")
    ap.add_argument(
        "--pubsub-rate",
        type=float,
        default=1200.0,
        help="messages published per second (1,200: twice the stream of 5,000 VMs, issue 38)",
    )
    ap.add_argument("--pubsub-workers", type=int, default=3)
    ap.add_argument("--pubsub-pull-max", type=int, default=100)
    ap.add_argument(
        "--pubsub-jitter",
        type=float,
        default=2.0,
        help="each message delayed in transit by up to this many seconds",
    )
    ap.add_argument(
        "--pubsub-spread",
        type=float,
        default=0.0,
        help="each message displaced by up to this many of its VM's lines (the "
        "earlier model: its delay grows with the fleet)",
    )
    ap.add_argument(
        "--pubsub-profile",
        type=Path,
        default=None,
        help="a folder: each Pub/Sub worker writes its cProfile stats there (workerN.prof)",
    )
    ap.add_argument("--no-polling", action="store_true", help="only the Pub/Sub part")
    ap.add_argument("--tiny", action="store_true", help="smoke mode: 50 VMs, 10 on Pub/Sub")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    sizes = [50] if args.tiny else [int(x) for x in args.sizes.split(",")]
    res: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "polling": [],
    }
    for n in [] if args.no_polling else sizes:
        r = bench_polling(n, args)
        print(json.dumps(r), flush=True)
        res["polling"].append(r)
    res["pubsub"] = []
    ps_sizes = [10] if args.tiny else [int(x) for x in args.pubsub_sizes.split(",") if x]
    for n in ps_sizes:
        ps = bench_pubsub(n, args.pubsub_rate, args.pubsub_workers, args.pubsub_pull_max,
                          args.pubsub_jitter, args.pubsub_spread, args.pubsub_profile)  # fmt: skip
        print(json.dumps(ps), flush=True)
        res["pubsub"].append(ps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    ok = all(r["exactly_once"] for r in res["polling"]) and all(
        ps.get("exactly_once", True) and ps.get("finished_ended", True) for ps in res["pubsub"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
