"""The README and docs stand alone: every link resolves inside the repository."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kit.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target): the target up to a space or ')'; an optional "#anchor" is ignored.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _local_links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:", t)]


@pytest.mark.pure
def test_every_local_link_resolves_inside_the_repository() -> None:
    seen = 0
    for doc in DOCS:
        for target in _local_links(doc):
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            assert path.is_relative_to(REPO), f"{doc.name}: {target} points outside the repository"
            assert path.exists(), f"{doc.name}: {target} does not exist"
            seen += 1
    assert seen >= 30  # the README alone links every doc: a broken regex would find none


@pytest.mark.pure
def test_the_link_check_catches_an_outside_link(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("see [ctx](../shared/CONTEXT.md) and [web](https://example.com/a)\n")
    assert _local_links(doc) == ["../shared/CONTEXT.md"]


# -- every command shown in the README and docs exists, with every flag it shows ---------------

# `gce-watchdog WORD ...` in a code block or an inline code span (not gce-watchdog-workload etc.)
_SHOWN = re.compile(r"(?:^|[`\s$(])(gce-watchdog|python3? -m gce_watchdog)((?: [^`\n#|;&]*)?)")


def shown_commands() -> list[tuple[str, int, list[str]]]:
    """(file, line number, tokens after the program name) of every command the docs show."""
    out: list[tuple[str, int, list[str]]] = []
    for doc in DOCS:
        fenced = False
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            # an indented (4 spaces) code block counts as code too
            code = fenced or (line.startswith("    ") and not line.lstrip().startswith(("-", "|")))
            if code and line.lstrip().startswith("#"):
                continue  # a comment (or a Prometheus # HELP line), not a command
            spans = [line.split(" # ")[0]] if code else re.findall(r"`([^`]+)`", line)
            for span in spans:
                for m in _SHOWN.finditer(span):
                    tokens = m.group(2).split()
                    if tokens and re.fullmatch(r"[a-z][a-z-]*", tokens[0]):
                        out.append((doc.name, n, tokens))
    return out


def _resolve(tokens: list[str]) -> tuple[tuple[str, ...], Any, list[str]]:
    """The command path the tokens name, its parser, and the flags shown after it."""
    from gce_watchdog.cli import build_parser

    parser = build_parser()
    path: list[str] = []
    rest = list(tokens)
    while rest and parser._subparsers is not None:
        choices = next(
            a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        )
        if rest[0] not in choices:
            break
        path.append(rest.pop(0))
        parser = choices[path[-1]]
    flags: list[str] = []
    for tok in rest:
        if tok == "--":
            break  # exec's own command follows
        for part in re.split(r"[|\[\]]", tok):
            if part.startswith("--") and len(part) > 2:
                flags.append(part.split("=", 1)[0].rstrip(".,:"))
    return tuple(path), parser, flags


@pytest.mark.process
def test_every_command_in_the_docs_exists_with_every_flag_it_shows() -> None:
    shown = shown_commands()
    assert len(shown) >= 40  # the README's tour alone has a dozen
    seen: set[tuple[str, ...]] = set()
    problems = []
    for name, n, tokens in shown:
        path, parser, flags = _resolve(tokens)
        if not path:
            problems.append(f"{name}:{n}: no such command: gce-watchdog {' '.join(tokens)}")
            continue
        seen.add(path)
        known = {o for a in parser._actions for o in a.option_strings}
        problems += [
            f"{name}:{n}: gce-watchdog {' '.join(path)} has no {f}" for f in flags if f not in known
        ]
    assert problems == []
    # and each of them answers --help (the real CLI, exit 0, ending with its exit codes)
    for path in sorted(seen):
        r = subprocess.run(
            [sys.executable, "-m", "gce_watchdog", *path, "--help"],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert r.returncode == 0, (path, r.stderr)
        assert "\nexit status:\n" in r.stdout, path


@pytest.mark.pure
def test_the_docs_check_finds_a_renamed_flag() -> None:
    path, parser, flags = _resolve(["disarm", "--for", "2h", "--reason", "x"])
    assert path == ("disarm",) and flags == ["--for", "--reason"]
    known = {o for a in parser._actions for o in a.option_strings}
    assert "--for" in known and "--duration" not in known
    assert _resolve(["no-such", "--x"])[0] == ()
