"""Polling a whole fleet: discovery by label, a bounded pool, a per-project request budget.

- **Discovery.** ``instances.aggregatedList`` per project with a label filter (``labels.KEY =
  "VALUE"``), every page, every zone. The list already carries each instance's status, id and
  provisioning model, so a poll needs no ``instances.get``: one serial-port read per VM per round.
- **Gone VMs.** An instance listed in an earlier round and absent now (deleted: reaped by us or by
  someone else) is polled once more by name; the GET answers 404, the verdict is taken on what its
  cursor holds, and the ledger decides whether that is a new decision or the one already made.
  A VM absent from the list that the GET still finds running left the label selection (someone
  removed its label: any local process with ``compute.instances.setLabels`` can): it is
  **untracked**, an alarm (``vm_untracked``: the ledger's ``decisions alarms``, the round's
  report, ``/metrics``), and it is polled by name (one GET and one serial read per round) until
  it ends (STOPPED, SUSPENDED, TERMINATED: polled once more with that status, then let go), is
  deleted (finalized as gone) or is selected again; each of these clears the alarm. One found
  already ended is let go as before.
  Zones the list reports unreachable keep their instances: absence there proves nothing. So do
  projects whose list failed (gave up after its retries): the round polls the others and their
  known VMs, and the next round lists them again.
- **The pool.** Polls run in a thread pool of ``workers``. A round waits for its polls until its
  deadline (the interval); a poll still running then is reported as slow and left to finish
  in the background, and that instance is not polled again until it has (one slow or huge VM never
  holds the others, and never has two polls at once).
- **The budget.** Every request (list, get, serial, delete, and every retry) takes a token from
  its project's bucket (``per_minute`` per 60 s). A 429, or a 403 ``rateLimitExceeded``, pauses
  that project, and only that project, for its ``Retry-After`` (or ``RATE_LIMIT_PAUSE_S``).
  ``plan_interval`` stretches the interval when the fleet needs more requests per round than the
  budget allows, and says so.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gce_watchdog.lib.compute import (
    RATE_LIMIT_REASONS,
    AuthError,
    ComputeAPIError,
    ComputeClient,
    HTTPSession,
    InstanceStatus,
    instance_cost_fields,
    instance_labels,
    last_start_of,
)
from gce_watchdog.lib.httpdate import parse_retry_after
from gce_watchdog.poller.cloudlogging import LoggingClient
from gce_watchdog.poller.ledger import VM_UNTRACKED
from gce_watchdog.poller.ledgers import Ledger
from gce_watchdog.poller.poller import (
    Poller,
    PollOutcome,
    announced_outcome,
    lapsed_announcements,
)
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.verdict import Policy

# GCE's default read quota is 1,500 requests per minute per project (instances.get,
# getSerialPortOutput and aggregatedList count against the read/list groups:
# https://cloud.google.com/compute/api-quota). The default budget stays 20 % below it, leaving
# room for gcloud, the console and other tools of the same project.
DEFAULT_BUDGET_PER_MIN = 1200
# Requests per VM per round in steady state: one getSerialPortOutput (the list gives the status).
CALLS_PER_VM = 1
# A rate-limited project without a Retry-After waits this long: GCE refills quotas per minute.
RATE_LIMIT_PAUSE_S = 10.0
# No single Retry-After pauses a project longer than one quota window.
MAX_PAUSE_S = 60.0
DEFAULT_WORKERS = 16
# The token bucket holds at most this many seconds' worth of requests: a burst at a round's start,
# then the steady rate.
BURST_S = 10.0
_PROJECT_IN_URL = re.compile(r"/projects/([^/?]+)")
# A serial read's worst case: connect + read timeout, then the retries (ComputeRetry).
SLOW_POLL_NOTE = "still polling at the round's deadline; its next poll waits for this one"
# An instance in one of these has ended: an untracked VM found so is polled once more, let go.
ENDED_STATUSES = frozenset({"STOPPED", "SUSPENDED", "TERMINATED"})


@dataclass(frozen=True, order=True)
class Target:
    project: str
    zone: str
    name: str

    def __str__(self) -> str:
        return f"{self.project}/{self.zone}/{self.name}"


@dataclass(frozen=True)
class Discovery:
    instances: dict[Target, InstanceStatus]
    unreachable: frozenset[tuple[str, str]]  # (project, zone) the list could not answer for
    pages: int
    # project -> why its list failed (gave up after its retries, or refused): nothing of it is
    # in ``instances``, not even the pages it did get, so absence there proves nothing
    failed: dict[str, str] = field(default_factory=dict)


def _status(body: dict[str, Any]) -> InstanceStatus:
    sched = body.get("scheduling") or {}
    return InstanceStatus(
        name=str(body.get("name", "")),
        id=str(body.get("id", "")),
        status=str(body.get("status", "")),
        spot=sched.get("provisioningModel") == "SPOT" or bool(sched.get("preemptible")),
        termination_action=str(sched.get("instanceTerminationAction", "")),
        labels=instance_labels(body),
        last_start=last_start_of(body),
        **instance_cost_fields(body),
    )


def discover(client: ComputeClient, projects: Iterable[str], flt: str) -> Discovery:
    """Every instance matching ``flt`` in every zone of ``projects`` (all pages). A project whose
    list fails (the client gave up, or the API refused it) is in ``failed``, not raised: the other
    projects are still listed. Only an :class:`AuthError` is raised (no credentials: nothing
    can be listed)."""
    found: dict[Target, InstanceStatus] = {}
    unreachable: set[tuple[str, str]] = set()
    failed: dict[str, str] = {}
    pages = 0
    for project in projects:
        mine: dict[Target, InstanceStatus] = {}
        lost: set[tuple[str, str]] = set()
        token = ""
        try:
            while True:
                body = client.aggregated_instances(project, flt, token)
                pages += 1
                _page(project, body, mine, lost)
                token = str(body.get("nextPageToken") or "")
                if not token:
                    break
        except AuthError:
            raise
        except ComputeAPIError as e:
            failed[project] = str(e)
            continue
        found.update(mine)
        unreachable |= lost
    return Discovery(found, frozenset(unreachable), pages, failed)


def _page(
    project: str,
    body: dict[str, Any],
    found: dict[Target, InstanceStatus],
    unreachable: set[tuple[str, str]],
) -> None:
    items = body.get("items") or {}
    for scope, entry in items.items():
        if not str(scope).startswith("zones/") or not isinstance(entry, dict):
            continue
        zone = str(scope)[len("zones/") :]
        warning = entry.get("warning") or {}
        if warning.get("code") == "UNREACHABLE":
            unreachable.add((project, zone))
        for inst in entry.get("instances") or []:
            st = _status(inst)
            found[Target(project, zone, st.name)] = st
    for scope in body.get("unreachables") or []:
        if str(scope).startswith("zones/"):
            unreachable.add((project, str(scope)[len("zones/") :]))


class ProjectBudget:
    """A token bucket per project (``per_minute`` requests per 60 s), and per-project pauses.

    ``acquire`` reserves a token and sleeps until it is due, outside the lock: concurrent callers
    queue in order. Injectable clock and sleep: tests never wait.
    """

    def __init__(
        self,
        per_minute: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if per_minute <= 0:
            raise ValueError("the request budget must be > 0 per minute")
        self.rate = per_minute / 60.0
        self.burst = max(1.0, self.rate * BURST_S)
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}
        self._stamp: dict[str, float] = {}
        self._paused_until: dict[str, float] = {}
        self.used: dict[str, int] = {}
        self.waited_s: dict[str, float] = {}
        self.rate_limited: dict[str, int] = {}

    def acquire(self, project: str) -> float:
        """Take one request's token for ``project``; returns the seconds waited."""
        with self._lock:
            now = self.clock()
            tokens = self._tokens.get(project, self.burst)
            last = self._stamp.get(project, now)
            tokens = min(self.burst, tokens + (now - last) * self.rate) - 1.0
            self._tokens[project] = tokens
            self._stamp[project] = now
            wait = max(0.0, -tokens / self.rate, self._paused_until.get(project, now) - now)
            self.used[project] = self.used.get(project, 0) + 1
            self.waited_s[project] = self.waited_s.get(project, 0.0) + wait
        if wait > 0:
            self.sleep(wait)
        return wait

    def pause(self, project: str, seconds: float) -> None:
        """No request for ``project`` before ``seconds`` from now (a 429's Retry-After)."""
        with self._lock:
            until = self.clock() + min(MAX_PAUSE_S, max(0.0, seconds))
            self._paused_until[project] = max(self._paused_until.get(project, 0.0), until)
            self.rate_limited[project] = self.rate_limited.get(project, 0) + 1


class BudgetedSession:
    """An HTTP session that spends ``budget`` per request and pauses a project on 429."""

    def __init__(self, inner: HTTPSession, budget: ProjectBudget) -> None:
        self.inner = inner
        self.budget = budget

    def request(self, method: str, url: str, **kwargs: Any) -> Any:
        m = _PROJECT_IN_URL.search(url)
        project = m.group(1) if m else ""
        self.budget.acquire(project)
        r = self.inner.request(method, url, **kwargs)
        limited = r.status_code == 429 or (
            r.status_code == 403 and any(x in r.text for x in RATE_LIMIT_REASONS)
        )
        if limited:
            after = parse_retry_after(r.headers.get("Retry-After"), time.time())
            self.budget.pause(project, RATE_LIMIT_PAUSE_S if after is None else after)
        return r

    def close(self) -> None:
        self.inner.close()


@dataclass(frozen=True)
class IntervalPlan:
    interval_s: float
    calls_per_round: int  # the busiest project's
    note: str | None  # set when the interval was stretched


def plan_interval(
    per_project_vms: dict[str, int], interval_s: float, per_minute: float, pages: int = 1
) -> IntervalPlan:
    """The interval the budget allows: stretched (with a note) when the busiest project needs
    more requests per round than ``per_minute`` gives it in ``interval_s``."""
    if not per_project_vms:
        return IntervalPlan(interval_s, 0, None)
    project, vms = max(per_project_vms.items(), key=lambda kv: kv[1])
    calls = vms * CALLS_PER_VM + pages
    allowed = per_minute * interval_s / 60.0
    if calls <= allowed:
        return IntervalPlan(interval_s, calls, None)
    need = math.ceil(calls * 60.0 / per_minute)
    note = (
        f"project {project}: {vms} VMs need about {calls} API requests per round, the budget is "
        f"{per_minute:g}/min ({allowed:.0f} per {interval_s:g}s round): polling every {need}s "
        "instead (raise --budget with the project's quota, or use --pubsub for large fleets)"
    )
    return IntervalPlan(float(need), calls, note)


@dataclass
class RoundReport:
    outcomes: int = 0
    slow: list[Target] = field(default_factory=list)
    gone: list[Target] = field(default_factory=list)
    new: list[Target] = field(default_factory=list)
    discovered: int = 0
    unreachable: frozenset[tuple[str, str]] = frozenset()
    pages: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # project -> why its list failed
    # untracked VMs (left the label selection while running), polled by name this round
    untracked: list[Target] = field(default_factory=list)
    # (target, why) the untracked alarm was raised / cleared for, this round
    raised: list[tuple[Target, str]] = field(default_factory=list)
    cleared: list[tuple[Target, str]] = field(default_factory=list)


class FleetPoller:
    """Rounds over a discovered fleet. ``emit`` gets each outcome as it completes, in the caller's
    thread (print it, then mark it announced)."""

    def __init__(
        self,
        client: ComputeClient,
        store: CursorStore,
        ledger: Ledger | None,
        projects: list[str],
        flt: str,
        policy: Policy | None = None,
        reap: bool = False,
        workers: int = DEFAULT_WORKERS,
        clock: Callable[[], float] = time.time,
        peers: Sequence[Path] = (),
        logging: LoggingClient | None = None,
    ) -> None:
        self.peers = tuple(peers)  # evidence for an ended VM (Poller)
        self.logging = logging
        self.client = client
        self.store = store
        self.ledger = ledger
        self.projects = projects
        self.filter = flt
        self.policy = policy or Policy()
        self.reap = reap
        self.clock = clock
        self.known: dict[Target, InstanceStatus] = {}
        self._pollers: dict[tuple[str, str], Poller] = {}
        self._inflight: dict[Target, cf.Future[PollOutcome | None]] = {}
        self._seeded = False
        self._unlisted: set[Target] = set()  # cursors of VMs not listed at start-up
        # VMs that left the label selection while running (vm_untracked), with their status
        self.untracked: dict[Target, InstanceStatus] = {}
        self._alarm_lock = threading.Lock()
        self._raised: list[tuple[Target, str]] = []
        self._cleared: list[tuple[Target, str]] = []
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="poll")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _poller(self, t: Target) -> Poller:
        key = (t.project, t.zone)
        if key not in self._pollers:
            self._pollers[key] = Poller(
                self.client, self.store, t.project, t.zone, self.ledger, self.policy, self.reap,
                clock=self.clock, peers=self.peers, logging=self.logging,
            )  # fmt: skip
        return self._pollers[key]

    @staticmethod
    def _emit(
        out: PollOutcome | None, emit: Callable[[PollOutcome], None], rep: RoundReport
    ) -> None:
        if out is not None:
            rep.outcomes += 1
            emit(out)

    def _finalize(self, t: Target) -> PollOutcome | None:
        """A VM no longer listed (or untracked since an earlier round): asked for by name.
        Deleted (404): decided on its cursor, through the ledger, then its cursor dropped.
        Still there and not ended: untracked, an alarm, polled as a listed VM is. Ended: polled
        once more if it was untracked (the verdict sees how it ended), then let go."""
        st = self.client.get_instance(t.project, t.zone, t.name)
        was = self.untracked.get(t)
        if st is None:
            if was is not None:
                self._clear(t, was, "deleted")
            out = self._poller(t).poll(t.name, gone=True)
            settled = out.decision is not None or not (out.verdict and out.verdict.failover)
            if out.error is None and settled:  # decided (or nothing to decide): never again
                self.store.drop(t.project, t.zone, t.name)
            return out
        if st.status in ENDED_STATUSES:
            if was is None:
                return None  # left the selection after it ended: nothing runs unwatched
            self._clear(t, st, f"ended ({st.status})")
            return self._poller(t).poll(t.name, st)
        self._untrack(t, st)
        return self._poller(t).poll(t.name, st)

    def _seed_untracked(self) -> None:
        """A restarted poller takes the raised vm_untracked alarms of its projects from the
        ledger: those VMs are polled until they end, even if they ended while it was down."""
        if self.ledger is None:
            return
        for a in self.ledger.decisions.alarms():
            parts = a.instance.split("/")
            if a.alarm != VM_UNTRACKED or len(parts) != 3 or parts[0] not in self.projects:
                continue
            t = Target(*parts)
            labels = tuple(sorted(a.labels.items()))
            self.untracked[t] = InstanceStatus(t.name, a.instance_id, a.status, False, "", labels)

    def _untrack(self, t: Target, st: InstanceStatus) -> None:
        """Record the VM as untracked; the ledger's alarm raised (or seen again)."""
        with self._alarm_lock:
            new = t not in self.untracked
            self.untracked[t] = st
        raised = new
        if self.ledger is not None:
            raised = self.ledger.decisions.raise_alarm(
                st.id, VM_UNTRACKED, str(t), st.status, dict(st.labels), self.clock()
            )
        if raised:
            with self._alarm_lock:
                self._raised.append((t, st.status))

    def _clear(self, t: Target, st: InstanceStatus, why: str) -> None:
        with self._alarm_lock:
            self.untracked.pop(t, None)
            self._cleared.append((t, why))
        if self.ledger is not None:
            self.ledger.decisions.clear_alarm(st.id, VM_UNTRACKED, why, self.clock())

    def announced(self, out: PollOutcome) -> bool:
        """``Poller.announced`` for an outcome of this fleet."""
        if self.ledger is None:
            return False
        return announced_outcome(self.ledger.decisions, out, self.clock())

    def round(
        self,
        deadline_s: float,
        emit: Callable[[PollOutcome], None],
        monotonic: Callable[[], float],
        select: Callable[[Target, InstanceStatus | None], bool] | None = None,
    ) -> RoundReport:
        """Discover, poll everything listed (and once more what vanished), emit outcomes until
        ``deadline_s`` (a ``monotonic`` time). Raises AuthError from discovery; a project whose
        list failed is in the report's ``failed``, its known VMs kept and polled."""
        started = self.clock()  # a delivery that fails in this round is retried in the next
        found = discover(self.client, self.projects, self.filter)

        def unlisted(t: Target) -> bool:  # the list said nothing about its zone or project
            return (t.project, t.zone) in found.unreachable or t.project in found.failed

        if not self._seeded:  # a restarted poller: what it polled before is in its cursors
            self._seeded = True
            for project, zone, name in self.store.saved():
                t = Target(project, zone, name)
                if project in self.projects and t not in found.instances:
                    self._unlisted.add(t)
            self._seed_untracked()
        rep = RoundReport(discovered=len(found.instances), unreachable=found.unreachable)
        rep.pages = found.pages
        rep.failed = dict(found.failed)
        rep.new = sorted(set(found.instances) - set(self.known))
        rep.gone = sorted(
            t for t in (set(self.known) | self._unlisted) - set(found.instances) if not unlisted(t)
        )
        # cursors of a project whose list failed, or of a zone it could not reach, wait for the
        # next list that answers for them to say whether they are gone
        self._unlisted = {t for t in self._unlisted if unlisted(t)}
        jobs: dict[Target, InstanceStatus | None] = dict(found.instances)
        for t in rep.gone:
            jobs[t] = None  # by name: a 404 is finalized once, a running one is untracked
        for t, was in sorted(self.untracked.items()):
            if t in found.instances:  # selected again: watched as any listed VM
                self._clear(t, was, "selected again")
            elif not unlisted(t):
                jobs[t] = None  # still untracked: asked for by name again
        for t in self.known:
            if unlisted(t) and t not in jobs:
                jobs[t] = self.known[t]  # keep it: the list said nothing about it
        self.known = {t: st for t, st in jobs.items() if st is not None}
        futures: dict[cf.Future[PollOutcome | None], Target] = {}
        for t, st in sorted(jobs.items(), key=lambda kv: kv[0]):
            if t in self._inflight:
                continue  # its previous poll is still running
            if select is not None and not select(t, st):
                continue  # (the Pub/Sub sweep: only the stopped, the silent, the unheard)
            if st is None:
                fut = self._pool.submit(self._finalize, t)
            else:
                fut = self._pool.submit(self._poller(t).poll, t.name, st)
            self._inflight[t] = fut
            futures[fut] = t
        try:
            left = None if math.isinf(deadline_s) else max(0.0, deadline_s - monotonic())
            for fut in cf.as_completed(futures, timeout=left):
                t = futures[fut]
                del self._inflight[t]
                self._emit(fut.result(), emit, rep)
        except TimeoutError:
            pass
        with self._alarm_lock:
            rep.untracked = sorted(self.untracked)
            rep.raised, self._raised = self._raised, []
            rep.cleared, self._cleared = self._cleared, []
        rep.slow = sorted(t for t, f in self._inflight.items() if not f.done())
        # polls that finished after the deadline (or were slow in an earlier round) come out now
        for t, f in list(self._inflight.items()):
            if f.done():
                del self._inflight[t]
                self._emit(f.result(), emit, rep)
        if self.ledger is not None:  # decisions whose claimer died before announcing them
            for out in lapsed_announcements(self.ledger.decisions, started):
                rep.outcomes += 1
                emit(out)
        return rep
