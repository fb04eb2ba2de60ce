"""Running the gce-watchdog CLI as a real process, the way an operator or systemd does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from kit.paths import AGENT_SRC, REPO


def gcewd_argv(*args: str) -> list[str]:
    """``python -m gce_watchdog ARGS`` with this interpreter."""
    return [sys.executable, "-m", "gce_watchdog", *args]


def agent_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout's agent/ first on PYTHONPATH (what a child needs when
    the package is not installed), plus ``extra``."""
    return {**os.environ, "PYTHONPATH": str(AGENT_SRC), **extra}


def gcewd(
    *args: str,
    timeout: float = 60,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``gce-watchdog ARGS`` to its end; output captured as text; never raises on its rc."""
    return subprocess.run(
        gcewd_argv(*args),
        cwd=cwd,
        env=None if env is None else dict(env),
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def main_rc(argv: list[str]) -> int:
    """The root CLI run in this process: its exit status, whether it returned it or raised
    SystemExit (argparse's usage errors do)."""
    from gce_watchdog import cli

    try:
        return cli.main(argv)
    except SystemExit as e:
        return int(e.code or 0)
