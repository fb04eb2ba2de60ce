"""Every command line the README shows parses with the real parser (issue 39 item 10, issue 34
item 6): a line in a code block (fenced, or indented four spaces) that starts with
``gce-watchdog `` or ``sudo gce-watchdog `` is split as a shell would (its ``# comment`` and
``sudo`` dropped, ``\\`` continuations joined) and handed to ``build_parser().parse_args``. Parse
only: nothing is run. (tests/integration/test_docs.py checks, across all docs, that each command
and each flag shown exists; this one checks that the whole line is accepted: values, choices,
positionals, flags that exclude each other.)
"""

from __future__ import annotations

import argparse
import io
import shlex
from contextlib import redirect_stderr
from pathlib import Path

import pytest
from gce_watchdog.cli import build_parser
from kit.paths import REPO

pytestmark = pytest.mark.pure

README = REPO / "README.md"


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a code block, continuations joined."""
    out: list[tuple[int, str]] = []
    fenced = False
    pending: tuple[int, str] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        indented = line.startswith("    ") and not line.lstrip().startswith(("-", "|", "*"))
        if not (fenced or indented):
            pending = None
            continue
        if pending is not None:
            n, line = pending[0], pending[1] + " " + line.strip()
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (n, line.rstrip()[:-1])
            continue
        out.append((n, line.strip()))
    return out


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv after the program name) of each ``[sudo] gce-watchdog ...`` line."""
    out = []
    for n, line in code_lines(text):
        if not line.startswith(("gce-watchdog ", "sudo gce-watchdog ")) and line not in (
            "gce-watchdog",
            "sudo gce-watchdog",
        ):
            continue
        argv = shlex.split(line, comments=True)
        if argv[0] == "sudo":
            argv = argv[1:]
        out.append((n, argv[1:]))
    return out


def parse_error(argv: list[str], parser: argparse.ArgumentParser) -> str | None:
    """None when ``argv`` parses; else what argparse said."""
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit as e:
        return err.getvalue().strip().splitlines()[-1] if e.code else None
    return None


def test_every_readme_command_line_parses() -> None:
    shown = commands(README.read_text())
    assert len(shown) >= 20  # the tour, the poller, bootstrap, faults: a broken scan finds few
    parser = build_parser()
    problems = []
    for n, argv in shown:
        why = parse_error(argv, parser)
        if why is not None:
            problems.append(f"README.md:{n}: gce-watchdog {shlex.join(argv)}: {why}")
    assert problems == [], "\n".join(problems)


def test_the_scan_reads_fences_indents_comments_sudo_and_continuations() -> None:
    text = (
        "text gce-watchdog run (prose, not code)\n"
        "```sh\n"
        "gce-watchdog check --json   # a comment\n"
        "sudo gce-watchdog fault status\n"
        "gce-watchdog poll --project P \\\n"
        "  --zone Z vm-1\n"
        "make demo\n"
        "```\n"
        "    gce-watchdog arm\n"
    )
    assert commands(text) == [
        (3, ["check", "--json"]),
        (4, ["fault", "status"]),
        (5, ["poll", "--project", "P", "--zone", "Z", "vm-1"]),
        (9, ["arm"]),
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--json", "--npd"],  # flags that exclude each other
        ["memwatch", "--interval", "soon", "--", "true"],  # a value the parser refuses
        ["phase", "lunch"],  # not a choice
        ["no-such-command"],
    ],
)
def test_a_line_that_would_fail_is_caught(argv: list[str]) -> None:
    assert parse_error(argv, build_parser()) is not None


def test_the_readme_is_where_the_test_reads_it() -> None:
    assert isinstance(README, Path) and README.is_file()
