"""``make install-cli`` puts ``gce-watchdog`` on PATH for this checkout (README, "Set up"): a link
to the venv's console script, which then runs as typed; a file that is not a link is left alone.
Uses a link path under tmp (CLI_LINK), never /usr/local/bin, and never rebuilds the venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kit.paths import REPO

SCRIPT = Path(sys.executable).with_name("gce-watchdog")
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="install-cli links only as root"),
    pytest.mark.skipif(shutil.which("make") is None, reason="no make"),
    pytest.mark.skipif(
        SCRIPT.resolve() != (REPO / ".venv" / "bin" / "gce-watchdog").resolve(),
        reason="not run from this checkout's .venv (make venv)",
    ),
]


def install_cli(link: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed-dev", "install-cli",
         f"CLI_LINK={link}"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.process
def test_install_cli_links_the_venv_script_and_it_runs_as_typed(tmp_path: Path) -> None:
    link = tmp_path / "bin" / "gce-watchdog"
    link.parent.mkdir()
    r = install_cli(link)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and link.resolve() == SCRIPT.resolve()
    env = {**os.environ, "PATH": f"{link.parent}:/usr/bin:/bin"}
    v = subprocess.run(
        ["gce-watchdog", "--version"], env=env, capture_output=True, text=True, timeout=60
    )
    assert v.returncode == 0 and v.stdout.startswith("gce-watchdog "), v.stderr
    assert install_cli(link).returncode == 0  # again: idempotent


@pytest.mark.process
def test_install_cli_leaves_a_file_that_is_not_a_link(tmp_path: Path) -> None:
    other = tmp_path / "gce-watchdog"
    other.write_text("#!/bin/sh\necho a packaged one\n")
    r = install_cli(other)
    assert r.returncode != 0 and "left alone" in r.stderr
    assert not other.is_symlink() and "packaged" in other.read_text()
