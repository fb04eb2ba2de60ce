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
    python tools/cli_docs.py bash-completion|zsh-completion OUT

The man pages' date is $SOURCE_DATE_EPOCH (argparse-manpage reads it; `make cli-docs` sets it
from the newest entry of packaging/debian/changes.toml, the package's debian/changelog), so a
build on another day gives the same bytes.
"""

from __future__ import annotations

import argparse
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


UNIT_DIR = "/usr/lib/systemd/system"
FILES = [
    (str(cfgmod.DEFAULT_PATH), "the agent's config (gce-watchdog.toml(5)); a conffile"),
    (
        f"{cfgmod.DEFAULT_PATH.parent}/{cfgmod.DROPIN_DIR}/*{cfgmod.DROPIN_SUFFIX}",
        "drop-ins, read after the config file in byte order and merged into it (the start-up "
        "script writes 50-metadata.toml from the instance's metadata); `config show` says "
        "where each value came from",
    ),
    ("/opt/gce-watchdog", "the agent's private venv (the .deb, the wheelhouse, bake-image.sh)"),
    (f"{UNIT_DIR}/gce-watchdog.service", "the agent's systemd unit"),
    ("/var/lib/gce-watchdog", "state: ladder, DNS cache, line key, phase (agent.state_dir)"),
    ("/run/gce-watchdog", "the single-agent lock and the boot's line counter (agent.run_dir)"),
    ("/var/log/gce-watchdog", "the serial fallback file"),
    ("/usr/share/gce-watchdog/startup-script.sh", "the GCE start-up script the package ships"),
    (
        f"{UNIT_DIR}/gce-watchdog-poller.service",
        "the poller's unit (the gce-watchdog-poller package): runs `poll --json $POLLER_ARGS`",
    ),
    ("/etc/gce-watchdog/poller.env", "the poller unit's POLLER_ARGS (the administrator's)"),
    (
        "/etc/gce-watchdog/poller.token, /etc/gce-watchdog/poller.pgpass",
        "the poller unit's credentials (root, 0600): a Compute API bearer token and a libpq "
        "password file; systemd passes them in $CREDENTIALS_DIRECTORY",
    ),
    (
        "/var/lib/gce-watchdog-poller/gce-watchdog/ledger.sqlite, .../cursors/",
        "the poller unit's SQLite ledger and per-instance cursors ($XDG_STATE_HOME/gce-watchdog; "
        "/var/lib/private/gce-watchdog-poller under DynamicUser=); outside the unit "
        "~/.local/state/gce-watchdog/",
    ),
]
# Every variable the code reads (tests/integration/test_cli_docs.py fails on one missing here).
ENVIRONMENT = [
    (
        "GCEWD_CONFIG",
        f"the config file when --config is not given (default {cfgmod.DEFAULT_PATH}); "
        "the start-up script exports it to bootstrap steps",
    ),
    ("GCEWD_ROOT", "install, uninstall: the target root when --root is not given (default /)"),
    ("GCEWD_RESULT_RUN", "result: the run token `exec` gives the job it starts (set by exec)"),
    ("GCEWD_AGENT", "the job's `result`: the gce-watchdog executable to run (set by exec)"),
    ("GCEWD_PROGRESS", "progress: the agent's progress socket (set by exec for the job it starts)"),
    (
        "GCE_WATCHDOG_NOTICE",
        "set by exec for the job: the planned-stop notice file (docs/bootstrap.md, Notices)",
    ),
    ("GCEWD_JOURNAL_SOCKET", "run: journald's native socket (default /run/systemd/journal/socket)"),
    ("JOURNAL_STREAM", "run: set by systemd; the log then carries journal priorities and fields"),
    (
        "NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID",
        "run, poll: set by systemd (Type=notify, WatchdogSec=): READY=1 and watchdog pings",
    ),
    (
        "XDG_STATE_HOME",
        "poll, decisions, pin: where the default ledger and cursors live "
        "($XDG_STATE_HOME/gce-watchdog, default ~/.local/state)",
    ),
    ("GCE_WATCHDOG_LEDGER", "poll: the ledger when --ledger is not given"),
    ("GCE_WATCHDOG_COMPUTE_API", "poll: the Compute API base URL (default Google's)"),
    (
        "GCE_WATCHDOG_SHARED_LEDGER",
        "poll: `required` refuses a ledger that is not postgresql:// (exit 64; the container)",
    ),
    ("PORT", "poll: the --health-port default (Cloud Run sets it)"),
    (
        "CREDENTIALS_DIRECTORY",
        "poll: set by systemd (LoadCredential=): its `token` is the Compute API token, its "
        "`pgpass` the PostgreSQL password file",
    ),
    ("PGPASSFILE", "poll: libpq's password file (default the `pgpass` credential)"),
    (
        "REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE",
        "poll, validate: CA certificates for the Compute API (as requests reads them)",
    ),
    ("GCE_WATCHDOG_SERIAL_CORPUS", "tests and the demo: a directory of recorded serial logs"),
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


# Shell completion. shtab completes an option's value from the files only when the action says
# so (its `complete` attribute, shtab.FILE / shtab.DIRECTORY): without it a path gets nothing
# (issue 39). Which arguments are paths: their metavar, else their dest.
PATH_METAVARS = {"PATH", "FILE", "FILE|-", "OUT.png", "OUT.html", "SERIAL_LOG"}
DIR_METAVARS = {"DIR"}
PATH_DESTS = {"ledger", "access_token_file", "startup_script", "iptables", "ip6tables", "config"}
DIR_DESTS = {"cursor_dir", "peer_cursor_dir", "out_dir", "root"}
# shtab.FILE and shtab.DIRECTORY, spelt out (shtab is imported only to generate).
FILES_COMPLETE = {"bash": "_shtab_compgen_files", "zsh": "_files", "tcsh": "f"}
DIRS_COMPLETE = {"bash": "_shtab_compgen_dirs", "zsh": "_files -/", "tcsh": "d"}


def path_kind(action: argparse.Action, command: tuple[str, ...]) -> str | None:
    """The kind, "file", "dir" or None: what an argument's value completes from."""
    if action.nargs == 0 or action.help == argparse.SUPPRESS:
        return None
    if action.metavar in DIR_METAVARS or action.dest in DIR_DESTS:
        return "dir"
    if command == ("validate",) and action.dest == "out":
        return "dir"  # the output folder
    if action.metavar in PATH_METAVARS or action.dest in PATH_DESTS:
        return "file"
    return None


def mark_paths(parser: argparse.ArgumentParser, command: tuple[str, ...] = ()) -> list[str]:
    """Set shtab's ``complete`` on every path argument of ``parser`` and its subcommands; the
    arguments marked, as ``"COMMAND --option: kind"``."""
    marked = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                marked += mark_paths(sub, (*command, name))
            continue
        kind = path_kind(action, command)
        if kind is not None:
            action.complete = FILES_COMPLETE if kind == "file" else DIRS_COMPLETE  # type: ignore[attr-defined]
            what = "/".join(action.option_strings) or action.dest
            marked.append(f"{' '.join(command)} {what}: {kind}")
    return marked


def completion(shell: str) -> str:
    import shtab  # the dev extra: a build-time tool

    parser = cli.build_parser()
    mark_paths(parser)
    script: str = shtab.complete(parser, shell=shell)
    if shell == "bash":
        # -o default: where the function offers nothing (a path typed before its option is
        # known, a value after --), readline's file-name completion, not bash's "bashdefault"
        # words alone.
        script = script.replace(
            "complete -o bashdefault -F _shtab_gce_watchdog gce-watchdog",
            "complete -o bashdefault -o default -F _shtab_gce_watchdog gce-watchdog",
        )
    return script


COMMANDS: dict[str, typing.Callable[[], str]] = {
    "exit-status": man_include,
    "config-man": config_man,
    "bash-completion": lambda: completion("bash"),
    "zsh-completion": lambda: completion("zsh"),
}
USAGE = f"usage: python tools/cli_docs.py {'|'.join(COMMANDS)} OUT"


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 64
    Path(argv[2]).write_text(COMMANDS[argv[1]]())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
