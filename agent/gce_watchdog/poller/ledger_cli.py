"""``gce-watchdog decisions`` and ``gce-watchdog pin``: the ledger's commands for operators.

``decisions`` is the dispatcher's view of the ledger and the brake's hold list (docs/poller.md,
"Decisions as an interface"); ``pin`` records an instance's protocol v3 line key by hand
(docs/serial-protocol.md, "Pins"). Both only parse and hand over; the ledger modules are
imported inside the handlers, as in ``poller/cli.py``.
"""

from __future__ import annotations

import argparse
import os

from gce_watchdog.lib.cli import EX_USAGE, CommandError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "decisions",
        help="the ledger's decisions for a dispatcher; what the fleet-wide brake holds",
        description="list (default): the failover decisions after --after TOKEN, in token order "
        "(gap-free, increasing), optionally following new ones; held: what the brake holds; "
        "release --all|ID...: let held failovers through; alarms: the raised alarms about "
        "whole instances (vm_untracked: a VM that left the fleet's label selection while "
        "running; idle_busy: a job's GPUs not released at its end; boot_regressed: a boot "
        "counter at or below the instance's highest, a replay or a lost counter).",
    )
    d.add_argument("what", nargs="?", default="list", choices=("list", "held", "release", "alarms"))
    d.add_argument("ids", nargs="*", metavar="ID", help="release: instance ids or P/Z/NAME")
    d.add_argument("--all", action="store_true", help="release: every held failover")
    d.add_argument("--ledger", default=None, help="as for poll (the same default file)")
    d.add_argument("--after", type=int, default=0, help="only decisions with a larger token")
    d.add_argument("--follow", action="store_true", help="keep waiting for new decisions")
    d.add_argument("--json", action="store_true", help="one JSON object per line (version 1)")
    d.set_defaults(func=cmd_decisions)

    pin = sub.add_parser(
        "pin",
        help="pin an instance's line key by hand (a fleet running before its poller)",
        description="Record in the ledger that INSTANCE's protocol v3 line key is the one with "
        "FINGERPRINT (read on the VM as root: `gce-watchdog key --fingerprint`). Every poller "
        "and Pub/Sub worker sharing the ledger then trusts that key only. INSTANCE is "
        "PROJECT/ZONE/NAME or the numeric instance id (then --project says where to look): the "
        "Compute API must find it, and the ledger must exist (--create makes a new SQLite one). "
        "A pin of another fingerprint is replaced only with --replace; both are printed.",
    )
    pin.add_argument("instance", metavar="INSTANCE", help="PROJECT/ZONE/NAME or the instance id")
    pin.add_argument("fingerprint", metavar="FINGERPRINT", help="32 lowercase hex")
    pin.add_argument("--ledger", default=None, help="the ledger (as for poll)")
    pin.add_argument(
        "--project", action="append", default=[], help="with an instance id: the projects to "
        "look it up in (repeatable)"
    )  # fmt: skip
    pin.add_argument("--create", action="store_true", help="create the SQLite ledger if absent")
    pin.add_argument("--replace", action="store_true", help="replace a pin of another fingerprint")
    pin.add_argument(
        "--api-base",
        default=os.environ.get("GCE_WATCHDOG_COMPUTE_API") or None,
        help="Compute API base URL (as for poll)",
    )
    pin.add_argument("--access-token-file", default=None, help="as for poll")
    pin.set_defaults(func=cmd_pin)


def cmd_pin(args: argparse.Namespace) -> int:
    from gce_watchdog.poller.app import PinRequest, run_pin_cmd

    return run_pin_cmd(
        PinRequest(
            instance=args.instance,
            fingerprint=args.fingerprint,
            projects=tuple(args.project),
            ledger=args.ledger,
            create=args.create,
            replace=args.replace,
            api_base=args.api_base,
            token_file=args.access_token_file,
        )
    )


def cmd_decisions(args: argparse.Namespace) -> int:
    if args.what == "release" and not (args.all or args.ids):
        raise CommandError(EX_USAGE, "gce-watchdog decisions: release needs --all or IDs")
    from gce_watchdog.poller.app import run_decisions_cmd

    return run_decisions_cmd(args.ledger, args.what, args.after, args.follow, args.json,
                             list(args.ids), args.all)  # fmt: skip
