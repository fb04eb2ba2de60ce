#!/usr/bin/env python3
"""Fleet benchmark (issue 19): the central side at 1,000 and 5,000 VMs, and the Pub/Sub path.

Usage::

    python -m bench.bench_fleet RESULTS.json [--sizes 1000,5000] [--budget 20000]
                                [--workers 32] [--pubsub-vms 200] [--tiny]

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

Pub/Sub mode, on the real emulator: a publisher process emits LogEntry messages for
``--pubsub-vms`` VMs (10 lines each, every VM ending in a shutdown line, a third duplicated,
shuffled) at a steady rate while one worker pulls; reported: messages per second per worker and
decision latency p50/p99 from publish time to claim.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import re
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
from gce_watchdog.testing.synth import Writer  # noqa: E402

ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "europe-west4-a")
PROJECT = "bench-project"
WEDGED_EVERY = 10  # one VM in ten shuts down between the rounds
ROUND_TIMEOUT_S = 600


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
            "--budget", str(args.budget)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=ROUND_TIMEOUT_S,
                       check=False)  # fmt: skip
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"poll exited {r.returncode}: {r.stderr[-2000:]}")
    m = re.search(r"polled in ([0-9.]+)s", r.stderr)
    return (float(m.group(1)) if m else wall), r.stdout


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


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
            parent.send(("calls", None))
            calls_after = parent.recv()
            with open_ledger(work / "ledger.sqlite") as led:
                decisions = led.all()
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


def bench_pubsub(vms: int, rate: float) -> dict[str, Any]:
    from kit import pubsub_emulator
    from kit.logentries import fleet_messages

    why = pubsub_emulator.unavailable()
    if why:
        return {"skipped": why}
    from gce_watchdog.poller.pubsub import PubSubWorker

    with pubsub_emulator.pubsub_emulator() as host:
        os.environ["PUBSUB_EMULATOR_HOST"] = host
        from google.cloud import pubsub_v1

        pub, sub = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        topic = pub.topic_path(PROJECT, "serial")
        subn = sub.subscription_path(PROJECT, "watchdog")
        pub.create_topic(request={"name": topic})
        sub.create_subscription(request={"name": subn, "topic": topic, "ack_deadline_seconds": 30})
        msgs, wedged, _ = fleet_messages(random.Random(6), vms)  # noqa: S311 (test data)
        ctx = mp.get_context("spawn")
        publisher = ctx.Process(target=_publish, args=(host, topic, msgs, rate))
        with (
            tempfile.TemporaryDirectory(prefix="gcewd-bench-ps-") as d,
            open_ledger(Path(d) / "ledger.sqlite") as led,
        ):
            outs: list[Any] = []
            w = PubSubWorker(sub, subn, led, outs.append, settle_s=1.0)
            publisher.start()
            t0 = time.monotonic()
            busy = 0.0
            deadline = t0 + 300
            while (len(led.all()) < len(wedged) or w.stats.messages < len(msgs)) and (
                time.monotonic() < deadline
            ):
                s0 = time.monotonic()
                got = w.step(timeout=0.5)
                if got:
                    busy += time.monotonic() - s0
            elapsed = time.monotonic() - t0
            publisher.join(timeout=60)
            decisions = len(led.all())
        lat = w.stats.latencies
        sub.close()
        return {
            "vms": vms,
            "messages": w.stats.messages,
            "published": len(msgs),
            "publish_rate_per_s": rate,
            "decisions": decisions,
            "exactly_once": decisions == len(wedged),
            "elapsed_s": round(elapsed, 2),
            "messages_per_s_per_worker_busy": round(w.stats.messages / busy, 1) if busy else None,
            "decision_latency_s": {
                "p50": round(pct(lat, 50) or 0, 3),
                "p99": round(pct(lat, 99) or 0, 3),
                "max": round(max(lat, default=0), 3),
                "n": len(lat),
            },
            "settle_s": 1.0,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sizes", default="1000,5000")
    ap.add_argument("--budget", type=float, default=20000)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--pubsub-vms", type=int, default=200)
    ap.add_argument("--pubsub-rate", type=float, default=400.0)
    ap.add_argument("--tiny", action="store_true", help="smoke mode: 50 VMs, 10 on Pub/Sub")
    args = ap.parse_args(argv)
    sizes = [50] if args.tiny else [int(x) for x in args.sizes.split(",")]
    res: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "polling": [],
    }
    for n in sizes:
        r = bench_polling(n, args)
        print(json.dumps(r), flush=True)
        res["polling"].append(r)
    ps = bench_pubsub(10 if args.tiny else args.pubsub_vms, args.pubsub_rate)
    print(json.dumps(ps), flush=True)
    res["pubsub"] = ps
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    ok = all(r["exactly_once"] for r in res["polling"]) and ps.get("exactly_once", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
