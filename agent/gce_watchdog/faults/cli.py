"""The fault commands: ``fault inject|status|clear``. argparse code only: the rules are planned
in plan.py and applied by firewall.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gce_watchdog.faults.firewall import (
    Deps,
    Paths,
    ToolMissing,
    clear,
    inject,
    status,
)
from gce_watchdog.faults.plan import (
    MAX_TTL,
    Cut,
    FaultError,
    iso,
    parse_ttl,
)
from gce_watchdog.lib.cli import (
    EX_FAIL,
    EX_IOERR,
    EX_NOPERM,
    EX_OK,
    EX_UNAVAILABLE,
    EX_USAGE,
    CommandError,
)
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.cli import add_config_arg
from gce_watchdog.vm.runtime import CommandConsole, load_config_or_exit, open_console

# `fault inject --json` and `fault status --json`'s version (docs/json.md,
# schemas/fault-inject.schema.json, schemas/fault-status.schema.json): 1, the first with `v`.
FAULT_JSON_VERSION = 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fault",
        help="inject network faults with iptables (operators; needs root)",
        description="Cut network paths with iptables for a bounded time, keeping SSH open.",
    )
    fsub = p.add_subparsers(dest="fault_command", metavar="ACTION")

    def common(q: argparse.ArgumentParser) -> None:
        add_config_arg(q)
        q.add_argument("--iptables", default="iptables", help="iptables binary (default: PATH)")
        q.add_argument(
            "--ip6tables", default="ip6tables", help="ip6tables binary, or 'none' for IPv4 only"
        )

    i = fsub.add_parser("inject", help="install DROP rules until --ttl runs out")
    i.add_argument("--metadata", action="store_true", help="169.254.169.254 tcp/80")
    i.add_argument("--egress443", action="store_true", help="tcp/443 to non-link-local addresses")
    i.add_argument("--dns", action="store_true", help="every DNS server (replies dropped)")
    i.add_argument("--metadata-dns", action="store_true", help="DNS from the metadata server only")
    i.add_argument("--ttl", required=True, help="how long the fault lasts, e.g. 90s, 10m (max 24h)")
    i.add_argument(
        "--revert-with",
        choices=("auto", "systemd", "process"),
        default="auto",
        help="what removes the rules at the TTL (auto: a systemd timer if systemd runs this "
        "network namespace, else a detached process)",
    )
    i.add_argument("--json", action="store_true", help="machine-readable output")
    common(i)
    i.set_defaults(func=cmd_inject)

    s = fsub.add_parser("status", help="show the installed fault and its expiry")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    common(s)
    s.set_defaults(func=cmd_status)

    c = fsub.add_parser("clear", help="remove the fault now")
    c.add_argument("--expire-id", default=None, help=argparse.SUPPRESS)  # the reverter
    c.add_argument("--at", type=float, default=None, help=argparse.SUPPRESS)  # reverter's wait
    common(c)
    c.set_defaults(func=cmd_clear)

    def usage(_args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        raise CommandError(EX_USAGE)

    p.set_defaults(func=usage)


def _deps_from_args(
    args: argparse.Namespace, emit: bool, cfg: cfgmod.Config
) -> tuple[Deps, Paths, CommandConsole | None]:
    deps = Deps(
        iptables=args.iptables,
        ip6tables=None if args.ip6tables in ("none", "") else args.ip6tables,
    )
    console: CommandConsole | None = None
    if emit:
        console = open_console(cfg, prog="gce-watchdog fault")
        deps.emit = console.write
    return deps, Paths(Path(cfg.agent.run_dir), getattr(args, "config", None)), console


def _run_op(
    args: argparse.Namespace,
    emit: bool,
    op: Callable[[Deps, Paths], int],
    euid: Callable[[], int] = os.geteuid,
    before: Callable[[], None] = lambda: None,
) -> int:
    if euid() != 0:
        raise CommandError(
            EX_NOPERM,
            "gce-watchdog fault: must run as root (iptables needs CAP_NET_ADMIN); "
            "try: sudo gce-watchdog fault ...",
        )
    # The config is read before `before` (the reverter's wait): a config edited or broken during
    # the TTL must not stop the rules from being removed.
    cfg = load_config_or_exit(args.config)
    before()
    deps, paths, console = _deps_from_args(args, emit, cfg)
    try:
        rc = op(deps, paths)
        if rc == EX_OK and deps.unwritten:
            # Done, but the console does not say so: callers must be able to tell and fall back.
            raise CommandError(
                EX_IOERR,
                f"gce-watchdog fault: {deps.unwritten} serial line(s) not written (exit 74)",
            )
        return rc
    except FaultError as e:
        status = EX_UNAVAILABLE if isinstance(e, ToolMissing) else EX_FAIL
        raise CommandError(status, f"gce-watchdog fault: {e}") from None
    finally:
        if console is not None:
            console.close()


def cmd_inject(args: argparse.Namespace) -> int:
    try:
        ttl = parse_ttl(args.ttl)
    except ValueError as e:
        raise CommandError(EX_USAGE, f"gce-watchdog fault: {e}") from None
    cut = Cut(args.metadata, args.egress443, args.dns, args.metadata_dns)
    if not cut:
        raise CommandError(
            EX_USAGE,
            "gce-watchdog fault: nothing to cut: give --metadata, --egress443, --dns "
            "and/or --metadata-dns",
        )

    def op(deps: Deps, paths: Paths) -> int:
        inj = inject(deps, paths, cut, ttl, args.revert_with)
        if args.json:
            print(
                json.dumps(
                    {
                        "v": FAULT_JSON_VERSION,
                        "id": inj.fault_id,
                        "cut": cut.label,
                        "ttl": ttl,
                        "until": iso(inj.until),
                        "families": list(inj.families),
                        "revert": inj.revert,
                    },
                    sort_keys=True,
                )
            )
        else:
            how = inj.revert["kind"]
            print(
                f"fault {inj.fault_id}: cut {cut.label} until {iso(inj.until)} "
                f"({int(ttl)}s; reverted by {how}); SSH (tcp/22) stays open; "
                "undo now: gce-watchdog fault clear"
            )
        return EX_OK

    return _run_op(args, True, op)


def cmd_status(args: argparse.Namespace) -> int:
    def op(deps: Deps, paths: Paths) -> int:
        st = status(deps, paths)
        if args.json:
            print(json.dumps({"v": FAULT_JSON_VERSION, **st}, sort_keys=True))
        elif not st["active"]:
            extra = (
                " (a state file is left over; `fault clear` removes it)"
                if st.get("stale_state")
                else ""
            )
            print("no fault installed" + extra)
        else:
            line = (
                f"fault {st['id']}: cut {st['cut']} (IPv{'+'.join(st['families'])}, "
                f"{st['rules']} rules) until {st['until']}"
            )
            if st.get("overdue"):
                line += " - OVERDUE: the reverter did not run; `gce-watchdog fault clear`"
            elif st.get("remaining_s") is not None:
                line += f" ({st['remaining_s']}s left)"
            print(line)
        return EX_OK

    return _run_op(args, False, op)


def cmd_clear(args: argparse.Namespace) -> int:
    def op(deps: Deps, paths: Paths) -> int:
        _, msg = clear(deps, paths, args.expire_id)
        print(msg)
        return EX_OK

    at = args.at
    return _run_op(args, True, op, before=(lambda: _sleep_until(at)) if at is not None else _noop)


def _noop() -> None:
    return None


def _sleep_until(at: float, now: Callable[[], float] = time.time) -> None:
    """The detached reverter's wait. Wall clock, in chunks, so a clock step is noticed; bounded
    by MAX_TTL plus a margin however the clock moves."""
    limit = time.monotonic() + MAX_TTL + 60
    while (left := at - now()) > 0 and time.monotonic() < limit:
        time.sleep(min(left, 5.0))
