"""Shell completion and the man page come from the argparse definitions (make cli-docs): the
real generators (shtab, argparse-manpage) run here, and the results are read back by real bash
and, where installed, man."""

from __future__ import annotations

import ast
import datetime as dt
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from gce_watchdog import cli
from kit.paths import REPO

pytestmark = pytest.mark.process

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli-docs")
    # The venv running the tests is already set up: STAMP names a file with no rule, so make
    # runs only the generators, with this venv's tools.
    _make_cli_docs(out)
    return out


def _make_cli_docs(out: Path, *wrap: str) -> None:
    r = subprocess.run(
        [*wrap, "make", "--no-print-directory", "cli-docs",
         f"CLI_DOCS={out}", f"VENV={BIN.parent}", "STAMP=pyproject.toml"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def _cli_docs_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_docs", REPO / "tools" / "cli_docs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _complete(script: Path, *words: str, cwd: Path | None = None) -> list[str]:
    """What bash offers after ``words`` (the last one is being typed): the completion function
    called the way bash's programmable completion calls it (COMP_WORDS, COMP_CWORD)."""
    line = " ".join(words)
    prog = (
        f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
        f"COMP_LINE='{line}'; COMP_POINT=${{#COMP_LINE}}; "
        f"_shtab_gce_watchdog; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    r = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=30, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return sorted(r.stdout.split())


def test_bash_completion_offers_the_real_commands_and_flags(generated: Path) -> None:
    script = generated / "bash-completion" / "gce-watchdog"
    assert _complete(script, "gce-watchdog", "fa") == ["fault"]
    assert _complete(script, "gce-watchdog", "fault", "") == ["clear", "inject", "status"]
    assert "--npd" in _complete(script, "gce-watchdog", "check", "--")
    # every top-level command is offered
    top = _complete(script, "gce-watchdog", "")
    assert {"check", "config", "disarm", "fetch", "report", "run"} <= set(top)
    zsh = (generated / "zsh" / "_gce-watchdog").read_text()
    assert zsh.startswith("#compdef gce-watchdog") and "--npd" in zsh


def test_man_page_has_every_command_and_its_exit_status(generated: Path) -> None:
    page = (generated / "man1" / "gce-watchdog.1").read_text()
    assert page.startswith(".TH") or "\n.TH " in page
    assert ".SH EXIT STATUS" in page
    for path in cli.EXIT_CODES:
        if path:
            assert "gce-watchdog " + " ".join(path) in page, path
    assert "--npd" in page
    man = shutil.which("man")
    if man is not None:  # render it as a reader would (man-db reads a file with -l)
        r = subprocess.run(
            [man, "-l", str(generated / "man1" / "gce-watchdog.1")],
            capture_output=True, text=True, timeout=60,
            env={"MANWIDTH": "100", "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert r.returncode == 0 and "EXIT STATUS" in r.stdout, r.stderr


def test_man_page_has_files_environment_and_see_also(generated: Path) -> None:
    page = (generated / "man1" / "gce-watchdog.1").read_text()
    for sec in ("FILES", "ENVIRONMENT", "SEE ALSO"):
        assert f"\n.SH {sec}\n" in page, sec
    files = page.split("\n.SH FILES\n", 1)[1].split("\n.SH ", 1)[0]
    assert "/etc/gce-watchdog/config.toml" in files and "/opt/gce-watchdog" in files
    env = page.split("\n.SH ENVIRONMENT\n", 1)[1].split("\n.SH ", 1)[0]
    assert "GCEWD_CONFIG" in env
    assert "gce-watchdog.toml(5)" in page.split("\n.SH SEE ALSO\n", 1)[1]


def test_config_page_lists_every_key_with_its_default(generated: Path) -> None:
    """gce-watchdog.toml(5) comes from the config's dataclasses: a new key is on the page (with
    its meaning from docs/configuration.md, or the build fails)."""
    import dataclasses
    import typing

    from gce_watchdog.vm import config as cfgmod

    page = (generated / "man5" / "gce-watchdog.toml.5").read_text()
    assert page.startswith(".TH GCE-WATCHDOG.TOML 5 ")
    hints = typing.get_type_hints(cfgmod.Config)
    for sec in dataclasses.fields(cfgmod.Config):
        assert f'.SS "[{sec.name}]"' in page, sec.name
        for f in dataclasses.fields(hints[sec.name]):
            assert f"\n\\fB{f.name}\\fR = " in page, f"{sec.name}.{f.name}"
    assert '\\fBinterval\\fR = "30s"\ntime between ticks' in page
    man = shutil.which("man")
    if man is not None:
        r = subprocess.run([man, "-l", str(generated / "man5" / "gce-watchdog.toml.5")],
                           capture_output=True, text=True, timeout=60,
                           env={"MANWIDTH": "100", "PATH": "/usr/bin:/bin"})  # fmt: skip
        assert r.returncode == 0 and "threshold = 10" in r.stdout, r.stderr
        assert not r.stderr.strip(), r.stderr


def test_bash_completion_completes_files_where_an_argument_is_a_path(
    generated: Path, tmp_path: Path
) -> None:
    """Issue 39: every path argument completes from the files (a directory argument from the
    directories); other arguments do not; and the registration falls back to readline's file
    names (`-o default`) where the function offers nothing."""
    script = generated / "bash-completion" / "gce-watchdog"
    (tmp_path / "conf.toml").write_text("")
    (tmp_path / "cursors").mkdir()
    marked = _cli_docs_tool().mark_paths(cli.build_parser())
    # the ones the issue names, and then every one the rule finds
    for want in ("check --config: file", "poll --ledger: file", "poll --cursor-dir: dir",
                 "memwatch --out: file", "validate --out: dir", "report file: file"):  # fmt: skip
        assert want in marked, (want, marked)
    tried = 0
    for entry in marked:
        head, kind = entry.rsplit(": ", 1)
        *command, arg = head.split(" ")
        words = ["gce-watchdog", *command]
        if arg.startswith("-"):
            words.append(arg.split("/")[-1])
        # else a positional (config check's path, parse's and report's file): typed right
        # after the command
        got = _complete(script, *words, "c", cwd=tmp_path)
        tried += 1
        offered = ["cursors"] if kind == "dir" else ["conf.toml", "cursors"]
        assert got == offered, (entry, got)
    assert tried == len(marked) > 30
    assert _complete(script, "gce-watchdog", "poll", "--project", "c", cwd=tmp_path) == []
    assert (
        script.read_text()
        .rstrip()
        .endswith("complete -o bashdefault -o default -F _shtab_gce_watchdog gce-watchdog")
    )
    zsh = (generated / "zsh" / "_gce-watchdog").read_text()
    assert re.search(r"\"--config\[.*\]:PATH:_files\"", zsh), "zsh: --config completes files"


def _env_reads(root: Path) -> dict[str, list[str]]:
    """Every environment variable the code under ``root`` reads, with where: ``X.get(NAME)``,
    ``X[NAME]``, ``NAME in X`` on ``os.environ`` or an ``env``/``e`` mapping (the code passes
    the environment around under those names), ``os.getenv(NAME)``; NAME a literal or a
    module-level string constant."""
    envlike = re.compile(r"(^|\.)(environ|env|e)$")
    found: dict[str, list[str]] = {}
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text())
        consts = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)
            for t in n.targets
            if isinstance(t, ast.Name)
        }  # fmt: skip

        def name(node: ast.expr) -> str | None:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            return consts.get(node.id) if isinstance(node, ast.Name) else None

        for n in ast.walk(tree):
            got = None
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
                recv = ast.unparse(n.func.value)
                getter = n.func.attr in ("get", "pop", "setdefault") and envlike.search(recv)
                if getter or n.func.attr == "getenv":
                    got = name(n.args[0])
            elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load):
                got = name(n.slice) if envlike.search(ast.unparse(n.value)) else None
            elif isinstance(n, ast.Compare) and isinstance(n.ops[0], (ast.In, ast.NotIn)):
                got = name(n.left) if envlike.search(ast.unparse(n.comparators[0])) else None
            if got and re.fullmatch(r"[A-Z][A-Z0-9_]*", got):
                found.setdefault(got, []).append(f"{f.relative_to(root)}:{getattr(n, 'lineno', 0)}")
    return found


def test_man_page_lists_every_environment_variable_the_code_reads(generated: Path) -> None:
    page = (generated / "man1" / "gce-watchdog.1").read_text()
    env = page.split("\n.SH ENVIRONMENT\n", 1)[1].split("\n.SH ", 1)[0].replace("\\_", "_")
    listed = set(re.findall(r"\\fB([^\\]+)\\fR", env))
    listed = {v.strip() for item in listed for v in item.split(",")}
    reads = _env_reads(REPO / "agent" / "gce_watchdog")
    assert {"GCEWD_CONFIG", "NOTIFY_SOCKET", "GCE_WATCHDOG_LEDGER", "PGPASSFILE"} <= set(reads)
    missing = {k: v for k, v in reads.items() if k not in listed}
    assert not missing, f"read by the code, not in gce-watchdog(1)'s ENVIRONMENT: {missing}"


def test_man_page_lists_config_d_and_the_pollers_files(generated: Path) -> None:
    page = (generated / "man1" / "gce-watchdog.1").read_text()
    files = page.split("\n.SH FILES\n", 1)[1].split("\n.SH ", 1)[0].replace("\\-", "-")
    for want in ("/etc/gce-watchdog/config.d/*.toml",
                 "/usr/lib/systemd/system/gce-watchdog.service",
                 "/usr/lib/systemd/system/gce-watchdog-poller.service",
                 "/etc/gce-watchdog/poller.env", "/etc/gce-watchdog/poller.pgpass",
                 "/var/lib/gce-watchdog-poller/gce-watchdog/ledger.sqlite"):  # fmt: skip
        assert want in files, want


def test_man_page_date_is_the_changelogs_and_the_same_on_another_day(
    generated: Path, tmp_path: Path
) -> None:
    """Reproducible (issue 39): the page's date is the newest changelog entry's
    (SOURCE_DATE_EPOCH), not the build day; with faketime, a build on another day gives the
    same bytes for every generated file."""
    changes = tomllib.loads((REPO / "packaging" / "debian" / "changes.toml").read_text())
    when: dt.datetime = changes["release"][0]["date"]
    th = (generated / "man1" / "gce-watchdog.1").read_text().splitlines()[0]
    assert f'"{when.date().isoformat()}"'.replace("-", "\\-") in th, th
    faketime = shutil.which("faketime")
    if faketime is None:
        pytest.skip("faketime not installed (apt-get install faketime): the other-day build")
    other = tmp_path / "other-day"
    _make_cli_docs(other, faketime, "2031-06-15 12:00:00")
    for f in sorted(p.relative_to(generated) for p in generated.rglob("*") if p.is_file()):
        assert (other / f).read_bytes() == (generated / f).read_bytes(), f


def test_every_page_a_unit_documents_is_generated(generated: Path) -> None:
    """Documentation= of both shipped units names man pages that make cli-docs generates (and
    the .deb installs): systemd-analyze verify --man=no leaves that to this test."""
    units = [
        REPO / "systemd" / "gce-watchdog.service",
        REPO / "systemd" / "gce-watchdog-poller.service",
    ]
    for unit in units:
        docs = [ln.split("=", 1)[1] for ln in unit.read_text().splitlines()
                if ln.startswith("Documentation=")]  # fmt: skip
        pages = re.findall(r"man:([\w.-]+)\((\d)\)", " ".join(docs))
        assert ("gce-watchdog", "1") in pages, unit
        for name, section in pages:
            assert (generated / f"man{section}" / f"{name}.{section}").is_file(), (unit, name)
