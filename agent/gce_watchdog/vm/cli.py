"""Core subcommands: config check (more are added by the feature modules)."""

from __future__ import annotations

import argparse
import sys

from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.runtime import add_config_arg, load_config_or_exit


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    c = csub.add_parser("check", help="validate a config file and report every error")
    c.add_argument("path", nargs="?", default=None, help=f"default {cfgmod.DEFAULT_PATH}")
    c.set_defaults(func=cmd_config_check)
    s = csub.add_parser("show", help="print the effective configuration as TOML-like text")
    add_config_arg(s)
    s.set_defaults(func=cmd_config_show)


def cmd_config_check(args: argparse.Namespace) -> int:
    try:
        cfg = cfgmod.load(args.path)
    except cfgmod.InvalidConfig as e:
        print(str(e), file=sys.stderr)
        return cfgmod.EX_CONFIG
    src = args.path or (str(cfgmod.DEFAULT_PATH) + " (defaults if missing)")
    print(f"{src}: OK (digest {cfgmod.digest(cfg)})")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args)
    for section, values in cfgmod.to_dict(cfg).items():
        print(f"[{section}]")
        for k, v in values.items():
            print(f"{k} = {v!r}")
        print()
    return 0
