"""The import rules (pyproject.toml, docs/architecture.md) hold, and each one can fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kit.paths import REPO

ROOT = REPO
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed"),
]


def _lint(package_parent: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_import_rules_hold() -> None:
    r = _lint(ROOT / "agent")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("daemon/ladder.py", "import time", "pure cores"),
        ("faults/plan.py", "import subprocess", "pure cores"),
        ("poller/verdict.py", "from gce_watchdog.vm import config", "central side"),
        ("vm/state.py", "from gce_watchdog.testing import synth", "testing kit"),
        ("wire/vocab.py", "from gce_watchdog.vm import state", "layers"),
        ("daemon/tick.py", "from gce_watchdog.daemon import service", "import cycles"),
        ("vm/runtime.py", "import argparse", "only the CLI modules import argparse"),
        ("poller/settings.py", "from gce_watchdog.poller import fleet", "settings parse"),
    ],
)
def test_a_violation_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    copy = tmp_path / "gce_watchdog"
    shutil.copytree(
        ROOT / "agent" / "gce_watchdog", copy, ignore=shutil.ignore_patterns("__pycache__")
    )
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}  # a violation\n")
    r = _lint(tmp_path)
    assert r.returncode != 0
    broken = [ln for ln in r.stdout.splitlines() if " BROKEN" in ln]
    assert any(contract in ln for ln in broken), r.stdout
