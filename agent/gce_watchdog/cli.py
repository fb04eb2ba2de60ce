"""Command-line entry point: ``gce-watchdog <command>``.

Each feature module contributes its subcommands through a ``register(subparsers)`` function listed
in :data:`MODULES`. Modules must stay cheap to import (no google-auth, no dnspython at import
time): the agent's start-up time is a measured target. A command line that starts with a known
command registers only that command's module (:data:`COMMAND_MODULES`): ``run`` does not load the
parsers, and the imports, of the poller, the bootstrap helpers or the validator, which the
daemon's memory target (docs/performance.md, "The RSS target") has no room for.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from gce_watchdog import __version__
from gce_watchdog.lib.cli import EX_SIGPIPE, EX_USAGE, CommandError, Parser, all_parsers

# Feature modules that add subcommands. Each has `register(sub: argparse._SubParsersAction)`,
# and each parser it adds sets `func=handler(args) -> int`.
MODULES: tuple[str, ...] = (
    "gce_watchdog.vm.cli",
    "gce_watchdog.daemon.cli",
    "gce_watchdog.faults.cli",
    "gce_watchdog.bootstrap.cli",
    "gce_watchdog.poller.cli",
    "gce_watchdog.poller.ledger_cli",
    "gce_watchdog.memory.cli",
    "gce_watchdog.report.cli",
    "gce_watchdog.validate.cli",
)
# The module that registers each command. `main` imports only this one when the command line
# starts with the command; anything else (no command, --help or --version first, an unknown
# name) gets every module. tests/unit/test_cli_modules.py checks it against the full parser.
COMMAND_MODULES: dict[str, str] = {
    **dict.fromkeys(("config", "key"), "gce_watchdog.vm.cli"),
    **dict.fromkeys(("run", "check", "disarm", "arm", "end"), "gce_watchdog.daemon.cli"),
    "fault": "gce_watchdog.faults.cli",
    **dict.fromkeys(
        ("fetch", "phase", "setup-failed", "exec", "result", "progress", "install", "uninstall"),
        "gce_watchdog.bootstrap.cli",
    ),
    **dict.fromkeys(("poll", "parse"), "gce_watchdog.poller.cli"),
    **dict.fromkeys(("decisions", "pin"), "gce_watchdog.poller.ledger_cli"),
    "memwatch": "gce_watchdog.memory.cli",
    "report": "gce_watchdog.report.cli",
    "validate": "gce_watchdog.validate.cli",
}


_USAGE = ("64", "usage error: unknown option, bad value or missing argument")
_CONFIG = ("78", "the --config file is invalid (every error is listed)")
_GROUP = (("64", "usage error: no ACTION, or an unknown one"),)
# Every command's exit statuses, printed at the end of its --help and in the man page. A test
# checks every command has its entry (a new command without one fails the build).
EXIT_CODES: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {
    (): (
        ("0", "the command's own success"),
        ("64", "usage error: no COMMAND, or an unknown one"),
        ("141", "the reader of the output went away (`| head`): quiet, like a shell tool"),
    ),
    ("config",): _GROUP,
    ("config", "check"): (("0", "the config is valid"), _USAGE, _CONFIG),
    ("config", "show"): (("0", "printed (TOML that `config check` accepts)"), _USAGE, _CONFIG),
    ("run",): (
        ("0", "stopped by SIGTERM/SIGINT or --max-ticks"),
        _USAGE,
        ("75", "another agent holds the lock (EX_TEMPFAIL)"),
        _CONFIG,
    ),
    # With --npd the codes are node-problem-detector's (0 OK, 1 NonOK, 2 Unknown), answered
    # within 4 s; tests/integration/test_check_npd.py checks these rows against the behaviour.
    ("check",): (
        ("0", "both paths up; --npd: OK (both paths up, or one path down or unknown)"),
        (
            "1",
            "one path down or unknown: the ladder would reset, not climb; --npd: NonOK (both "
            "paths down, the ladder would climb)",
        ),
        (
            "2",
            "both paths down: the ladder would climb; --npd: Unknown (the check could not run: "
            "an invalid config, an unexpected error)",
        ),
        _USAGE,
        ("78", "the --config file is invalid (every error is listed); --npd: 2, Unknown"),
    ),
    ("disarm",): (
        ("0", "disarmed, or --status printed"),
        ("1", "the disarm file cannot be written"),
        ("64", "usage error: no --for, a bad duration, or more than 24h"),
        _CONFIG,
    ),
    ("arm",): (("0", "armed"), ("1", "the disarm file cannot be removed"), _USAGE, _CONFIG),
    ("fault",): _GROUP,
    **{
        ("fault", action): (
            ("0", "done (clear: also when nothing was installed)"),
            ("1", "an iptables command failed; what was installed was rolled back"),
            _USAGE,
            ("69", "iptables is not installed"),
            ("74", "done, but its serial line could not be written"),
            ("77", "not root: iptables needs CAP_NET_ADMIN"),
            _CONFIG,
        )
        for action in ("inject", "status", "clear")
    },
    ("fetch",): (
        ("0", "downloaded, verified, renamed into place"),
        _USAGE,
        ("65", "the --sha256 did not match; nothing was written"),
        ("69", "refused: HTTP 4xx (not 408/429), a redirect loop, https->http, bad TLS"),
        ("73", "the output file cannot be written"),
        ("75", "gave up at the deadline (the message says after how many attempts)"),
        _CONFIG,
        ("130, 143", "fetch itself got SIGINT / SIGTERM (no .part left)"),
    ),
    ("phase",): (
        ("0", "the line was written"),
        _USAGE,
        ("74", "the line could not be written"),
        _CONFIG,
    ),
    ("setup-failed",): (
        ("0", "the line was written"),
        ("64", "usage error: missing or empty --step/--reason"),
        ("74", "the line could not be written"),
        _CONFIG,
    ),
    ("end",): (
        ("0", "handed to the agent (its chain lingers, acts and powers off)"),
        _USAGE,
        ("69", "no agent took it: the chain ran here and the VM is still up at its end"),
        _CONFIG,
    ),
    ("result",): (
        ("0", "the line was written"),
        _USAGE,
        ("74", "the line could not be written"),
        _CONFIG,
    ),
    ("progress",): (
        ("0", "reported (a step not after the latest one is not progress: a note on stderr)"),
        _USAGE,
        ("69", "no agent is listening on the progress socket"),
        ("77", "refused: the caller is not in the job's process tree nor [job] progress_uid"),
        _CONFIG,
    ),
    ("exec",): (
        ("N", "the command's own exit status"),
        ("128+N", "the command was killed by signal N"),
        _USAGE,
        _CONFIG,
        ("126", "the command cannot be executed"),
        ("127", "the command does not exist"),
    ),
    ("poll",): (
        ("0", "every instance was read and decided (whatever the verdicts)"),
        ("64", "usage error: bad option, instance name or duration"),
        ("69", "at least one instance could not be read; the rest were reported"),
        ("74", "the ledger or cursor directory cannot be opened or written"),
        ("75", "a decision's --on-failover/--publish delivery failed; the next poll retries it"),
        ("77", "no credentials, or the API rejected them"),
        (
            "78",
            "a library the options need is not installed: psycopg (a postgresql:// ledger), "
            "google-cloud-pubsub (--pubsub, --publish)",
        ),
    ),
    ("decisions",): (
        ("0", "listed (or followed until SIGTERM), or released"),
        ("64", "usage error; release: an ID that is not held"),
        ("74", "the ledger cannot be opened or read"),
    ),
    ("key",): (
        ("0", "printed the fingerprint (--rotate: rotated, the new key's fingerprint printed)"),
        ("1", "printed, but the key is ephemeral (not kept in the state dir): do not pin it"),
        _USAGE,
        ("69", "--rotate: refused, nothing changed (no durable key, instance id not known yet)"),
        ("74", "--rotate: the rekey line was not confirmed on the console: the old key kept"),
        ("77", "not root: the key is root's alone"),
        _CONFIG,
    ),
    ("pin",): (
        ("0", "pinned (or already pinned with that fingerprint: nothing changed)"),
        ("1", "refused: the instance has a pin of another fingerprint (both printed); --replace"),
        (
            "64",
            "usage error: not PROJECT/ZONE/NAME or an id (an id needs --project), not a "
            "fingerprint",
        ),
        ("66", "no ledger at that path (--create makes one)"),
        ("69", "the Compute API has no such instance (in the projects asked)"),
        ("74", "the ledger cannot be opened or written"),
        ("75", "the Compute API could not say whether the instance exists; nothing changed"),
        ("77", "no credentials, or the API rejected them"),
    ),
    ("parse",): (
        ("0", "parsed"),
        ("64", "usage error: bad --now or --drain-timeout"),
        ("65", "the input is over 1 GiB (stopped there)"),
        ("66", "the input cannot be read, or is not a regular file or a pipe (/dev/zero)"),
    ),
    ("memwatch",): (
        ("0", "PASS: every gated gauge stayed in the band"),
        ("1", "FAIL: a climb, a step or out of the band"),
        ("3", "NOT ENOUGH DATA"),
        ("N", "COMMAND FAILED: the command exited N (non-zero), never PASS"),
        _USAGE,
        ("127", "the command could not be started"),
    ),
    ("report",): (
        ("0", "the report was written, whatever the verdict"),
        ("64", "usage error: bad --now, --drain-timeout or --band"),
        ("66", "the input cannot be read"),
        ("69", "--png without matplotlib (the message says what to install)"),
        ("73", "an output file cannot be written"),
    ),
    ("install",): (
        ("0", "installed (and started unless --no-start)"),
        ("1", "a file or systemctl step failed (the message says which)"),
        _USAGE,
        ("78", "the existing config is invalid: fix it, then run install again"),
    ),
    ("uninstall",): (("0", "removed"), ("1", "a file or systemctl step failed"), _USAGE),
    ("validate",): (
        ("0", "every scenario met its expectation (--plan: printed; --cleanup: nothing left)"),
        ("1", "a scenario failed, the run was interrupted, or --cleanup left a VM"),
        ("64", "usage error, or a real run without --yes (the plan is printed)"),
        ("69", "the Compute API failed (--cleanup)"),
        ("77", "no credentials, or the API rejected them"),
    ),
}


def build_parser(modules: Sequence[str] = MODULES) -> argparse.ArgumentParser:
    """The parser with the commands of ``modules`` (default: every command)."""
    p = Parser(
        prog="gce-watchdog",
        description="VM-side watchdog agent and bootstrap toolkit for Google Compute Engine.",
    )
    p.add_argument("--version", action="version", version=f"gce-watchdog {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in modules:
        importlib.import_module(name).register(sub)
    for path, parser in all_parsers(p):
        if isinstance(parser, Parser):
            parser.exit_codes = EXIT_CODES.get(path, ())
    return p


def modules_for(argv: Sequence[str]) -> tuple[str, ...]:
    """The modules a command line needs: its command's own when it starts with a known command
    (the root parser has no option that takes a value, so the first word is the command), else
    every module (the root's --help lists every command)."""
    if argv and argv[0] in COMMAND_MODULES:
        return (COMMAND_MODULES[argv[0]],)
    return MODULES


def _run(argv: Sequence[str] | None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(modules_for(words))
    args = parser.parse_args(words)
    if not getattr(args, "func", None):  # a group without its action: the root's whole help
        build_parser().print_help(sys.stderr)
        return EX_USAGE
    try:
        rc: int = args.func(args)
    except CommandError as e:  # the one place a command's failure becomes its exit status
        if e.message is not None:
            print(e.message, file=sys.stderr)
        rc = e.status
    sys.stdout.flush()  # a closed pipe shows here, inside the handler below
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:
        # The reader went away (`config show | head`): no traceback. Point stdout at /dev/null so
        # the interpreter's own flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EX_SIGPIPE
