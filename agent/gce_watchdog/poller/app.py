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

Every mode prints each outcome through ``--log``'s filter (:class:`Outcomes`: every one, or
only changes and a summary line per round, :mod:`gce_watchdog.poller.journal`); an announcing
one is delivered (``--publish``, then ``--on-failover``: :mod:`gce_watchdog.poller.hooks`) and
only then marked announced; a failover
the fleet-wide brake holds (:mod:`gce_watchdog.poller.brake`, applied in the ledger's claim)
raises an alarm instead. Under systemd (``$NOTIFY_SOCKET``) the loops notify READY, WATCHDOG on
progress, and STOPPING; secrets come from ``$CREDENTIALS_DIRECTORY`` (:func:`service_credentials`).
:func:`run_decisions_cmd` is ``gce-watchdog decisions`` (:mod:`gce_watchdog.poller.decisions`).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gce_watchdog.lib import jsontime
from gce_watchdog.lib.cli import (
    EX_CONFIG,
    EX_FAIL,
    EX_IOERR,
    EX_NOINPUT,
    EX_NOPERM,
    EX_OK,
    EX_TEMPFAIL,
    EX_UNAVAILABLE,
    EX_USAGE,
    CommandError,
)
from gce_watchdog.lib.compute import (
    DEFAULT_API_BASE,
    AuthError,
    ComputeClient,
    ComputeRetry,
    InstanceStatus,
)
from gce_watchdog.lib.extras import EXTRAS, importable, install_hint, this_install
from gce_watchdog.lib.health import HealthServer, Liveness
from gce_watchdog.lib.sdnotify import Notifier
from gce_watchdog.poller.cloudlogging import LoggingClient, create_logging_client
from gce_watchdog.poller.decisions import poller_metrics
from gce_watchdog.poller.fleet import (
    SLOW_POLL_NOTE,
    BudgetedSession,
    FleetPoller,
    ProjectBudget,
    RoundReport,
    Target,
    plan_interval,
)
from gce_watchdog.poller.hooks import Delivery, FailoverHook, Step, TopicPublisher
from gce_watchdog.poller.identity import ComputeIdentities, subscription_project
from gce_watchdog.poller.journal import LOG_EVERY, Journal, summary_text
from gce_watchdog.poller.ledgers import Ledger, open_ledger
from gce_watchdog.poller.poller import (
    Poller,
    PollOutcome,
    TargetNotFound,
    announced_outcome,
    lapsed_announcements,
)
from gce_watchdog.poller.pubsub import PubSubWorker
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.settings import Mode, PollSettings, ledger_backend

PULL_TIMEOUT_S = 1.0  # a pull waits at most this long, so gaps settle and SIGTERM is seen
HEALTH_WAIT_STEP_S = 1.0  # while waiting between rounds, the health endpoint is fed this often


def _state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")


def default_ledger() -> Path:
    """The ledger ``poll`` and ``pin`` use without --ledger."""
    return _state_home() / "gce-watchdog" / "ledger.sqlite"


def _log(msg: str) -> None:
    print(f"gce-watchdog poll: {msg}", file=sys.stderr, flush=True)


def _failed(status: int, msg: str) -> CommandError:
    """``poll``'s failure: its exit status, its message as :func:`_log` writes it."""
    return CommandError(status, f"gce-watchdog poll: {msg}")


CREDENTIAL_TOKEN = "token"  # noqa: S105 (a credential's name): $CREDENTIALS_DIRECTORY/token
CREDENTIAL_PGPASS = "pgpass"  # $CREDENTIALS_DIRECTORY/pgpass: the ledger's password file


def service_credentials(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The credentials systemd passed (``LoadCredential=``), by name: regular files whose
    content is neither empty nor ``-`` (the shipped unit's ``SetCredential=`` default for each,
    so that a missing source file is not fatal: "not configured")."""
    d = env.get("CREDENTIALS_DIRECTORY")
    found: dict[str, str] = {}
    if not d:
        return found
    for name in (CREDENTIAL_TOKEN, CREDENTIAL_PGPASS):
        path = Path(d) / name
        try:
            usable = path.is_file() and not path.is_symlink()
            if usable and path.read_bytes()[:4096].strip() not in (b"", b"-"):
                found[name] = str(path)
        except OSError:
            continue
    return found


class Pulse:
    """sd_notify for ``Type=notify``: READY=1 once the loop runs, WATCHDOG=1 (at most once a
    second) on progress (an outcome, a pull, a wait between rounds), STOPPING=1 at the end."""

    def __init__(self, notifier: Notifier, clock: Callable[[], float] = time.monotonic) -> None:
        self.notifier = notifier
        self.clock = clock
        self._last = -math.inf
        self._lock = threading.Lock()

    def ready(self, status: str) -> None:
        self.notifier.notify("READY=1", f"STATUS={status}")

    def beat(self) -> None:
        if not self.notifier.watchdog_interval:
            return
        with self._lock:
            now = self.clock()
            if now - self._last < 1.0:
                return
            self._last = now
        self.notifier.notify("WATCHDOG=1")

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        step = self.notifier.watchdog_interval / 3 or seconds
        end = self.clock() + seconds
        while True:
            self.beat()
            left = end - self.clock()
            if left <= 0:
                return stop.is_set()
            if stop.wait(min(step, left)):
                return True

    def stopping(self) -> None:
        self.notifier.notify("STOPPING=1")


class Outcomes:
    """Where outcomes go: each through ``--log``'s filter (:mod:`gce_watchdog.poller.journal`),
    then printed; :meth:`summary` sums up the round. Called from several threads (the Pub/Sub
    workers and the sweep): the filter runs under a lock, the printing outside it."""

    def __init__(self, as_json: bool, log: str) -> None:
        self.as_json = as_json
        self.every = log == LOG_EVERY
        self.journal = Journal(every=self.every)
        self._lock = threading.Lock()

    def __call__(self, out: PollOutcome) -> None:
        with self._lock:
            write = self.journal.admit(out)
        if write:
            _print_outcome(out, self.as_json)

    def summary(self) -> str | None:
        """The round's summary line (``--log changes``; None with ``--log every``, which
        prints every outcome instead); the next round counts from zero."""
        with self._lock:
            tally = self.journal.close_round()
        return None if self.every else summary_text(tally)


@dataclass(frozen=True)
class Parts:
    """What every mode's loop runs on, built by :func:`run_poll`."""

    client: ComputeClient
    store: CursorStore
    ledger: Ledger
    budget: ProjectBudget
    stop: threading.Event  # set by SIGTERM/SIGINT
    ledger_errors: tuple[type[BaseException], ...]  # what a failed ledger or cursor write raises
    hook: FailoverHook | None = None  # --on-failover
    pulse: Pulse | None = None  # systemd's watchdog (Type=notify); None: not under systemd
    # --publish, then --on-failover: each must succeed before the announcement is marked done
    deliveries: tuple[Step, ...] = ()
    logging: LoggingClient | None = None  # --logging-evidence
    health: Liveness | None = None  # --health-port: GET /healthz (lib/health.py)
    # tokens whose delivery failed in this run and that no delivery of this run has delivered
    # since: while any is left, a round's status is EX_TEMPFAIL (docs/poller.md, "Delivery")
    undelivered: set[int] = field(default_factory=set)
    # where outcomes are written, through --log (None: every one, as text or JSON per deliver)
    outcomes: Outcomes | None = None

    def delivered(self, token: int) -> bool:
        """Run the deliveries of one decision (``Delivery``: its state goes to the ledger)."""
        ok = Delivery(self.ledger.decisions, self.deliveries, _log)(token)
        if ok:
            self.undelivered.discard(token)
        else:
            self.undelivered.add(token)
        self.beat()  # a delivery is progress (bounded: attempts x --on-failover-timeout)
        return ok

    def status(self, rc: int) -> int:
        """A round's exit status: ``rc``, or EX_TEMPFAIL where it is EX_OK and a decision of
        this run stays undelivered."""
        return EX_TEMPFAIL if rc == EX_OK and self.undelivered else rc

    def wait(self, seconds: float) -> bool:
        """``stop.wait`` that keeps the watchdog (and the health endpoint) fed while the loop
        waits between rounds: waiting is progress."""
        if self.health is not None:
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                self.health.beat()
                if self.pulse is not None:
                    self.pulse.beat()
                if self.stop.wait(min(left, HEALTH_WAIT_STEP_S)):
                    return True
            self.health.beat()
            return self.stop.is_set()
        if self.pulse is None:
            return self.stop.wait(seconds)
        return self.pulse.wait(self.stop, seconds)

    def beat(self) -> None:
        if self.pulse is not None:
            self.pulse.beat()
        if self.health is not None:
            self.health.beat()

    def write(self, out: PollOutcome, as_json: bool) -> None:
        """Write an outcome, through ``--log``'s filter when there is one."""
        if self.outcomes is not None:
            self.outcomes(out)
        else:
            _print_outcome(out, as_json)

    def deliver(
        self, out: PollOutcome, as_json: bool, mark: Callable[[PollOutcome], object]
    ) -> None:
        """Print an outcome; if it announces a decision, run ``--on-failover`` (when given) and
        ``mark`` the announcement done only once the command exited 0. A held failover raises
        the brake's alarm."""
        self.write(out, as_json)
        self.beat()  # an outcome is progress
        d = out.decision
        if d is not None and d.held:
            _log(
                f"ALARM: the fleet-wide brake holds the failover of {d.instance} "
                f"({d.verdict}, boot {d.boot}): more than the brake's share of the fleet "
                "failed over within its window; `gce-watchdog decisions held` lists what it "
                "holds, `gce-watchdog decisions release --all|ID...` lets it through"
            )
            return
        if not out.announce or d is None:
            return
        if self.deliveries and not self.delivered(d.token):
            return  # failed: the next poll of any poller retries it
        mark(out)


_NEEDS = {"postgres": "a postgresql:// ledger needs", "pubsub": "--pubsub and --publish need"}


def needed_extras(s: PollSettings) -> list[str]:
    """The optional libraries (extras) these settings need: ``postgres`` for a postgresql://
    ledger, ``pubsub`` for --pubsub or --publish."""
    need = []
    try:
        if s.ledger is not None and ledger_backend(s.ledger) == "postgresql":
            need.append("postgres")
    except ValueError:
        pass  # not a ledger at all: open_ledger refuses it with its reason
    if s.pubsub is not None or s.publish:
        need.append("pubsub")
    return need


def _open_client(s: PollSettings) -> tuple[ComputeClient, str | None]:
    """The Compute API client from the token file or systemd's credentials, and that file."""
    creds = service_credentials(os.environ)
    token_file = s.api.token_file or creds.get(CREDENTIAL_TOKEN)
    if not s.api.token_file and CREDENTIAL_TOKEN in creds:
        # Where the token came from, never the token itself (the journal is widely readable).
        _log(f"Compute API token: the {CREDENTIAL_TOKEN!r} credential ($CREDENTIALS_DIRECTORY)")
    if CREDENTIAL_PGPASS in creds and "PGPASSFILE" not in os.environ:
        os.environ["PGPASSFILE"] = creds[CREDENTIAL_PGPASS]  # libpq reads it from there
    try:
        retry = ComputeRetry(attempts=s.api.attempts)
        client = ComputeClient.create(
            _credentials(token_file), s.api.base or DEFAULT_API_BASE, retry=retry
        )
    except (OSError, ValueError) as e:
        raise _failed(EX_NOPERM, f"--access-token-file: {e}") from None
    except AuthError as e:
        raise _failed(EX_NOPERM, str(e)) from None
    return client, token_file


def run_poll(s: PollSettings) -> int:
    """Build the parts, run the mode's loop, close everything; the command's exit status."""
    global _write_line
    # A library the settings need and this installation lacks is a configuration error (78:
    # the units' RestartPreventExitStatus=), found before anything is opened.
    missing = [x for x in needed_extras(s) if not importable(EXTRAS[x].module)]
    if missing:
        how = this_install()
        for x in missing:
            _log(f"{_NEEDS[x]} {EXTRAS[x].library}, not installed: {install_hint(x, how)}")
        raise CommandError(EX_CONFIG)
    state = _state_home() / "gce-watchdog"
    client, token_file = _open_client(s)
    try:
        ledger = open_ledger(
            s.ledger or state / "ledger.sqlite", announce_lease_s=s.announce_lease_s
        )
    except ImportError as e:  # installed but unusable (psycopg without a libpq)
        hint = install_hint("postgres", this_install())
        raise _failed(EX_CONFIG, f"a postgresql ledger needs psycopg: {e}: {hint}") from None
    except Exception as e:  # the driver's own errors (sqlite3.Error, psycopg.Error)
        raise _failed(EX_IOERR, f"cannot open the ledger: {_redact(e)}") from None
    try:
        store = CursorStore(s.cursor_dir or state / "cursors")
    except OSError as e:
        ledger.close()
        raise _failed(EX_IOERR, f"cannot open the cursor directory: {e}") from None
    errors: tuple[type[BaseException], ...] = (OSError, sqlite3.Error, *ledger.errors)
    budget = budgeted(client, s.budget, s.workers)
    stop = threading.Event()
    hook = None
    if s.on_failover:
        hook = FailoverHook(s.on_failover, s.on_failover_timeout_s, stop=stop, log=_log)
    ledger.decisions.brake = s.brake
    notifier = Notifier()
    pulse = Pulse(notifier) if notifier.enabled else None
    deliveries: list[Step] = []
    if s.publish:
        try:
            from google.cloud import pubsub_v1
        except ImportError as e:
            ledger.close()
            client.close()
            hint = install_hint("pubsub", this_install())
            raise _failed(EX_CONFIG, f"--publish needs google-cloud-pubsub: {e}: {hint}") from None
        # every mode, --pubsub workers too: one step of the same Delivery (poller/hooks.py)
        publisher = TopicPublisher(pubsub_v1.PublisherClient(), s.publish, stop=stop, log=_log)
        deliveries.append(publisher)
    if hook is not None:
        deliveries.append(hook)
    if deliveries:
        _write_line = StdoutSink()
    logs = None
    if s.evidence.logging:  # its own session: the logging.read scope (docs/poller.md)
        logs = create_logging_client(
            None if token_file is None else _credentials(token_file), s.evidence.logging_api_base
        )
    live, server = None, None
    if s.health is not None:  # listening once the ledger is open: Cloud Run's startup probe
        live = Liveness(s.health.stall_s)
        try:
            decisions = ledger.decisions
            server = HealthServer(
                live,
                s.health.address,
                s.health.port,
                metrics=lambda: poller_metrics(decisions),
            ).start()
        except OSError as e:
            ledger.close()
            client.close()
            raise _failed(
                EX_IOERR, f"--health-port: cannot listen on {s.health.address}:{s.health.port}: {e}"
            ) from None
        _log(f"health: GET /healthz on {s.health.address}:{server.port}")
    parts = Parts(
        client, store, ledger, budget, stop, errors, hook, pulse, tuple(deliveries), logs, live,
        outcomes=Outcomes(s.json, s.log),
    )  # fmt: skip
    if pulse is not None:
        pulse.ready(f"polling ({s.mode.value})")
    loop = {Mode.INSTANCES: _run_instances, Mode.FLEET: _run_fleet, Mode.PUBSUB: _run_pubsub}
    with _signals_set(stop):
        try:
            return loop[s.mode](s, parts)
        except AuthError as e:
            raise _failed(EX_NOPERM, str(e)) from None
        except errors as e:
            raise _failed(EX_IOERR, f"ledger/cursor write failed: {e}") from None
        finally:
            if pulse is not None:
                pulse.stopping()
            ledger.close()
            client.close()
            if logs is not None:
                logs.close()
            if server is not None:
                server.close()
            _write_line = _print_line


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


def run_decisions_cmd(
    spec: str | None,
    what: str,
    after: int,
    keep_following: bool,
    as_json: bool,
    ids: list[str],
    every: bool,
) -> int:
    """``gce-watchdog decisions``: open the ledger (a release announces through the pollers'
    next round: its lease is 0), run :func:`gce_watchdog.poller.decisions.run_decisions`."""
    from gce_watchdog.poller.decisions import run_decisions
    from gce_watchdog.poller.settings import ledger_backend

    where: str | Path = spec or _state_home() / "gce-watchdog" / "ledger.sqlite"
    try:
        backend = ledger_backend(where)
    except ValueError as e:
        raise CommandError(EX_USAGE, f"gce-watchdog decisions: --ledger: {e}") from None
    if backend == "sqlite" and not Path(where).is_file():
        # a reader never creates a ledger: a typo would follow an empty one forever
        raise CommandError(EX_IOERR, f"gce-watchdog decisions: no ledger at {where}")
    try:
        ledger = open_ledger(where, announce_lease_s=0.0)
    except Exception as e:  # the driver's own errors, psycopg missing
        raise CommandError(
            EX_IOERR, f"gce-watchdog decisions: cannot open the ledger: {_redact(e)}"
        ) from None
    stop = threading.Event()
    with _signals_set(stop):
        try:
            return run_decisions(
                ledger.decisions, what, after, keep_following, as_json, ids, every, stop
            )
        finally:
            ledger.close()


@dataclass(frozen=True)
class PinRequest:
    """``gce-watchdog pin``'s options, as plain values (poller/ledger_cli.py)."""

    instance: str  # PROJECT/ZONE/NAME or the numeric instance id
    fingerprint: str
    projects: tuple[str, ...] = ()
    ledger: str | None = None
    create: bool = False
    replace: bool = False
    api_base: str | None = None
    token_file: str | None = None


def _pin_failed(status: int, msg: str) -> CommandError:
    return CommandError(status, f"gce-watchdog pin: {msg}")


def _pin_target(req: PinRequest) -> tuple[str, str, str, str] | str:
    """(project, zone, name, "") for PROJECT/ZONE/NAME, or the instance id; exit 64 otherwise."""
    from gce_watchdog.lib.compute import validate_target

    parts = req.instance.split("/")
    if len(parts) == 3:
        errs = validate_target(parts[0], parts[1], [parts[2]])
        if errs:
            raise _pin_failed(EX_USAGE, "; ".join(errs))
        return parts[0], parts[1], parts[2], ""
    if not re.fullmatch(r"[1-9][0-9]{0,19}", req.instance):
        raise _pin_failed(EX_USAGE, "INSTANCE is PROJECT/ZONE/NAME or the numeric instance id")
    if not req.projects:
        raise _pin_failed(EX_USAGE, "an instance id needs --project (where to look it up)")
    return req.instance


def _pin_resolve(req: PinRequest, client: ComputeClient) -> tuple[str, str]:
    """The instance's (id, project/zone/name) as the Compute API says; refuses one it cannot
    find (69) and one it cannot tell about (75): a typo must not pin anything."""
    from gce_watchdog.lib.compute import ComputeAPIError
    from gce_watchdog.poller.identity import IdentityUnavailable

    target = _pin_target(req)
    if isinstance(target, str):
        try:
            who = ComputeIdentities(client, req.projects, hold_s=0.0).resolve(target)
        except IdentityUnavailable as e:
            raise _pin_failed(EX_TEMPFAIL, f"cannot tell whether {target} exists: {e}") from None
        if who is None:
            raise _pin_failed(
                EX_UNAVAILABLE, f"no instance with id {target} in {', '.join(req.projects)}"
            )
        return who.instance_id, who.target
    project, zone, name, _ = target
    try:
        st = client.get_instance(project, zone, name)
    except AuthError as e:
        raise _pin_failed(EX_NOPERM, str(e)) from None
    except ComputeAPIError as e:
        raise _pin_failed(EX_TEMPFAIL, f"cannot tell whether {req.instance} exists: {e}") from None
    if st is None or not st.id:
        raise _pin_failed(EX_UNAVAILABLE, f"no instance {req.instance}")
    return st.id, f"{project}/{zone}/{name}"


def run_pin_cmd(req: PinRequest) -> int:
    """``gce-watchdog pin`` (docs/serial-protocol.md, "Pins"): the fingerprint checked, the
    ledger found (never created by a typo: ``--create``), the instance found through the
    Compute API, then one transaction that pins it, or refuses to replace another pin without
    ``--replace``."""
    if not re.fullmatch(r"[0-9a-f]{32}", req.fingerprint):
        raise _pin_failed(EX_USAGE, "FINGERPRINT is 32 lowercase hex")
    _pin_target(req)  # usage errors first, before any file or request
    where: str | Path = req.ledger or default_ledger()
    try:
        backend = ledger_backend(where)
    except ValueError as e:
        raise _pin_failed(EX_USAGE, f"--ledger: {e}") from None
    if backend == "sqlite" and not req.create and not Path(where).is_file():
        raise _pin_failed(EX_NOINPUT, f"no ledger at {where} (--create makes a new one)")
    try:
        client = ComputeClient.create(
            _credentials(req.token_file), req.api_base or DEFAULT_API_BASE
        )
    except (OSError, ValueError) as e:
        raise _pin_failed(EX_NOPERM, f"--access-token-file: {e}") from None
    except AuthError as e:
        raise _pin_failed(EX_NOPERM, str(e)) from None
    try:
        iid, target = _pin_resolve(req, client)
    finally:
        client.close()
    try:
        with open_ledger(where) as led:
            old = led.pins.hand_pin(iid, req.fingerprint, replace=req.replace)
    except Exception as e:  # the ledger's own errors: unreachable, unwritable
        raise _pin_failed(EX_IOERR, f"ledger: {_redact(e)}") from None
    if old is not None and old.fingerprint == req.fingerprint:
        print(f"already pinned {iid} ({target}) {req.fingerprint} ({old.source}): unchanged")
        return EX_OK
    if old is not None and not req.replace:
        raise _pin_failed(
            EX_FAIL,
            f"{iid} ({target}) is pinned to {old.fingerprint} ({old.source}, by "
            f"{old.pinned_by}), not {req.fingerprint}: nothing changed; --replace replaces it",
        )
    was = f" (replaced {old.fingerprint}, {old.source})" if old is not None else ""
    print(f"pinned {iid} ({target}) {req.fingerprint}{was}")
    return EX_OK


# -- instances ----------------------------------------------------------------------------------


def _run_instances(s: PollSettings, p: Parts) -> int:
    assert s.zone is not None  # settings: this mode has one --project, --zone and names
    poller = Poller(
        p.client, p.store, s.projects[0], s.zone, p.ledger, s.policy, s.reap,
        peers=[Path(d) for d in s.evidence.peer_cursor_dirs], logging=p.logging,
    )  # fmt: skip
    p.ledger.decisions.fleet_size = lambda: len(s.instances)
    decisions = p.ledger.decisions

    def mark_lapsed(out: PollOutcome) -> bool:
        return announced_outcome(decisions, out, time.time())

    rc = EX_OK
    rounds = 0
    while not p.stop.is_set():
        rounds += 1
        rc = EX_OK
        started = time.time()  # a delivery that fails in this round is retried in the next
        for name in s.instances:
            try:  # (AuthError and a failed ledger or cursor write end the run: run_poll)
                out = poller.poll(name)
                if out.error:
                    rc = EX_UNAVAILABLE
                p.deliver(out, s.json, poller.announced)  # marked after: pending until then
            except TargetNotFound as e:
                # a wrong project or zone: a configuration error, never a verdict
                raise _failed(EX_UNAVAILABLE, str(e)) from None
        try:  # decisions whose claimer died before announcing them (e.g. a reaped VM)
            for out in lapsed_announcements(p.ledger.decisions, started):
                p.deliver(out, s.json, mark_lapsed)
        except p.ledger_errors as e:
            raise _failed(EX_IOERR, f"ledger write failed: {e}") from None
        _cursor_notes(p.store)
        _round_summary(p, f"round {rounds}: {len(s.instances)} instance(s) in "
                       f"{time.time() - started:.1f}s")  # fmt: skip
        rc = p.status(rc)
        if s.once or (s.max_polls and rounds >= s.max_polls):
            break
        p.wait(s.wait_s)
    return rc


def _round_summary(p: Parts, head: str, always: bool = False) -> None:
    """``--log changes``: the round's one summary line (``head``; the outcomes by verdict, how
    many written). With ``--log every`` only a line that is ``always`` written is (``head``)."""
    summary = p.outcomes.summary() if p.outcomes is not None else None
    if summary is not None:
        _log(f"{head}; {summary}")
    elif always:
        _log(head)


# -- fleet --------------------------------------------------------------------------------------


def _fleet(s: PollSettings, p: Parts) -> FleetPoller:
    assert s.label_filter is not None  # settings: fleet and the sweep need --label
    return FleetPoller(
        p.client, p.store, p.ledger, list(s.projects), s.label_filter, s.policy, s.reap,
        workers=s.workers, peers=[Path(d) for d in s.evidence.peer_cursor_dirs],
        logging=p.logging,
    )  # fmt: skip


def _run_fleet(s: PollSettings, p: Parts) -> int:
    fleet = _fleet(s, p)
    p.ledger.decisions.fleet_size = lambda: len(fleet.known)
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
                p.deliver(out, s.json, fleet.announced)  # marked after: pending until then

            rep = fleet.round(deadline, emit, time.monotonic)
            took = time.monotonic() - t0
            _round_summary(
                p,
                f"round {rounds}: {rep.discovered} VMs in {len(s.projects)} project(s) "
                f"({len(rep.new)} new, {len(rep.gone)} gone), {rep.outcomes} polled in "
                f"{took:.1f}s, {rep.pages} list page(s)",
                always=True,
            )
            for t in rep.slow:
                rc = EX_UNAVAILABLE
                _log(f"{t}: {SLOW_POLL_NOTE}")
            _log_untracked(rep, fleet)
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
            rc = p.status(rc)
            if s.once or (s.max_polls and rounds >= s.max_polls):
                break
            p.wait(max(0.0, effective - (time.monotonic() - t0)))
    finally:
        fleet.close()
    return rc


def _log_untracked(rep: RoundReport, fleet: FleetPoller) -> None:
    """The vm_untracked alarm in the journal: raised, still held (every round), cleared."""
    raised = {t for t, _ in rep.raised}
    for t, status in rep.raised:
        _log(
            f"ALARM {t} alarm=vm_untracked status={status}: it left the label selection while "
            "running (its label was removed); polled by name until it ends"
        )
    for t in rep.untracked:
        st = fleet.untracked.get(t)
        if t not in raised and st is not None:
            _log(f"ALARM {t} alarm=vm_untracked status={st.status}: still untracked, polled")
    for t, why in rep.cleared:
        _log(f"{t}: vm_untracked cleared: {why}")


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
            p.write(out, s.json)

    sub = s.pubsub
    # who a deciding instance id is: the Compute API's names, in the configured projects (the
    # subscription's without --project), never the LogEntry's labels (docs/poller.md)
    projects = s.projects or (subscription_project(sub.subscription),)
    identity = ComputeIdentities(p.client, projects)
    deliver = p.delivered if p.deliveries else None
    worker = PubSubWorker(
        subscriber, sub.subscription, p.ledger, emit, s.policy, sub.settle_s,
        identity=identity, log=_log, deliver=deliver,
    )  # fmt: skip
    # the fleet the brake is a share of: every instance heard from on the stream or listed
    p.ledger.decisions.fleet_size = worker.fleet_size
    sweeper = None
    if s.label_filter is not None:  # (settings: --label comes with its --project)
        sweeper = threading.Thread(
            target=_sweep, args=(s, p, worker, emit), name="sweep", daemon=True
        )
        sweeper.start()
    _log(f"pulling {sub.subscription}")
    summed = time.monotonic()
    try:
        while not p.stop.is_set():
            worker.step(PULL_TIMEOUT_S)
            p.beat()
            if time.monotonic() - summed >= s.interval_s:  # --log changes: a summary per interval
                _round_summary(p, f"the last {time.monotonic() - summed:.0f}s")
                summed = time.monotonic()
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
    return p.status(EX_OK)


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
        d = out.decision
        if d is not None and d.held:
            _log(f"ALARM: the fleet-wide brake holds the failover of {d.instance}")
        elif out.announce and d is not None:
            if p.deliveries and not p.delivered(d.token):
                return  # failed: the workers' announcement sweep retries it
            fleet.announced(out)

    try:
        while not p.stop.is_set():
            t0 = time.monotonic()
            try:
                rep = fleet.round(t0 + sweep_s, announce, time.monotonic, select)
                _log(f"sweep: {rep.discovered} VMs listed, {rep.outcomes} polled")
                _log_failed_lists(rep.failed)
                _log_untracked(rep, fleet)
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
    """One line per instance and round, led by the UTC time it was decided (RFC 3339)."""
    _write_line(format_outcome(out, as_json, now()))


def format_outcome(out: Any, as_json: bool, at: float) -> str:
    """An outcome's line (without its newline): a JSON object or the text form, ``at`` its
    time (epoch seconds)."""
    ts = jsontime.from_epoch(at, fraction=False)
    if as_json:
        import json

        doc = out.to_json()
        doc.setdefault("ts", ts)
        return json.dumps(doc, sort_keys=True)
    if out.error:
        return f"{ts} {out.instance}: ERROR {out.error}"
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
    key_alarm = getattr(out, "key_alarm", "")
    alarm = ""
    if forged or conflict or key_alarm:  # lines that do not authenticate, keys not placed
        alarm += f" forged={forged}" + (" key_conflict" if conflict else "")
        alarm += f" key={key_alarm.split(' ', 1)[0]}" if key_alarm else ""
    alarm += "".join(f" {a}" for a in v.alarms)  # beside the verdict: idle_busy
    if alarm:
        line += f" ALARM{alarm}"
    line += f" | {v.reason}"
    return line


def _print_line(line: str) -> None:
    print(line, flush=True)


# Where outcome lines go: stdout, written in the caller's thread (a reader that stops reading
# blocks the poller: the existing exactly-once tests rely on that to stop a poller after its
# claim). With --on-failover the hook is the delivery and stdout a log: run_poll routes the lines
# through a StdoutSink, so a full stdout pipe never blocks an announcement.
_write_line: Callable[[str], None] = _print_line


class StdoutSink:
    """Outcome lines to stdout from a thread of their own, through a bounded queue: when stdout
    is not being read and the queue is full, lines are dropped and counted (said on stderr),
    never waited for."""

    def __init__(self, write: Callable[[str], None] = _print_line, size: int = 10_000) -> None:
        import queue

        self._q: queue.Queue[str] = queue.Queue(size)
        self._write = write
        self.dropped = 0
        threading.Thread(target=self._drain, name="stdout", daemon=True).start()

    def __call__(self, line: str) -> None:
        import queue

        try:
            self._q.put_nowait(line)
        except queue.Full:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                _log(f"stdout is not being read: {self.dropped} outcome line(s) dropped")

    def _drain(self) -> None:
        while True:
            line = self._q.get()
            try:
                self._write(line)
            except (OSError, ValueError):
                self.dropped += 1  # a closed stdout: the ledger and the hook still deliver
