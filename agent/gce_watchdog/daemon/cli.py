"""The agent's commands: ``run`` (what the systemd unit starts), ``check`` (one tick, printed),
``disarm`` and ``arm`` (the local switch). argparse code only: each command hands its values to
:mod:`gce_watchdog.daemon.app`, which builds the agent."""

from __future__ import annotations

import argparse

from gce_watchdog.daemon.disarm import MAX_DISARM_S
from gce_watchdog.vm.cli import add_config_arg
from gce_watchdog.wire import vocab


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("run", help="run the watchdog agent (what the systemd unit starts)")
    add_config_arg(r)
    r.add_argument("--max-ticks", type=int, default=None, help="stop after N ticks (tests)")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser(
        "check",
        help="run one tick of both probes and print the result",
        description=(
            "One tick of both probes with the real config, printed as a table (or --json); "
            "nothing is written to the state or the serial port. --npd speaks "
            "node-problem-detector's custom plugin protocol: one short line on stdout and exit "
            "0 OK (both up, or one path down: the ladder would reset), 1 NonOK (both down: the "
            "ladder would climb), 2 Unknown (the check could not run, e.g. an invalid config), "
            "within 4 s whatever the network does (NPD's plugin timeout is 5 s by default)."
        ),
    )
    add_config_arg(c)
    fmt = c.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print one JSON object")
    fmt.add_argument(
        "--npd",
        action="store_true",
        help="node-problem-detector plugin: exit 0 OK, 1 NonOK, 2 Unknown, within 4 s",
    )
    c.set_defaults(func=cmd_check)
    register_disarm(sub)
    register_end(sub)


def cmd_run(args: argparse.Namespace) -> int:
    # The agent's modules (and dnspython, http.client, ...) load when a command needs them, not
    # with the parser: every command builds the parser, `fetch` at boot included.
    from gce_watchdog.daemon import app

    return app.run(args.config, args.max_ticks)


def cmd_check(args: argparse.Namespace) -> int:
    """Exit 0: both paths up. 1: one path down or unknown (the ladder would reset). 2: both down
    (it would climb). 78: invalid config. With --npd: 0 OK, 1 NonOK, 2 Unknown (within 4 s)."""
    from gce_watchdog.daemon import app

    return app.check(args.config, args.json, args.npd)


def register_disarm(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "disarm",
        help="stop the watchdog from acting for a while (it still reports); always expires",
        description=(
            "Disarm the watchdog for a bounded time: the ladder still climbs and is reported, "
            "and at the threshold the agent writes 'disarmed: would shut down' instead of acting. "
            f"At most {MAX_DISARM_S / 3600:g}h; it re-arms by itself at expiry."
        ),
    )
    add_config_arg(d)
    d.add_argument(
        "--for",
        dest="duration",
        default=None,
        metavar="DURATION",
        help=f"how long, e.g. 30m, 2h (required unless --status; at most {MAX_DISARM_S / 3600:g}h)",
    )
    d.add_argument("--reason", default="", help="why (shown on the serial console)")
    d.add_argument("--status", action="store_true", help="print the local switch's state")
    d.set_defaults(func=cmd_disarm)
    a = sub.add_parser("arm", help="end a local disarm now")
    add_config_arg(a)
    a.set_defaults(func=cmd_arm)


def cmd_disarm(args: argparse.Namespace) -> int:
    from gce_watchdog.daemon import app

    return app.disarm(args.config, args.duration, args.reason, args.status)


def cmd_arm(args: argparse.Namespace) -> int:
    from gce_watchdog.daemon import app

    return app.arm(args.config)


def register_end(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser(
        "end",
        help="end the VM through the agent's one end-of-life chain (linger, action, power-off)",
        description=(
            "After the job's terminal line (exit, phase done, setup_failed) is written: hand the "
            "VM's ending to the agent, which writes an `end` line, lingers (so a poller reads the "
            "terminal line while the VM is RUNNING), runs agent.action (delete or stop through "
            "the Compute API, or poweroff) and powers off with escalation. When no agent takes "
            "it within --wait, this command runs the chain itself. Exit 0: handed to the agent "
            "(or ran here); 69: the chain ran here and the VM is still up at its end."
        ),
    )
    e.add_argument("--reason", required=True, choices=vocab.END_REASONS, help="why the VM ends")
    e.add_argument(
        "--linger",
        default=None,
        metavar="DURATION",
        help=(
            "keep the VM up this long after the terminal line (0 to 1h; default actions.linger, "
            "75s); an invalid value is reported and the default is used: an ending never fails"
        ),
    )
    e.add_argument(
        "--wait",
        default=None,
        metavar="DURATION",
        help="how long to wait for the agent to take the ending (default 2 x agent.interval + 10s)",
    )
    add_config_arg(e)
    e.set_defaults(func=cmd_end)


def cmd_end(args: argparse.Namespace) -> int:
    from gce_watchdog.daemon import app

    return app.end(args.config, args.reason, args.linger, args.wait)
