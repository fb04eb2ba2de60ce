"""Command-line entry point: ``gce-watchdog <command>``.

Each feature module contributes its subcommands through a ``register(subparsers)`` function listed
in :data:`MODULES`. Modules must stay cheap to import (no google-auth, no dnspython at import
time): the agent's start-up time is a measured target.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gce_watchdog import __version__

# Feature modules that add subcommands. Each has `register(sub: argparse._SubParsersAction)`,
# and each parser it adds sets `func=handler(args) -> int`.
MODULES: tuple[str, ...] = (
    "gce_watchdog.vm.cli",
    "gce_watchdog.daemon.cli",
    "gce_watchdog.faults.cli",
    "gce_watchdog.bootstrap.cli",
    "gce_watchdog.poller.cli",
    "gce_watchdog.memory.cli",
    "gce_watchdog.report.cli",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gce-watchdog",
        description="VM-side watchdog agent and bootstrap toolkit for Google Compute Engine.",
    )
    p.add_argument("--version", action="version", version=f"gce-watchdog {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    rc: int = args.func(args)
    return rc
