"""Core subcommands: config check (more are added by the feature modules)."""

from __future__ import annotations

import argparse
import os
import sys

from gce_watchdog.lib.cli import EX_CONFIG, EX_OK, EX_USAGE
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.runtime import load_config_or_exit


def add_config_arg(p: argparse.ArgumentParser) -> None:
    # GCEWD_CONFIG (what the start-up script exports to bootstrap steps) is the default, so a step
    # that runs `gce-watchdog fetch` writes to the console and state dir it was configured for.
    p.add_argument(
        "--config",
        metavar="PATH",
        default=os.environ.get("GCEWD_CONFIG") or None,
        help=(
            f"config file (default $GCEWD_CONFIG, else {cfgmod.DEFAULT_PATH}; "
            "missing default file = all defaults)"
        ),
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    c = csub.add_parser("check", help="validate a config file and report every error")
    add_config_arg(c)
    c.add_argument(
        "path", nargs="?", default=None, metavar="PATH", help="the same as --config PATH"
    )
    c.set_defaults(func=cmd_config_check)
    s = csub.add_parser(
        "show",
        help="print the effective configuration as TOML",
        description="Print every key's effective value as TOML that `config check` accepts and "
        "that loads back to the same values (durations as '30s', '1h30m').",
    )
    add_config_arg(s)
    s.set_defaults(func=cmd_config_show)


def cmd_config_check(args: argparse.Namespace) -> int:
    if args.path and args.config and args.path != args.config:
        print(
            f"gce-watchdog config check: two paths: --config {args.config} and {args.path}",
            file=sys.stderr,
        )
        return EX_USAGE
    path = args.path or args.config
    try:
        cfg = cfgmod.load(path)
    except cfgmod.InvalidConfig as e:
        print(str(e), file=sys.stderr)
        return EX_CONFIG
    src = path or (str(cfgmod.DEFAULT_PATH) + " (defaults if missing)")
    print(f"{src}: OK (digest {cfgmod.digest(cfg)})")
    return EX_OK


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args.config)
    sys.stdout.write(cfgmod.to_toml(cfg))
    return EX_OK
