"""Build-time generators for the CLI's man page and shell completion (``make cli-docs``).

Both come from the argparse definitions (``gce_watchdog.cli.build_parser``), so a renamed flag
changes them at the next build. The generators are dev/build dependencies (shtab,
argparse-manpage in the ``dev`` extra), never runtime ones. This script writes what those tools
cannot take from argparse: the EXIT STATUS section of every command (``cli.EXIT_CODES``), as an
argparse-manpage include file.

    python tools/cli_docs.py exit-status OUT.include
"""

from __future__ import annotations

import sys
from pathlib import Path

from gce_watchdog import cli


def _roff(text: str) -> str:
    """Escape for roff: backslashes, and a leading dot or quote that would start a request."""
    text = text.replace("\\", "\\e")
    return "\\&" + text if text[:1] in (".", "'") else text


def exit_status_include() -> str:
    """An argparse-manpage include file: one EXIT STATUS section, a table per command."""
    out = ["[EXIT STATUS]", "Usage errors exit 64 (EX_USAGE) in every command; each command:", ""]
    for path, codes in sorted(cli.EXIT_CODES.items()):
        name = " ".join(("gce-watchdog", *path))
        out.append(".TP")
        out.append(f"\\fB{_roff(name)}\\fR")
        out.extend(f"{_roff(code)}: {_roff(why)}\n.br" for code, why in codes)
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] != "exit-status":
        print("usage: python tools/cli_docs.py exit-status OUT.include", file=sys.stderr)
        return 64
    Path(argv[2]).write_text(exit_status_include())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
