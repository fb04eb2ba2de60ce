"""The poller's command line against the fake Compute API, and its JSON lines by instance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.testing.simcompute import FakeComputeAPI

P, Z = "test-project", "us-central1-a"


def poll_args(api: FakeComputeAPI, tmp_path: Path, *extra: str) -> list[str]:
    """``poll --project P --zone Z`` on ``api`` with a token file, a ledger and cursors under
    ``tmp_path``, JSON out; ``extra`` last (names, --once, flags)."""
    tok = tmp_path / "token"
    if not tok.exists():
        tok.write_text("tok\n")
    return [
        "poll",
        "--project",
        P,
        "--zone",
        Z,
        "--api-base",
        api.base_url,
        "--access-token-file",
        str(tok),
        "--ledger",
        str(tmp_path / "ledger.sqlite"),
        "--cursor-dir",
        str(tmp_path / "cursors"),
        "--json",
        *extra,
    ]


def outputs(capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, object]]:
    """The JSON lines printed since the last read, by instance name."""
    return {d["instance"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}


def parse_json(data: bytes, *args: str) -> dict[str, Any]:
    """``gce-watchdog parse - --json ARGS`` of ``data`` as a process (the real CLI), its output
    decoded; fails the test on a non-zero exit."""
    r = subprocess.run(
        [sys.executable, "-m", "gce_watchdog", "parse", "-", "--json", *args],
        input=data,
        capture_output=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out
