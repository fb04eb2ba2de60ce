"""``gce-watchdog decisions`` and ``gce-watchdog pin``: the ledger's commands for operators.

``decisions`` is the dispatcher's view of the ledger and the brake's hold list (docs/poller.md,
"Decisions as an interface"); ``pin`` records an instance's protocol v3 line key by hand
(docs/serial-protocol.md, "Pins"). Both only parse and hand over; the ledger modules are
imported inside the handlers, as in ``poller/cli.py``.
"""

from __future__ import annotations

import argparse

from gce_watchdog.lib.cli import EX_IOERR, EX_OK, EX_USAGE, CommandError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "decisions",
        help="the ledger's decisions for a dispatcher; what the fleet-wide brake holds",
        description="list (default): the failover decisions after --after TOKEN, in token order "
        "(gap-free, increasing), optionally following new ones; held: what the brake holds; "
        "release --all|ID...: let held failovers through.",
    )
    d.add_argument("what", nargs="?", default="list", choices=("list", "held", "release"))
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
        description="Record in the ledger that INSTANCE_ID's protocol v3 line key is the one "
        "with FINGERPRINT (read on the VM as root: `gce-watchdog key --fingerprint`). Every "
        "poller and Pub/Sub worker sharing the ledger then trusts that key only; it replaces "
        "any pin the instance had.",
    )
    pin.add_argument("instance_id", metavar="INSTANCE_ID")
    pin.add_argument("fingerprint", metavar="FINGERPRINT", help="32 lowercase hex")
    pin.add_argument("--ledger", default=None, help="the ledger (as for poll)")
    pin.set_defaults(func=cmd_pin)


def cmd_pin(args: argparse.Namespace) -> int:
    import re

    from gce_watchdog.poller.app import default_ledger
    from gce_watchdog.poller.ledgers import open_ledger

    if not re.fullmatch(r"[0-9]{1,20}", args.instance_id):
        raise CommandError(EX_USAGE, "gce-watchdog pin: INSTANCE_ID is the numeric instance id")
    if not re.fullmatch(r"[0-9a-f]{32}", args.fingerprint):
        raise CommandError(EX_USAGE, "gce-watchdog pin: FINGERPRINT is 32 lowercase hex")
    try:
        with open_ledger(args.ledger or default_ledger()) as led:
            old = led.pins.hand_pin(args.instance_id, args.fingerprint)
    except ValueError as e:
        raise CommandError(EX_USAGE, f"gce-watchdog pin: --ledger: {e}") from None
    except Exception as e:  # the ledger's own errors: unreachable, unwritable
        raise CommandError(EX_IOERR, f"gce-watchdog pin: ledger: {e}") from None
    was = f" (was {old.fingerprint}, {old.source})" if old is not None else ""
    print(f"pinned {args.instance_id} {args.fingerprint}{was}")
    return EX_OK


def cmd_decisions(args: argparse.Namespace) -> int:
    if args.what == "release" and not (args.all or args.ids):
        raise CommandError(EX_USAGE, "gce-watchdog decisions: release needs --all or IDs")
    from gce_watchdog.poller.app import run_decisions_cmd

    return run_decisions_cmd(args.ledger, args.what, args.after, args.follow, args.json,
                             list(args.ids), args.all)  # fmt: skip
