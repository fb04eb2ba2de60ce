"""One Pub/Sub worker process behind ``ServiceLikeSubscriber`` (kit/pubsub_service.py).

``python -m kit.pubsub_worker --subscription S --ledger URL|PATH [--max 20] [--withhold 0.05]
[--seed N] [--settle 30] [--owner NAME] [--names FILE] [--on-failover CMD]
[--announce-lease 300]`` with ``PUBSUB_EMULATOR_HOST`` set and ``agent`` and ``tests`` on
``PYTHONPATH``. ``--names``: who each instance id is, the Compute API's answer
(``kit.identities.TableIdentities`` JSON). It pulls until SIGTERM (or SIGKILL, which is the
point: a worker killed anywhere), prints each announcement as one JSON line on stdout, and on
SIGTERM a last line ``{"stats": ...}`` with its counts and its peak RSS (``ru_maxrss``, KiB).
With ``--on-failover`` it delivers each announcement through the poller's own ``FailoverHook``
and ``Delivery`` (poller/hooks.py), as ``poll --pubsub --on-failover`` does.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--subscription", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--max", type=int, default=20)
    ap.add_argument("--withhold", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=30.0)
    ap.add_argument("--owner", default="")
    ap.add_argument("--names", default=None)
    ap.add_argument("--on-failover", default=None)
    ap.add_argument("--announce-lease", type=float, default=300.0)
    args = ap.parse_args(argv)

    from gce_watchdog.poller.hooks import Delivery, FailoverHook
    from gce_watchdog.poller.ledgers import open_ledger
    from gce_watchdog.poller.pubsub import PubSubWorker
    from google.cloud import pubsub_v1

    from kit.identities import TableIdentities
    from kit.pubsub_service import ServiceLikeSubscriber

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sub = ServiceLikeSubscriber(pubsub_v1.SubscriberClient(), args.max, args.withhold, args.seed)

    def emit(out: Any) -> None:
        print(json.dumps(out.to_json(), sort_keys=True), flush=True)

    def log(msg: str) -> None:
        print(f"worker {args.owner}: {msg}", file=sys.stderr, flush=True)

    with open_ledger(args.ledger, owner=args.owner, announce_lease_s=args.announce_lease) as led:
        ids = TableIdentities.load(Path(args.names)) if args.names else TableIdentities({})
        deliver = None
        if args.on_failover:
            hook = FailoverHook(shlex.split(args.on_failover), stop=stop, log=log)
            deliver = Delivery(led, [hook], log)
        w = PubSubWorker(
            sub, args.subscription, led, emit, settle_s=args.settle, identity=ids, deliver=deliver
        )
        print(json.dumps({"ready": args.owner}), flush=True)
        while not stop.is_set():
            w.step(timeout=1.0)
    stats = asdict(w.stats)
    stats["latencies"] = list(w.stats.latencies)
    stats["counts"] = {k: v for k, v in asdict(sub.counts).items() if k != "sizes"}
    stats["max_pull"] = max(sub.counts.sizes, default=0)
    stats["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"stats": stats}), flush=True)
    sub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
