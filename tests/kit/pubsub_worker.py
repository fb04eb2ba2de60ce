"""One Pub/Sub worker process behind ``ServiceLikeSubscriber`` (kit/pubsub_service.py).

``python -m kit.pubsub_worker --subscription S --ledger URL|PATH [--max 20] [--withhold 0.05]
[--seed N] [--settle 30] [--owner NAME] [--names FILE] [--on-failover CMD] [--announce-lease
300] [--publish TOPIC [--publish-faults DIR]]`` with ``PUBSUB_EMULATOR_HOST`` set and ``agent``
and ``tests`` on ``PYTHONPATH``. ``--names``: who each instance id is, the Compute API's answer
(``kit.identities.TableIdentities`` JSON). It pulls until SIGTERM (or SIGKILL, which is the
point: a worker killed anywhere), prints each announcement as one JSON line on stdout, and on
SIGTERM a last line ``{"stats": ...}`` with its counts and ``ru_maxrss`` (KiB: not its own peak
when started by a bigger process, which Linux carries over fork and exec; the bench reads the
worker's ``VmHWM`` instead). ``--profile FILE``: cProfile stats of the pull loop, written there.
With ``--on-failover`` it delivers each announcement through the poller's own ``FailoverHook``
and ``Delivery`` (poller/hooks.py), as ``poll --pubsub --on-failover`` does; with ``--publish
TOPIC`` through its ``TopicPublisher`` (then the hook, as ``poll`` orders them).
``--publish-faults DIR`` puts :class:`FaultyPublisher` between that and the real client.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import shlex
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any


class FaultyPublisher:
    """A ``PublisherClient`` for the tests of ``--publish`` with faults: every call is recorded
    in ``DIR/calls`` (token, ``$WORKER``) under a lock shared by all workers; the first call for
    each token fails (its future raises ``ServiceUnavailable``, as the client's does for a
    503: https://cloud.google.com/pubsub/docs/reference/error-codes) and nothing is published,
    any later one goes to the real client. With ``$KILL_FIRST`` set, the very first call of all
    kills its worker (SIGKILL) before anything is published: a worker that dies between its
    claim and its publish."""

    def __init__(self, real: Any, state: Path) -> None:
        self.real, self.state = real, state

    def publish(self, topic: str, data: bytes, **attrs: str) -> Any:
        from concurrent.futures import Future

        from google.api_core.exceptions import ServiceUnavailable

        token, me = attrs["token"], os.environ.get("WORKER", "?")
        with open(self.state / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            log = self.state / "calls"
            calls = log.read_text().split() if log.exists() else []
            with open(log, "a") as f:
                f.write(f"{token} {me}\n")
                f.flush()
                os.fsync(f.fileno())
            if not calls and os.environ.get("KILL_FIRST"):
                os.kill(os.getpid(), signal.SIGKILL)
        if token not in calls[0::2]:
            failed: Future[str] = Future()
            first = "the test's first publish of this token"
            failed.set_exception(ServiceUnavailable(first))  # type: ignore[no-untyped-call]
            return failed
        return self.real.publish(topic, data, **attrs)


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
    ap.add_argument("--publish", default=None)
    ap.add_argument("--publish-faults", default=None)
    ap.add_argument("--profile", default=None, help="write cProfile stats of the loop here")
    args = ap.parse_args(argv)

    from gce_watchdog.poller.hooks import Delivery, FailoverHook, TopicPublisher
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
        steps: list[Any] = []
        if args.publish:  # poll --publish's own step, on its own client
            client: Any = pubsub_v1.PublisherClient()
            if args.publish_faults:
                client = FaultyPublisher(client, Path(args.publish_faults))
            steps.append(TopicPublisher(client, args.publish, stop=stop, log=log))
        if args.on_failover:
            steps.append(FailoverHook(shlex.split(args.on_failover), stop=stop, log=log))
        deliver = Delivery(led.decisions, steps, log) if steps else None
        w = PubSubWorker(
            sub, args.subscription, led, emit, settle_s=args.settle, identity=ids, deliver=deliver
        )
        print(json.dumps({"ready": args.owner}), flush=True)
        prof = None
        if args.profile:  # the bench's --pubsub-profile: where a worker's time goes
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        while not stop.is_set():
            w.step(timeout=1.0)
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.profile)
    stats = asdict(w.stats)
    stats["latencies"] = list(w.stats.latencies)
    stats["ready_latencies"] = list(w.stats.ready_latencies)
    stats["counts"] = {k: v for k, v in asdict(sub.counts).items() if k != "sizes"}
    stats["max_pull"] = max(sub.counts.sizes, default=0)
    stats["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"stats": stats}), flush=True)
    sub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
