"""Build-time generators for the CLI's man page and shell completion (``make cli-docs``).

Both come from the argparse definitions (``gce_watchdog.cli.build_parser``), so a renamed flag
changes them at the next build. The generators are dev/build dependencies (shtab,
argparse-manpage in the ``dev`` extra), never runtime ones. This script writes what those tools
cannot take from argparse: the EXIT STATUS section of every command (``cli.EXIT_CODES``), and
FILES, ENVIRONMENT and SEE ALSO, as an argparse-manpage include file; and the whole of
gce-watchdog.toml(5), the config file's page: every section and key with its type and default
from the config's own dataclasses (``vm.config``), each key's meaning from docs/configuration.md's
tables (a key without one fails the build).

    python tools/cli_docs.py exit-status OUT.include
    python tools/cli_docs.py config-man OUT.5
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

from gce_watchdog import __version__, cli
from gce_watchdog.vm import config as cfgmod

REPO = Path(__file__).resolve().parents[1]
CONFIG_DOC = REPO / "docs" / "configuration.md"


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


FILES = [
    (str(cfgmod.DEFAULT_PATH), "the agent's config (gce-watchdog.toml(5)); a conffile"),
    ("/opt/gce-watchdog", "the agent's private venv (the .deb, the wheelhouse, bake-image.sh)"),
    ("/lib/systemd/system/gce-watchdog.service", "the agent's systemd unit"),
    ("/var/lib/gce-watchdog", "state: ladder, DNS cache, line counter, phase (agent.state_dir)"),
    ("/run/gce-watchdog", "the single-agent lock (agent.run_dir)"),
    ("/usr/share/gce-watchdog/startup-script.sh", "the GCE start-up script the package ships"),
]
ENVIRONMENT = [
    (
        "GCEWD_CONFIG",
        f"the config file when --config is not given (default {cfgmod.DEFAULT_PATH}); "
        "the start-up script exports it to bootstrap steps",
    ),
    (
        "XDG_STATE_HOME",
        "poll: where the default ledger and cursors live ($XDG_STATE_HOME/gce-watchdog)",
    ),
    ("GCE_WATCHDOG_COMPUTE_API", "poll: the Compute API base URL (default Google's)"),
    ("NO_COLOR", "demo: no colour"),
]
SEE_ALSO = "gce-watchdog.toml(5), systemctl(1), journalctl(1), apt-get(8)"


def _section(title: str, items: list[tuple[str, str]]) -> list[str]:
    out = [f"[{title}]"]
    for name, what in items:
        out += [".TP", f"\\fB{_roff(name)}\\fR", _roff(what)]
    return out


def man_include() -> str:
    """EXIT STATUS, FILES, ENVIRONMENT and SEE ALSO for gce-watchdog(1)."""
    out = [exit_status_include().rstrip("\n")]
    out += _section("FILES", FILES)
    out += _section("ENVIRONMENT", ENVIRONMENT)
    out += ["[SEE ALSO]", _roff(SEE_ALSO)]
    return "\n".join(out) + "\n"


def _markdown_text(cell: str) -> str:
    cell = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", cell)  # [text](link) -> text
    return cell.replace("`", "").replace("\\|", "|").strip()


def config_meanings(doc: str) -> dict[tuple[str, str], str]:
    """(section, key) -> meaning, from docs/configuration.md's `## [section]` tables."""
    out: dict[tuple[str, str], str] = {}
    section = ""
    for line in doc.splitlines():
        m = re.match(r"#+ `\[([a-z_]+)\]`", line)
        if m:
            section = m[1]
            continue
        cells = [c for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if section and len(cells) >= 3 and cells[0].strip().startswith("`"):
            out[(section, cells[0].strip().strip("`"))] = _markdown_text(cells[2])
    return out


def config_man() -> str:
    """gce-watchdog.toml(5): the config file, every key with its type, default and meaning."""
    meanings = config_meanings(CONFIG_DOC.read_text())
    defaults = cfgmod.to_toml(cfgmod.Config())
    shown: dict[tuple[str, str], str] = {}
    section = ""
    for line in defaults.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif " = " in line:
            key, value = line.split(" = ", 1)
            shown[(section, key)] = value
    hints = typing.get_type_hints(cfgmod.Config)
    out = [
        f'.TH GCE-WATCHDOG.TOML 5 "" "gce-watchdog {__version__}" "gce-watchdog manual"',
        ".SH NAME",
        "gce-watchdog.toml \\- configuration file of the gce-watchdog agent",
        ".SH SYNOPSIS",
        f"\\fI{cfgmod.DEFAULT_PATH}\\fR",
        ".SH DESCRIPTION",
        "TOML. Every key has a default, so the agent runs with no file at all; a missing default "
        "file means all defaults, a missing file named with \\fB--config\\fR is an error. "
        "Durations are seconds (30, 1.5) or strings with units, largest first "
        '("500ms", "30s", "10m", "1h30m"). '
        "\\fBgce-watchdog config check\\fR lists every error of a file at once (exit 78); "
        "\\fBgce-watchdog run\\fR refuses an invalid file the same way; "
        "\\fBgce-watchdog config show\\fR prints the effective values in this format.",
    ]
    missing = []
    for sec in dataclasses.fields(cfgmod.Config):
        out.append(f'.SS "[{sec.name}]"')
        for f in dataclasses.fields(hints[sec.name]):
            what = meanings.get((sec.name, f.name))
            if what is None:
                missing.append(f"{sec.name}.{f.name}")
                continue
            default = shown.get((sec.name, f.name), "")
            out += [".TP", f"\\fB{_roff(f.name)}\\fR = {_roff(default)}", _roff(what)]
    if missing:
        raise SystemExit(f"cli_docs.py: no meaning in {CONFIG_DOC.name} for: {', '.join(missing)}")
    out += [
        ".SH FILES",
        ".TP",
        f"\\fI{cfgmod.DEFAULT_PATH}\\fR",
        "the default path; a conffile of the Debian package (kept on remove and upgrade)",
        ".SH ENVIRONMENT",
        ".TP",
        "\\fBGCEWD_CONFIG\\fR",
        "the file to read when no --config is given",
        ".SH SEE ALSO",
        "gce-watchdog(1); docs/configuration.md in the source tree",
    ]
    return "\n".join(out) + "\n"


USAGE = "usage: python tools/cli_docs.py exit-status|config-man OUT"


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("exit-status", "config-man"):
        print(USAGE, file=sys.stderr)
        return 64
    Path(argv[2]).write_text(man_include() if argv[1] == "exit-status" else config_man())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
