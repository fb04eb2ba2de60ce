"""``gce-watchdog poll`` and ``gce-watchdog parse``: their options, and nothing else.

Each handler parses and hands over: ``poll`` builds one
:class:`~gce_watchdog.poller.settings.PollSettings` (every problem with the options listed at
once, exit 64) and runs :func:`gce_watchdog.poller.app.run_poll`; ``parse`` hands the dump to
:func:`gce_watchdog.poller.dump.show_dump`. Exit codes are ``lib/cli.py``'s one table, listed
in each ``--help`` and in docs/poller.md:

==  =====================================================================================
0   every instance was read and decided (whatever the verdicts) / the dump was parsed
64  usage error (bad arguments, invalid project, zone or instance name, bad duration)
66  ``parse``: the input file cannot be read (EX_NOINPUT)
69  ``poll``: at least one instance could not be read (API unreachable, gave up after
    retries, or still polling at the round's deadline); the others were still decided and
    reported; or the project or zone does not exist (EX_UNAVAILABLE)
74  ``poll``: the ledger or cursor directory cannot be opened or written (EX_IOERR)
75  ``poll``: a decision's delivery (``--on-failover``, ``--publish``) failed and stays
    undelivered (``failed`` in the decisions view); the next poll retries it (EX_TEMPFAIL)
77  ``poll``: no credentials, or the API rejected them (EX_NOPERM)
==  =====================================================================================

The library modules (and google-auth, sqlite3, json) are imported inside the handlers: ``cli``
imports this module on every ``gce-watchdog`` start, and ``gce-watchdog run`` must not load them.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from gce_watchdog import __version__
from gce_watchdog.lib.cli import EX_USAGE, CommandError

if TYPE_CHECKING:
    from gce_watchdog.poller.verdict import Policy


SHARED_LEDGER_ENV = "GCE_WATCHDOG_SHARED_LEDGER"


def _env_port() -> int | None:
    raw = os.environ.get("PORT", "").strip()
    return int(raw) if raw.isdigit() else None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "poll",
        help="read serial port 1 of instances through the Compute API and decide failover",
        description="Poll instances' serial port 1, decide per instance, record FAILOVER "
        "decisions exactly once in the ledger, optionally delete (reap) failed-over instances.",
    )
    p.add_argument(
        "--project",
        action="append",
        default=[],
        help="the project (repeat it with --label to poll the labelled VMs of several; with "
        "--pubsub: the projects a deciding instance id is looked up in, default the "
        "subscription's)",
    )
    p.add_argument("--zone", default=None, help="the zone of the INSTANCEs (not with --label)")
    p.add_argument("instances", nargs="*", metavar="INSTANCE")
    p.add_argument(
        "--label",
        default=None,
        metavar="KEY[=VALUE]",
        help="poll every instance carrying this label in every zone of the projects "
        "(instances.aggregatedList), instead of INSTANCE names: new VMs are picked up, "
        "deleted ones finalized through the ledger",
    )
    p.add_argument(
        "--pubsub",
        default=None,
        metavar="projects/P/subscriptions/S",
        help="event-driven: decide on serial lines a Cloud Logging sink publishes to this "
        "subscription (the [pubsub] extra); with --label, a slow Compute API sweep still "
        "catches stopped and silent VMs and polls those whose console is not exported",
    )
    p.add_argument(
        "--settle",
        default="2s",
        help="--pubsub: how long a gap in a boot's line numbers is waited for (default 2s)",
    )
    p.add_argument(
        "--sweep-interval",
        default="5m",
        help="--pubsub with --label: time between Compute API sweeps (default 5m)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=16,
        help="polls running at once (default 16); a slow VM never holds a round past its interval",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=1200,
        help="Compute API requests per minute per project (default 1200, below GCE's default "
        "read quota of 1500); the interval is stretched, with a warning, when the fleet needs more",
    )
    p.add_argument("--once", action="store_true", help="poll each instance once and exit")
    p.add_argument(
        "--interval",
        default="30s",
        help="time between polls (default 30s; with --once, what --budget is checked against)",
    )
    p.add_argument(
        "--max-polls", type=int, default=0, help="stop after N rounds (default 0: until SIGTERM)"
    )
    p.add_argument(
        "--ledger",
        default=os.environ.get("GCE_WATCHDOG_LEDGER") or None,
        help="the ledger shared by every poller: a SQLite file (default $XDG_STATE_HOME/"
        "gce-watchdog/ledger.sqlite) or a postgresql:// URL for pollers on several hosts "
        "(needs the [postgres] extra; a password belongs in ~/.pgpass or PGPASSWORD, not here); "
        "default $GCE_WATCHDOG_LEDGER when set",
    )
    p.add_argument(
        "--announce-lease",
        default="5m",
        help="how long a claimed decision stays with its claimer before another poller may "
        "announce it (default 5m; covers a slow --reap DELETE)",
    )
    p.add_argument(
        "--cursor-dir",
        default=None,
        help="per-instance cursors (default $XDG_STATE_HOME/gce-watchdog/cursors)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="outcomes as JSON objects (schemas/poll.schema.json); alone, every instance every "
        "round (--log every), as always",
    )
    p.add_argument(
        "--log",
        choices=("changes", "every"),
        default=None,
        help="which outcomes are written: every instance every round, or only changes (a new "
        "verdict or action, a decision, an alarm, an error) with a summary line per round on "
        "stderr; default every with --json, else changes (docs/poller.md, 'The journal')",
    )
    p.add_argument(
        "--api-base",
        default=os.environ.get("GCE_WATCHDOG_COMPUTE_API") or None,
        help="Compute API base URL (default https://compute.googleapis.com/compute/v1)",
    )
    p.add_argument(
        "--access-token-file",
        default=None,
        help="read a bearer token from this file instead of application default credentials",
    )
    p.add_argument(
        "--reap",
        action="store_true",
        help="delete an instance after its failover, and after its job ended once it is off",
    )
    for flag, what in (("--on-ended-unread", "ended_unread"), ("--on-unverified", "unverified")):
        p.add_argument(
            flag,
            choices=("alarm", "failover"),
            default="alarm",
            help=f"what a {what} verdict does: alarm only (default) or also fail over",
        )
    p.add_argument(
        "--on-planned-stop",
        choices=("failover", "wait"),
        default="failover",
        help="a host_maintenance or host_error verdict fails over (default) or waits for "
        "GCE's automatic restart (docs/poller.md, 'Planned stops')",
    )
    p.add_argument(
        "--on-gpu-fault",
        choices=("failover", "report"),
        default="failover",
        help="a gpu_fault verdict fails over (default) or is only reported as an alarm",
    )
    p.add_argument(
        "--on-job-stuck",
        choices=("failover", "report"),
        default="failover",
        help="a job_stuck verdict fails over (default) or is only reported as an alarm",
    )
    p.add_argument(
        "--peer-cursor-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="another poller's cursor directory, read (never written) as evidence for a VM "
        "that ended unread; repeatable (docs/poller.md, 'Evidence for an end')",
    )
    p.add_argument(
        "--logging-evidence",
        action="store_true",
        help="read an ended VM's serial-port log from Cloud Logging (serial-port logging "
        "enabled; needs logging.logEntries.list, e.g. roles/logging.viewer)",
    )
    p.add_argument("--logging-api-base", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--api-attempts",
        type=int,
        default=5,
        help="attempts per API call on rate limits and transient errors (default 5)",
    )
    p.add_argument("--drain-timeout", default="15m", help="silence that means a wedge (15m)")
    p.add_argument(
        "--on-failover",
        default=None,
        metavar="CMD",
        help="run CMD (an argv, split like a shell would but never run by one) per announced "
        "decision, the decision's JSON on stdin; marked done only when it exits 0, else retried "
        "(docs/poller.md, 'Decisions as an interface')",
    )
    p.add_argument(
        "--on-failover-timeout", default="60s", help="a run of --on-failover is killed after this"
    )
    p.add_argument(
        "--publish",
        default=None,
        metavar="projects/P/topics/T",
        help="publish each announced decision to this Pub/Sub topic (the [pubsub] extra; "
        "attribute request_id for dedup); marked done only once accepted, else retried; in "
        "every mode, --pubsub workers too",
    )
    p.add_argument(
        "--brake",
        default="on",
        metavar="on|off|SHARE/WINDOW[/FLOOR]",
        help="the fleet-wide brake: hold failovers beyond SHARE of the fleet per WINDOW (never "
        "fewer than FLOOR); on = 10%%/10m/3 (default)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=_env_port(),
        metavar="PORT",
        help="serve GET /healthz on this TCP port: 200 while the loop makes progress, 503 once it "
        "stalled for --health-stall (default $PORT when set, as Cloud Run services set it; "
        "otherwise off)",
    )
    p.add_argument(
        "--health-address",
        default="0.0.0.0",  # Cloud Run: listen on 0.0.0.0, not on loopback
        help="the address --health-port listens on (default 0.0.0.0)",
    )
    p.add_argument(
        "--health-stall",
        default="10m",
        help="no progress for this long makes /healthz answer 503 (default 10m, as the unit's "
        "WatchdogSec=); keep it above 3 x --on-failover-timeout plus the back-off",
    )
    p.add_argument(
        "--version", action="version", version=f"gce-watchdog {__version__}",
        help="print the version and exit (also after the container's `poll --json` entry point)",
    )  # fmt: skip
    # The container image sets GCE_WATCHDOG_SHARED_LEDGER=required: its replicas share no disk
    # and none lasts, so a poll there without a postgresql:// --ledger is a usage error.
    p.set_defaults(func=cmd_poll, shared_ledger=os.environ.get(SHARED_LEDGER_ENV, ""))

    q = sub.add_parser(
        "parse",
        help="decode a saved serial dump into a timeline and a verdict",
        description="Decode a saved serial-port dump (FILE, or - for stdin): events per boot, "
        "sequence and byte gaps, rejected lines, and the verdict.",
    )
    q.add_argument("file", metavar="FILE|-")
    q.add_argument("--json", action="store_true")
    add_judging_args(q)
    q.set_defaults(func=cmd_parse)


# The statuses instances.get can report (compute v1 Instance.status): --status takes only these.
STATUSES = (
    "PROVISIONING",
    "STAGING",
    "RUNNING",
    "STOPPING",
    "STOPPED",
    "SUSPENDING",
    "SUSPENDED",
    "REPAIRING",
    "TERMINATED",
)


def add_judging_args(p: argparse.ArgumentParser) -> None:
    """The verdict inputs ``parse`` and ``report`` share, with the same defaults as ``poll``."""
    p.add_argument(
        "--received",
        default=None,
        metavar="ISO",
        help="when the bytes were received, on the reader's clock (default: the file's "
        "modification time; the current time for stdin)",
    )
    p.add_argument(
        "--now",
        default=None,
        help="time to judge silence against, on the same clock: ISO-8601 UTC, 'now' (the "
        "current time), or 'last'/omitted: when the bytes were received",
    )
    p.add_argument("--status", default=None, choices=STATUSES, help="instance status to assume")
    p.add_argument("--spot", action="store_true", help="the instance is a Spot VM")
    p.add_argument("--drain-timeout", default="15m", help="silence that means a wedge (15m)")


def _iso(flag: str, raw_arg: str) -> float | str:
    from gce_watchdog.wire.protocol import parse_ts

    raw = raw_arg.replace("+00:00", "Z")
    if "." not in raw:
        raw = raw.rstrip("Z") + ".000Z"
    ms = parse_ts(raw)
    if ms is None:
        return f"{flag} {raw_arg!r}: want YYYY-MM-DDTHH:MM:SS[.mmm]Z"
    return ms / 1000


def judging_times(args: argparse.Namespace, path: str) -> tuple[float, float] | str:
    """(received, now) for a dump, or an error message.

    Silence is measured on the reader's clock from when the bytes were received: the poller
    receives each read at its own time; a saved dump was received when it was saved (its
    modification time) unless ``--received`` says otherwise. ``now`` defaults to that moment,
    so a dump alone never makes a wedge; ``--now now`` asks "silent since then, until now?".
    """
    import time

    if args.received is not None:
        rx = _iso("--received", args.received)
        if isinstance(rx, str):
            return rx
    elif path == "-":
        rx = time.time()
    else:
        try:
            rx = os.stat(path).st_mtime
        except OSError:
            rx = time.time()  # the read reports the real problem
    if args.now in (None, "last"):
        return rx, rx
    if args.now == "now":
        return rx, time.time()
    now = _iso("--now", args.now)
    return now if isinstance(now, str) else (rx, now)


def _policy(args: argparse.Namespace) -> Policy:
    from gce_watchdog.poller.settings import policy_of

    return policy_of(vars(args))


# -- parse --------------------------------------------------------------------------------------


def cmd_parse(args: argparse.Namespace) -> int:
    try:
        policy = _policy(args)
    except ValueError as e:
        raise CommandError(EX_USAGE, f"gce-watchdog parse: --drain-timeout: {e}") from None
    times = judging_times(args, args.file)
    if isinstance(times, str):
        raise CommandError(EX_USAGE, f"gce-watchdog parse: {times}")
    from gce_watchdog.poller.dump import show_dump

    rx, now = times
    return show_dump(args.file, rx, now, args.status, args.spot, policy, args.json)


# -- poll ---------------------------------------------------------------------------------------


def cmd_poll(args: argparse.Namespace) -> int:
    from gce_watchdog.poller.settings import InvalidSettings, poll_settings

    try:
        settings = poll_settings(vars(args))
    except InvalidSettings as e:
        lines = [f"gce-watchdog poll: {msg}" for msg in e.errors]
        raise CommandError(EX_USAGE, "\n".join(lines) or None) from None
    from gce_watchdog.poller.app import run_poll

    return run_poll(settings)
