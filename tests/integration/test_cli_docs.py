"""Shell completion and the man page come from the argparse definitions (make cli-docs): the
real generators (shtab, argparse-manpage) run here, and the results are read back by real bash
and, where installed, man."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
    r = subprocess.run(
        ["make", "--no-print-directory", "cli-docs",
         f"CLI_DOCS={out}", f"VENV={BIN.parent}", "STAMP=pyproject.toml"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _complete(script: Path, *words: str) -> list[str]:
    """What bash offers after ``words`` (the last one is being typed)."""
    line = " ".join(words)
    prog = (
        f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
        f"COMP_LINE='{line}'; COMP_POINT=${{#COMP_LINE}}; "
        f"_shtab_gce_watchdog; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    r = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=30)
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
