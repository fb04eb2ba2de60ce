"""``gce-watchdog poll --pubsub projects/P/subscriptions/S [--label K=V --project P ...]``.

The worker loop: pull and decide until SIGTERM; with ``--label``, a Compute API sweep every
``--sweep-interval`` in a second thread, polling (through the ordinary poller) the instances the
stream cannot speak for: not RUNNING, silent for longer than the drain timeout, or never heard
from (their console is not exported: polling is their fallback).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from gce_watchdog.lib.compute import ComputeClient, InstanceStatus
from gce_watchdog.poller.fleet import FleetPoller, ProjectBudget, Target, label_filter, parse_label
from gce_watchdog.poller.ledger import BaseLedger
from gce_watchdog.poller.poller import PollOutcome
from gce_watchdog.poller.pubsub import PubSubWorker
from gce_watchdog.poller.reader import CursorStore

PULL_TIMEOUT_S = 1.0  # a pull waits at most this long, so gaps settle and SIGTERM is seen


def _log(msg: str) -> None:
    print(f"gce-watchdog poll: {msg}", file=sys.stderr, flush=True)


def run_pubsub(
    args: argparse.Namespace,
    client: ComputeClient,
    store: CursorStore,
    ledger: BaseLedger,
    policy: Any,
    interval: float,
    budget: ProjectBudget,
    stop: threading.Event,
    print_outcome: Callable[[PollOutcome, bool], None],
) -> int:
    from google.cloud import pubsub_v1

    subscriber = pubsub_v1.SubscriberClient()
    out_lock = threading.Lock()

    def emit(out: PollOutcome) -> None:
        with out_lock:
            print_outcome(out, args.json)

    worker = PubSubWorker(subscriber, args.pubsub, ledger, emit, policy, args.settle_s)
    sweeper = None
    if args.label is not None and args.project:
        sweeper = threading.Thread(
            target=_sweep, args=(args, client, store, ledger, policy, worker, emit, stop),
            name="sweep", daemon=True,
        )  # fmt: skip
        sweeper.start()
    _log(f"pulling {args.pubsub}")
    try:
        while not stop.is_set():
            worker.step(PULL_TIMEOUT_S)
    finally:
        stop.set()
        if sweeper is not None:
            sweeper.join(timeout=60)
        subscriber.close()
    s = worker.stats
    _log(
        f"stopped: {s.messages} messages, {s.lines} lines of ours, {s.decisions} decisions, "
        f"{s.announced} announced, {s.acked} acked"
    )
    return 0


def _sweep(
    args: argparse.Namespace,
    client: ComputeClient,
    store: CursorStore,
    ledger: BaseLedger,
    policy: Any,
    worker: PubSubWorker,
    emit: Callable[[PollOutcome], None],
    stop: threading.Event,
) -> None:
    key, value = parse_label(args.label)
    fleet = FleetPoller(
        client, store, ledger, list(args.project), label_filter(key, value), policy, args.reap,
        workers=args.workers,
    )  # fmt: skip
    drain = policy.drain_timeout_s

    def select(t: Target, st: InstanceStatus | None) -> bool:
        if st is None or st.status != "RUNNING":
            return True  # stopped or gone: the stream cannot say
        if st.id in worker.gapped:
            return True  # its stream lost a line: only the serial port's whole record decides
        heard = worker.last_heard.get(st.id)
        return heard is None or time.time() - heard > drain

    def announce(out: PollOutcome) -> None:
        emit(out)
        fleet.announced(out)

    try:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                rep = fleet.round(t0 + args.sweep_s, announce, time.monotonic, select)
                _log(f"sweep: {rep.discovered} VMs listed, {rep.outcomes} polled")
            except Exception as e:  # a failed sweep is retried at the next one, loudly
                _log(f"sweep failed: {type(e).__name__}: {e}")
            stop.wait(max(0.0, args.sweep_s - (time.monotonic() - t0)))
    finally:
        fleet.close()
