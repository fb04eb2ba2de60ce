"""The one CLI contract every command follows (docs/cli.md).

- A usage error (unknown option, bad value, missing argument) exits 64, ``EX_USAGE`` in
  sysexits.h, in every command: :class:`Parser` is the root parser's class, and argparse makes
  every subcommand's parser of the same class.
- Every ``--help`` ends with the command's exit codes (:attr:`Parser.exit_codes`).
- A command that fails raises :class:`CommandError` (its exit status and its message); the one
  place that maps it to the exit status and prints the message is ``gce_watchdog.cli.main``. A
  command returns only its answer: ``EX_OK``, or a verdict it was asked for (``EX_FAIL``: the
  check ran and failed).
- Durations and sizes are read by one parser each (:mod:`gce_watchdog.lib.durations`,
  :mod:`gce_watchdog.lib.sizes`); :func:`duration_arg` and :func:`size_arg` are their argparse
  types.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.lib.sizes import parse_size

# The one table of exit codes (sysexits.h where it has a name, the shell's conventions otherwise).
# Every module takes its codes from here; every --help lists the ones its command can return.
EX_OK = 0
EX_FAIL = 1  # the command ran and its check failed (a verdict, a FAIL, a refused rule)
EX_USAGE = 64  # sysexits.h: the command was used incorrectly
EX_DATAERR = 65  # sysexits.h: the data was wrong (a checksum mismatch, an unreadable record)
EX_NOINPUT = 66  # sysexits.h: an input file does not exist or cannot be read
EX_UNAVAILABLE = 69  # sysexits.h: a service or tool is unavailable (an API 404, iptables missing)
EX_CANTCREAT = 73  # sysexits.h: an output file cannot be created
EX_IOERR = 74  # sysexits.h: an I/O error (the serial line could not be written)
EX_TEMPFAIL = 75  # sysexits.h: a temporary failure, try again later (a lock held, a deadline)
EX_NOPERM = 77  # sysexits.h: not permitted (not root, a scope missing)
EX_CONFIG = 78  # sysexits.h: a configuration error
EX_NOEXEC = 126  # shell convention: found but cannot be executed
EX_NOTFOUND = 127  # shell convention: command not found
EX_SIGPIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


class CommandError(Exception):
    """A command failed: exit with ``status``, after ``message`` on stderr (nothing when None).
    Raised anywhere under a command's handler; ``gce_watchdog.cli.main`` maps it."""

    def __init__(self, status: int, message: str | None = None) -> None:
        super().__init__(message or "")
        self.status = status
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse with exit 64 on a usage error and the exit codes at the end of ``--help``."""

    exit_codes: Sequence[tuple[str, str]] = ()

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        text = super().format_help().rstrip("\n") + "\n"
        if self.exit_codes:
            text += "\n" + format_exit_codes(self.exit_codes)
        return text


def format_exit_codes(codes: Sequence[tuple[str, str]]) -> str:
    width = max(len(c) for c, _ in codes)
    return "exit status:\n" + "".join(f"  {c:<{width}}  {why}\n" for c, why in codes)


def duration_arg(minimum: float = 0.0, open_min: bool = True) -> Callable[[str], float]:
    """An argparse type: seconds from ``30``, ``30s``, ``1h30m``, ``500ms``; above ``minimum``
    (or at it, with ``open_min=False``)."""

    def parse(text: str) -> float:
        try:
            v = parse_duration(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if v < minimum or (open_min and v == minimum):
            op = ">" if open_min else ">="
            raise argparse.ArgumentTypeError(f"must be {op} {minimum:g}s, got {text!r}")
        return v

    parse.__name__ = "duration"  # argparse names the type in "invalid duration value"
    return parse


def size_arg(text: str) -> int:
    """An argparse type: bytes from a size with a unit (``512MiB``, ``1GiB``, ``2GB``), > 0."""
    try:
        v = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def all_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser under ``parser`` with its command path, the root first, depth first."""
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.extend(all_parsers(sub, (*path, name)))
    return out
