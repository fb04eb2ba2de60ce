"""``gce-watchdog poll --label KEY[=VALUE] --project P [--project P2 ...]``: the fleet loop.

Each round: discover (aggregatedList), poll in the pool until the round's deadline (the interval;
no deadline with ``--once``), print each outcome as it completes and mark its announcement, then
report on stderr what changed (new and gone VMs, slow polls, unreachable zones) and, when the
budget cannot cover the fleet at ``--interval``, the stretched interval.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gce_watchdog.lib.compute import ComputeClient
from gce_watchdog.poller.fleet import (
    SLOW_POLL_NOTE,
    BudgetedSession,
    FleetPoller,
    ProjectBudget,
    label_filter,
    parse_label,
    plan_interval,
)
from gce_watchdog.poller.ledger import BaseLedger
from gce_watchdog.poller.poller import PollOutcome
from gce_watchdog.poller.reader import CursorStore

EX_UNAVAILABLE = 69


def budgeted(client: ComputeClient, per_minute: float, workers: int) -> ProjectBudget:
    """Route every request of ``client`` through a per-project budget; size its connection pool
    for ``workers`` concurrent polls (requests' default keeps 10 connections per host)."""
    budget = ProjectBudget(per_minute)
    session: Any = client.session
    mount = getattr(session, "mount", None)
    if mount is not None:
        from requests.adapters import HTTPAdapter

        for prefix in ("https://", "http://"):
            mount(prefix, HTTPAdapter(pool_connections=4, pool_maxsize=max(10, workers)))
    client.session = BudgetedSession(client.session, budget)
    return budget


def _log(msg: str) -> None:
    print(f"gce-watchdog poll: {msg}", file=sys.stderr, flush=True)


def run_fleet(
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
    key, value = parse_label(args.label)
    fleet = FleetPoller(
        client, store, ledger, list(args.project), label_filter(key, value), policy, args.reap,
        workers=args.workers,
    )  # fmt: skip
    rc = 0
    rounds = 0
    effective = interval
    note: str | None = None
    try:
        while not stop.is_set():
            rounds += 1
            rc = 0
            t0 = time.monotonic()
            deadline = math.inf if args.once else t0 + effective

            def emit(out: PollOutcome) -> None:
                nonlocal rc
                if out.error:
                    rc = EX_UNAVAILABLE
                print_outcome(out, args.json)
                fleet.announced(out)  # after the line is out: pending until then

            rep = fleet.round(deadline, emit, time.monotonic)
            took = time.monotonic() - t0
            _log(
                f"round {rounds}: {rep.discovered} VMs in {len(args.project)} project(s) "
                f"({len(rep.new)} new, {len(rep.gone)} gone), {rep.outcomes} polled in "
                f"{took:.1f}s, {rep.pages} list page(s)"
            )
            for t in rep.slow:
                rc = EX_UNAVAILABLE
                _log(f"{t}: {SLOW_POLL_NOTE}")
            for project, zone in sorted(rep.unreachable):
                _log(f"zone {zone} of {project} did not answer the list; its VMs are kept")
            for key_ in store.corrupt:
                _log(f"cursor {key_} was unreadable; restarted")
            store.corrupt.clear()
            per_project = Counter(t.project for t in fleet.known)
            plan = plan_interval(dict(per_project), args.interval_s, args.budget, max(1, rep.pages))
            if plan.note != note:
                note = plan.note
                _log(note or f"the fleet fits the budget again: polling every {args.interval_s:g}s")
            effective = plan.interval_s
            if args.once or (args.max_polls and rounds >= args.max_polls):
                break
            stop.wait(max(0.0, effective - (time.monotonic() - t0)))
    finally:
        fleet.close()
    return rc
