"""``gce-watchdog poll``'s composition root: the real objects, built from one :class:`PollSettings`.

:func:`run_poll` builds, in order, the credentials and the Compute API client, the ledger, the
cursor store, the per-project budget and the SIGTERM/SIGINT handlers, then runs one loop per mode
(:class:`~gce_watchdog.poller.settings.Mode`):

- instances (``--project --zone INSTANCE...``): each round polls every instance in turn, then
  announces the decisions whose claimer died before announcing them.
- fleet (``--label KEY[=VALUE] --project P...``): each round discovers (aggregatedList), polls in
  the pool until the round's deadline (the interval; none with ``--once``), prints each outcome as
  it completes and marks its announcement, then reports on stderr what changed (new and gone VMs,
  slow polls, unreachable zones) and, when the budget cannot cover the fleet at ``--interval``,
  the stretched interval.
- pubsub (``--pubsub projects/P/subscriptions/S``): pull and decide until SIGTERM; with
  ``--label``, a Compute API sweep every ``--sweep-interval`` in a second thread polls (through
  the ordinary poller) the instances the stream cannot speak for: not RUNNING, silent for longer
  than the drain timeout, or never heard from (their console is not exported).

Only ``poller/cli.py`` imports this module, inside its handler, so ``gce-watchdog run`` never
loads sqlite3 or the poller. Exit codes are ``lib/cli.py``'s, listed in ``poll --help``.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sqlite3
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gce_watchdog.lib.cli import EX_IOERR, EX_NOPERM, EX_OK, EX_UNAVAILABLE
from gce_watchdog.lib.compute import (
    DEFAULT_API_BASE,
    AuthError,
    ComputeClient,
    ComputeRetry,
    InstanceStatus,
)
from gce_watchdog.poller.fleet import (
    SLOW_POLL_NOTE,
    BudgetedSession,
    FleetPoller,
    ProjectBudget,
    Target,
    plan_interval,
)
from gce_watchdog.poller.ledger import BaseLedger
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.poller import (
    Poller,
    PollOutcome,
    TargetNotFound,
    announced_outcome,
    lapsed_announcements,
)
from gce_watchdog.poller.pubsub import PubSubWorker
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.settings import Mode, PollSettings

PULL_TIMEOUT_S = 1.0  # a pull waits at most this long, so gaps settle and SIGTERM is seen


def _state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")


def _log(msg: str) -> None:
    print(f"gce-watchdog poll: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Parts:
    """What every mode's loop runs on, built by :func:`run_poll`."""

    client: ComputeClient
    store: CursorStore
    ledger: BaseLedger
    budget: ProjectBudget
    stop: threading.Event  # set by SIGTERM/SIGINT
    ledger_errors: tuple[type[BaseException], ...]  # what a failed ledger or cursor write raises


def run_poll(s: PollSettings) -> int:
    """Build the parts, run the mode's loop, close everything; the command's exit status."""
    state = _state_home() / "gce-watchdog"
    try:
        retry = ComputeRetry(attempts=s.api.attempts)
        client = ComputeClient.create(
            _credentials(s.api.token_file), s.api.base or DEFAULT_API_BASE, retry=retry
        )
    except (OSError, ValueError) as e:
        _log(f"--access-token-file: {e}")
        return EX_NOPERM
    except AuthError as e:
        _log(str(e))
        return EX_NOPERM
    try:
        ledger = open_ledger(
            s.ledger or state / "ledger.sqlite", announce_lease_s=s.announce_lease_s
        )
    except ImportError as e:
        _log(f"a postgresql ledger needs psycopg: {e}")
        return EX_IOERR
    except Exception as e:  # the driver's own errors (sqlite3.Error, psycopg.Error)
        _log(f"cannot open the ledger: {_redact(e)}")
        return EX_IOERR
    try:
        store = CursorStore(s.cursor_dir or state / "cursors")
    except OSError as e:
        ledger.close()
        _log(f"cannot open the cursor directory: {e}")
        return EX_IOERR
    errors: tuple[type[BaseException], ...] = (OSError, sqlite3.Error, *ledger.errors)
    budget = budgeted(client, s.budget, s.workers)
    stop = threading.Event()
    parts = Parts(client, store, ledger, budget, stop, errors)
    loop = {Mode.INSTANCES: _run_instances, Mode.FLEET: _run_fleet, Mode.PUBSUB: _run_pubsub}
    with _signals_set(stop):
        try:
            return loop[s.mode](s, parts)
        except AuthError as e:
            _log(str(e))
            return EX_NOPERM
        except errors as e:
            _log(f"ledger/cursor write failed: {e}")
            return EX_IOERR
        finally:
            ledger.close()
            client.close()


@contextmanager
def _signals_set(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` (from the main thread only; the old handlers come back)."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _credentials(token_file: str | None) -> Any:
    if not token_file:
        return None
    from google.oauth2.credentials import Credentials

    token = Path(token_file).read_text().strip()
    if not token:
        raise ValueError(f"{token_file} is empty")
    return Credentials(token)  # type: ignore[no-untyped-call]


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


# -- instances ----------------------------------------------------------------------------------


def _run_instances(s: PollSettings, p: Parts) -> int:
    assert s.zone is not None  # settings: this mode has one --project, --zone and names
    poller = Poller(p.client, p.store, s.projects[0], s.zone, p.ledger, s.policy, s.reap)
    rc = EX_OK
    rounds = 0
    while not p.stop.is_set():
        rounds += 1
        rc = EX_OK
        for name in s.instances:
            try:  # (AuthError and a failed ledger or cursor write end the run: run_poll)
                out = poller.poll(name)
                if out.error:
                    rc = EX_UNAVAILABLE
                _print_outcome(out, s.json)
                poller.announced(out)  # after the line is out: pending until then
            except TargetNotFound as e:
                # a wrong project or zone: a configuration error, never a verdict
                _log(str(e))
                return EX_UNAVAILABLE
        try:  # decisions whose claimer died before announcing them (e.g. a reaped VM)
            for out in lapsed_announcements(p.ledger, time.time()):
                _print_outcome(out, s.json)
                announced_outcome(p.ledger, out, time.time())
        except p.ledger_errors as e:
            _log(f"ledger write failed: {e}")
            return EX_IOERR
        _cursor_notes(p.store)
        if s.once or (s.max_polls and rounds >= s.max_polls):
            break
        p.stop.wait(s.wait_s)
    return rc


# -- fleet --------------------------------------------------------------------------------------


def _fleet(s: PollSettings, p: Parts) -> FleetPoller:
    assert s.label_filter is not None  # settings: fleet and the sweep need --label
    return FleetPoller(
        p.client, p.store, p.ledger, list(s.projects), s.label_filter, s.policy, s.reap,
        workers=s.workers,
    )  # fmt: skip


def _run_fleet(s: PollSettings, p: Parts) -> int:
    fleet = _fleet(s, p)
    rc = EX_OK
    rounds = 0
    effective = s.wait_s
    note: str | None = None
    try:
        while not p.stop.is_set():
            rounds += 1
            rc = EX_OK
            t0 = time.monotonic()
            deadline = math.inf if s.once else t0 + effective

            def emit(out: PollOutcome) -> None:
                nonlocal rc
                if out.error:
                    rc = EX_UNAVAILABLE
                _print_outcome(out, s.json)
                fleet.announced(out)  # after the line is out: pending until then

            rep = fleet.round(deadline, emit, time.monotonic)
            took = time.monotonic() - t0
            _log(
                f"round {rounds}: {rep.discovered} VMs in {len(s.projects)} project(s) "
                f"({len(rep.new)} new, {len(rep.gone)} gone), {rep.outcomes} polled in "
                f"{took:.1f}s, {rep.pages} list page(s)"
            )
            for t in rep.slow:
                rc = EX_UNAVAILABLE
                _log(f"{t}: {SLOW_POLL_NOTE}")
            for project, zone in sorted(rep.unreachable):
                _log(f"zone {zone} of {project} did not answer the list; its VMs are kept")
            if rep.failed:
                rc = EX_UNAVAILABLE
                _log_failed_lists(rep.failed)
            _cursor_notes(p.store)
            per_project = Counter(t.project for t in fleet.known)
            plan = plan_interval(dict(per_project), s.interval_s, s.budget, max(1, rep.pages))
            if plan.note != note:
                note = plan.note
                _log(note or f"the fleet fits the budget again: polling every {s.interval_s:g}s")
            effective = plan.interval_s
            if s.once or (s.max_polls and rounds >= s.max_polls):
                break
            p.stop.wait(max(0.0, effective - (time.monotonic() - t0)))
    finally:
        fleet.close()
    return rc


def _cursor_notes(store: CursorStore) -> None:
    """Say which cursors were not used (their instances are read again from the start)."""
    for key in store.corrupt:
        _log(f"cursor {key} was unreadable; restarted")
    store.corrupt.clear()
    for key, why in store.untrusted:
        _log(f"cursor {key} {why}: not trusted; read again from the start")
    store.untrusted.clear()


def _log_failed_lists(failed: dict[str, str]) -> None:
    for project, why in sorted(failed.items()):
        _log(
            f"the instance list of {project} failed: {why}; its VMs are kept and it is listed "
            "again next round"
        )


# -- pubsub -------------------------------------------------------------------------------------


def _run_pubsub(s: PollSettings, p: Parts) -> int:
    from google.cloud import pubsub_v1

    assert s.pubsub is not None  # settings: this mode has its subscription
    subscriber = pubsub_v1.SubscriberClient()
    out_lock = threading.Lock()

    def emit(out: PollOutcome) -> None:
        with out_lock:
            _print_outcome(out, s.json)

    sub = s.pubsub
    worker = PubSubWorker(subscriber, sub.subscription, p.ledger, emit, s.policy, sub.settle_s)
    sweeper = None
    if s.label_filter is not None:  # (settings: --label comes with its --project)
        sweeper = threading.Thread(
            target=_sweep, args=(s, p, worker, emit), name="sweep", daemon=True
        )
        sweeper.start()
    _log(f"pulling {sub.subscription}")
    try:
        while not p.stop.is_set():
            worker.step(PULL_TIMEOUT_S)
    finally:
        p.stop.set()
        if sweeper is not None:
            sweeper.join(timeout=60)
        subscriber.close()
    st = worker.stats
    _log(
        f"stopped: {st.messages} messages, {st.lines} lines of ours, {st.decisions} decisions, "
        f"{st.announced} announced, {st.acked} acked"
    )
    return EX_OK


def _sweep(
    s: PollSettings, p: Parts, worker: PubSubWorker, emit: Callable[[PollOutcome], None]
) -> None:
    assert s.pubsub is not None
    sweep_s = s.pubsub.sweep_s
    fleet = _fleet(s, p)
    drain = s.policy.drain_timeout_s

    def select(t: Target, st: InstanceStatus | None) -> bool:
        if st is None or st.status != "RUNNING":
            return True  # stopped or gone: the stream cannot say
        heard, gapped = worker.heard(st.id)  # what every worker stored, not only this one
        if gapped:
            return True  # its stream lost a line: only the serial port's whole record decides
        return heard is None or time.time() - heard > drain

    def announce(out: PollOutcome) -> None:
        emit(out)
        fleet.announced(out)

    try:
        while not p.stop.is_set():
            t0 = time.monotonic()
            try:
                rep = fleet.round(t0 + sweep_s, announce, time.monotonic, select)
                _log(f"sweep: {rep.discovered} VMs listed, {rep.outcomes} polled")
                _log_failed_lists(rep.failed)
                _cursor_notes(p.store)
            except Exception as e:  # a failed sweep is retried at the next one, loudly
                _log(f"sweep failed: {type(e).__name__}: {e}")
            p.stop.wait(max(0.0, sweep_s - (time.monotonic() - t0)))
    finally:
        fleet.close()


# -- output -------------------------------------------------------------------------------------


def _redact(e: BaseException) -> str:
    """An error's text without a password a connection URL may carry (user:secret@host)."""
    return re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1***@", str(e))


def _print_outcome(out: Any, as_json: bool, now: Callable[[], float] = time.time) -> None:
    """One line per instance and round, led by the UTC time it was decided (ISO 8601)."""
    ts = datetime.fromtimestamp(now(), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if as_json:
        import json

        doc = out.to_json()
        doc.setdefault("ts", ts)
        print(json.dumps(doc, sort_keys=True), flush=True)
        return
    if out.error:
        print(f"{ts} {out.instance}: ERROR {out.error}", flush=True)
        return
    v = out.verdict
    line = f"{ts} {out.instance} id={out.instance_id or '-'} status={out.status}"
    line += f" boot={v.boot or '-'}"
    line += f" verdict={v.kind.value} action={out.action}"
    if out.decision is not None:
        line += f" token={out.decision.token}"
    if out.reaped:
        line += f" reaped={out.reaped}"
    if out.reap_error:
        line += f" reap_error={out.reap_error!r}"
    if out.read is not None:
        line += f" new={out.read.new}B lost={out.read.lost}B"
    forged, conflict = getattr(out, "forged", 0), getattr(out, "key_conflict", False)
    if forged or conflict:  # lines that do not authenticate: someone forges
        line += f" ALARM forged={forged}" + (" key_conflict" if conflict else "")
    line += f" | {v.reason}"
    print(line, flush=True)
