"""``gce-watchdog poll`` and ``gce-watchdog parse``.

Exit codes (also in docs/poller.md):

==  =====================================================================================
0   every instance was read and decided (whatever the verdicts) / the dump was parsed
2   usage error (bad arguments, invalid project, zone or instance name, bad duration)
66  ``parse``: the input file cannot be read (EX_NOINPUT)
69  ``poll``: at least one instance could not be read (API unreachable, gave up after
    retries); the others were still decided and reported (EX_UNAVAILABLE)
74  ``poll``: the ledger or cursor directory cannot be opened or written (EX_IOERR)
77  ``poll``: no credentials, or the API rejected them (EX_NOPERM)
==  =====================================================================================

Heavy modules (google-auth, sqlite3, json) are imported inside the handlers: ``cli`` imports
this module on every ``gce-watchdog`` start.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

EX_USAGE = 64  # sysexits.h: every command exits 64 on a usage error (lib/cli.py)
EX_NOINPUT = 66
EX_UNAVAILABLE = 69
EX_IOERR = 74
EX_NOPERM = 77


def _state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")


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
        help="the project (repeat it with --label to poll the labelled VMs of several)",
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
        default=None,
        help="the ledger shared by every poller: a SQLite file (default $XDG_STATE_HOME/"
        "gce-watchdog/ledger.sqlite) or a postgresql:// URL for pollers on several hosts "
        "(needs the [postgres] extra; a password belongs in ~/.pgpass or PGPASSWORD, not here)",
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
    p.add_argument("--json", action="store_true", help="one JSON object per instance per poll")
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
        "--api-attempts",
        type=int,
        default=5,
        help="attempts per API call on rate limits and transient errors (default 5)",
    )
    p.add_argument("--drain-timeout", default="15m", help="silence that means a wedge (15m)")
    p.set_defaults(func=cmd_poll)

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


def _policy(args: argparse.Namespace) -> Any:
    from gce_watchdog.lib.durations import parse_duration
    from gce_watchdog.poller.verdict import Policy

    return Policy(
        drain_timeout_s=parse_duration(args.drain_timeout),
        ended_unread_failover=getattr(args, "on_ended_unread", "alarm") == "failover",
        unverified_failover=getattr(args, "on_unverified", "alarm") == "failover",
    )


# -- parse --------------------------------------------------------------------------------------


def cmd_parse(args: argparse.Namespace) -> int:
    import json

    from gce_watchdog.poller.timeline import Timeline
    from gce_watchdog.poller.verdict import InstanceState
    from gce_watchdog.wire.protocol import Event, format_ts
    from gce_watchdog.wire.vocab import human_fields

    try:
        policy = _policy(args)
    except ValueError as e:
        print(f"gce-watchdog parse: --drain-timeout: {e}", file=sys.stderr)
        return EX_USAGE
    times = judging_times(args, args.file)
    if isinstance(times, str):
        print(f"gce-watchdog parse: {times}", file=sys.stderr)
        return EX_USAGE
    rx, now = times
    tl = Timeline()
    # every event, in stream order: the timeline itself compacts past MAX_EVENTS (its verdict
    # inputs stay), parse shows all of them
    events: list[Event] = []
    total = 0
    try:
        if args.file == "-":
            src = sys.stdin.buffer
            while chunk := src.read(1 << 16):
                total += len(chunk)
                events += tl.feed(chunk, rx)
        else:
            with open(args.file, "rb") as f:
                while chunk := f.read(1 << 16):
                    total += len(chunk)
                    events += tl.feed(chunk, rx)
    except OSError as e:
        print(f"gce-watchdog parse: cannot read {args.file}: {e.strerror or e}", file=sys.stderr)
        return EX_NOINPUT
    events += tl.finish(rx)
    verdict = tl.judge(InstanceState(args.status, args.spot), now, policy)
    if args.json:
        print(json.dumps(_timeline_json(tl, events, verdict, total), sort_keys=True))
        return 0
    out = sys.stdout
    print(f"{args.file}: {total} bytes, {tl.lines} lines", file=out)
    print(f"boots ({len(tl.boots)}):", file=out)
    for b in sorted(tl.boots.values(), key=lambda b: b.order):
        print(
            f"  {b.boot}  seq {b.first_seq}..{b.max_seq}  {b.count} lines  lost {b.lost}  "
            f"{format_ts(b.first_ts_ms)} .. {format_ts(b.last_ts_ms)}",
            file=out,
        )
    print(f"events ({len(events)}):", file=out)
    for ev in events:
        kv = human_fields(ev.fields)
        text = f" | {ev.text}" if ev.text else ""
        print(f"  {format_ts(ev.ts_ms)} {ev.boot} #{ev.seq} {ev.event} {kv}{text}", file=out)
    print(f"gaps: {len(tl.seq_gaps)} sequence, {tl.lost_lines} lines lost", file=out)
    for g in tl.seq_gaps:
        print(f"  boot {g.boot}: after seq {g.after} came {g.next} ({g.missing} lost)", file=out)
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(tl.reject_reasons.items()))
    print(f"rejected: {tl.rejected}" + (f" ({reasons})" if reasons else ""), file=out)
    for s in tl.reject_samples:
        print(f"  {s.rstrip()!r}", file=out)
    print(f"duplicates: {tl.duplicates}", file=out)
    if tl.conflicts:
        print(f"sequence conflicts: {tl.conflicts}", file=out)
    if tl.forged or tl.key_conflict:
        why = ", ".join(f"{k} {v}" for k, v in sorted(tl.forged_reasons.items()))
        two = "; TWO KEYS announced, no line decides" if tl.key_conflict else ""
        print(f"ALARM: forged: {tl.forged} ({why}){two}", file=out)
        for s in tl.forged_samples:
            print(f"  {s.rstrip()!r}", file=out)
    print(f"key: {tl.key_id or 'none announced'}", file=out)
    act = "FAILOVER" if verdict.failover else "no failover"
    print(f"verdict: {verdict.kind.value} ({act}): {verdict.reason}", file=out)
    for item in verdict.evidence:
        print(f"  {item}", file=out)
    return 0


def _timeline_json(tl: Any, events: list[Any], verdict: Any, total: int) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "bytes": total,
        "lines": tl.lines,
        "boots": [
            {**asdict(b), "lost": b.lost} for b in sorted(tl.boots.values(), key=lambda b: b.order)
        ],
        "events": [e.to_json() for e in events],
        "seq_gaps": [{**asdict(g), "missing": g.missing} for g in tl.seq_gaps],
        "lost_lines": tl.lost_lines,
        "rejected": tl.rejected,
        "reject_reasons": tl.reject_reasons,
        "reject_samples": tl.reject_samples,
        "duplicates": tl.duplicates,
        "forged": tl.forged,
        "forged_reasons": tl.forged_reasons,
        "forged_samples": tl.forged_samples,
        "conflicts": tl.conflicts,
        "key_id": tl.key_id,
        "key_conflict": tl.key_conflict,
        "verdict": {
            "kind": verdict.kind.value,
            "failover": verdict.failover,
            "reason": verdict.reason,
            "boot": verdict.boot,
            "evidence": list(verdict.evidence),
        },
    }


# -- poll ---------------------------------------------------------------------------------------


def cmd_poll(args: argparse.Namespace) -> int:
    from gce_watchdog.lib.compute import validate_target
    from gce_watchdog.lib.durations import parse_duration

    errs: list[str] = []
    if args.pubsub is not None:
        from gce_watchdog.poller.pubsub import SUBSCRIPTION_RE

        if not SUBSCRIPTION_RE.match(args.pubsub):
            errs.append(f"--pubsub {args.pubsub!r}: want projects/PROJECT/subscriptions/NAME")
        if args.instances or args.zone:
            errs.append("--pubsub takes no INSTANCE names nor --zone (--label for the sweep)")
        try:
            args.settle_s = parse_duration(args.settle)
            args.sweep_s = parse_duration(args.sweep_interval)
            if args.sweep_s <= 0:
                errs.append("--sweep-interval must be > 0")
        except ValueError as exc:
            errs.append(str(exc))
    if args.label is not None:
        from gce_watchdog.poller.fleet import parse_label

        if args.instances or args.zone:
            errs.append("--label polls every zone: give neither INSTANCE names nor --zone")
        try:
            parse_label(args.label)
        except ValueError as exc:
            errs.append(f"--label: {exc}")
        for project in args.project:  # (any valid zone: only the project is checked here)
            errs += validate_target(project, "us-central1-a", [])
    elif args.pubsub is not None:
        pass
    elif len(args.project) != 1 or not args.zone or not args.instances:
        errs.append("give one --project, --zone and INSTANCE names, or --label")
    else:
        errs += validate_target(args.project[0], args.zone, list(args.instances))
    if args.workers < 1:
        errs.append("--workers must be >= 1")
    if not args.budget > 0:
        errs.append("--budget must be > 0 requests per minute")
    interval, policy = 0.0, None
    try:
        args.interval_s = parse_duration(args.interval)  # --once: what the budget is planned for
        interval = 0.0 if args.once else args.interval_s
        if args.interval_s <= 0:
            errs.append("--interval must be > 0")
        policy = _policy(args)
    except ValueError as exc:
        errs.append(str(exc))
    try:
        args.announce_lease_s = parse_duration(args.announce_lease)
        if args.announce_lease_s <= 0:
            errs.append("--announce-lease must be > 0")
    except ValueError as exc:
        errs.append(f"--announce-lease: {exc}")
    if args.api_attempts < 1:
        errs.append("--api-attempts must be >= 1")
    if args.max_polls < 0:
        errs.append("--max-polls must be >= 0")
    if errs:
        for msg in errs:
            print(f"gce-watchdog poll: {msg}", file=sys.stderr)
        return EX_USAGE
    return _run_poll(args, interval, policy)


def _credentials(args: argparse.Namespace) -> Any:
    if not args.access_token_file:
        return None
    from google.oauth2.credentials import Credentials

    token = Path(args.access_token_file).read_text().strip()
    if not token:
        raise ValueError(f"{args.access_token_file} is empty")
    return Credentials(token)  # type: ignore[no-untyped-call]


def _run_poll(args: argparse.Namespace, interval: float, policy: Any) -> int:
    import signal
    import sqlite3
    import threading
    import time

    from gce_watchdog.lib.compute import DEFAULT_API_BASE, AuthError, ComputeClient, RetryPolicy
    from gce_watchdog.poller.ledger import open_ledger
    from gce_watchdog.poller.poller import (
        Poller,
        TargetNotFound,
        announced_outcome,
        lapsed_announcements,
    )
    from gce_watchdog.poller.reader import CursorStore

    state = _state_home() / "gce-watchdog"
    try:
        creds = _credentials(args)
        retry = RetryPolicy(attempts=args.api_attempts)
        client = ComputeClient.create(creds, args.api_base or DEFAULT_API_BASE, retry=retry)
    except (OSError, ValueError) as e:
        print(f"gce-watchdog poll: --access-token-file: {e}", file=sys.stderr)
        return EX_NOPERM
    except AuthError as e:
        print(f"gce-watchdog poll: {e}", file=sys.stderr)
        return EX_NOPERM
    try:
        ledger = open_ledger(
            args.ledger or state / "ledger.sqlite", announce_lease_s=args.announce_lease_s
        )
    except ImportError as e:
        print(f"gce-watchdog poll: a postgresql ledger needs psycopg: {e}", file=sys.stderr)
        return EX_IOERR
    except Exception as e:  # the driver's own errors (sqlite3.Error, psycopg.Error)
        print(f"gce-watchdog poll: cannot open the ledger: {_redact(e)}", file=sys.stderr)
        return EX_IOERR
    try:
        store = CursorStore(args.cursor_dir or state / "cursors")
    except OSError as e:
        ledger.close()
        print(f"gce-watchdog poll: cannot open the cursor directory: {e}", file=sys.stderr)
        return EX_IOERR
    ledger_errors: tuple[type[BaseException], ...] = (OSError, sqlite3.Error, *ledger.errors)
    from gce_watchdog.poller.fleet_cli import budgeted

    budget = budgeted(client, args.budget, args.workers)
    stop = threading.Event()
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, lambda *_: stop.set())
    if args.pubsub is not None or args.label is not None:
        from gce_watchdog.poller.fleet_cli import run_fleet
        from gce_watchdog.poller.pubsub_cli import run_pubsub

        try:
            run = run_pubsub if args.pubsub is not None else run_fleet
            return run(args, client, store, ledger, policy, interval, budget, stop, _print_outcome)
        except AuthError as e:
            print(f"gce-watchdog poll: {e}", file=sys.stderr)
            return EX_NOPERM
        except ledger_errors as e:
            print(f"gce-watchdog poll: ledger/cursor write failed: {e}", file=sys.stderr)
            return EX_IOERR
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
            ledger.close()
            client.close()
    poller = Poller(client, store, args.project[0], args.zone, ledger, policy, args.reap)
    rc = 0
    rounds = 0
    try:
        while not stop.is_set():
            rounds += 1
            rc = 0
            for name in args.instances:
                try:
                    out = poller.poll(name)
                    if out.error:
                        rc = EX_UNAVAILABLE
                    _print_outcome(out, args.json)
                    poller.announced(out)  # after the line is out: pending until then
                except AuthError as e:
                    print(f"gce-watchdog poll: {e}", file=sys.stderr)
                    return EX_NOPERM
                except TargetNotFound as e:
                    # a wrong project or zone: a configuration error, never a verdict
                    print(f"gce-watchdog poll: {e}", file=sys.stderr)
                    return EX_UNAVAILABLE
                except ledger_errors as e:
                    print(f"gce-watchdog poll: ledger/cursor write failed: {e}", file=sys.stderr)
                    return EX_IOERR
            try:  # decisions whose claimer died before announcing them (e.g. a reaped VM)
                for out in lapsed_announcements(ledger, time.time()):
                    _print_outcome(out, args.json)
                    announced_outcome(ledger, out, time.time())
            except ledger_errors as e:
                print(f"gce-watchdog poll: ledger write failed: {e}", file=sys.stderr)
                return EX_IOERR
            for key in store.corrupt:
                print(f"gce-watchdog poll: cursor {key} was unreadable; restarted", file=sys.stderr)
            store.corrupt.clear()
            if args.once or (args.max_polls and rounds >= args.max_polls):
                break
            stop.wait(interval)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        ledger.close()
        client.close()
    return rc


def _redact(e: BaseException) -> str:
    """An error's text without a password a connection URL may carry (user:secret@host)."""
    import re

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
