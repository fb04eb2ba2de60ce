"""The poller's command line against the fake Compute API, and its JSON lines by instance."""

from __future__ import annotations

import json
from pathlib import Path

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
