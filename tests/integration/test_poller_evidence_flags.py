"""``gce-watchdog poll --peer-cursor-dir`` and ``--logging-evidence`` end to end (fake APIs)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.simlogging import FakeLoggingAPI
from gce_watchdog.testing.synth import Writer

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", serial_needs_running=True) as a:
        a.add_instance("vm-1", project=P, zone=Z)
        yield a


def poll(api: FakeComputeAPI, tmp_path: Path, who: str, *extra: str) -> list[str]:
    tok = tmp_path / "token"
    tok.write_text("tok\n")
    return [
        "poll", "--project", P, "--zone", Z, "--api-base", api.base_url,
        "--access-token-file", str(tok), "--ledger", str(tmp_path / f"{who}.sqlite"),
        "--cursor-dir", str(tmp_path / who), "--json", "--once", "--api-attempts", "1",
        *extra, "vm-1",
    ]  # fmt: skip


def outcome(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    (line,) = capsys.readouterr().out.splitlines()
    d: dict[str, object] = json.loads(line)
    return d


def finished_then_off(api: FakeComputeAPI) -> bytes:
    w = Writer(ts_ms=int(time.time() * 1000))
    api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
    final = w.line("exit", {"rc": "0"})
    api.append_serial("vm-1", final)
    return final


def test_a_peer_cursor_dir_read_the_last_line_so_no_alarm(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finished_then_off(api)
    assert main(poll(api, tmp_path, "a")) == 0  # poller a reads it while RUNNING
    assert outcome(capsys)["verdict"] == "workload_ok"
    api.set_status("vm-1", "TERMINATED")
    assert main(poll(api, tmp_path, "b")) == 0  # b never read it: no evidence
    alone = outcome(capsys)
    assert alone["verdict"] == "ended_unread" and alone["action"] == "none"
    peer = str(tmp_path / "a")
    before = {f: f.read_bytes() for f in (tmp_path / "a").iterdir()}
    assert main(poll(api, tmp_path, "c", "--peer-cursor-dir", peer)) == 0
    out = outcome(capsys)
    assert out["verdict"] == "workload_ok" and out["action"] == "none", out
    assert f"peer_cursor={peer}" in out["evidence"]  # type: ignore[operator]
    assert before and {f: f.read_bytes() for f in (tmp_path / "a").iterdir()} == before


def test_a_peer_cursor_dir_that_is_our_own_is_a_usage_error(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(poll(api, tmp_path, "a", "--peer-cursor-dir", str(tmp_path / "a"))) == 64
    assert "own --cursor-dir" in capsys.readouterr().err


def test_logging_evidence_reads_the_last_line_from_cloud_logging(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = FakeLoggingAPI(token="tok").start()
    try:
        w = Writer(ts_ms=int(time.time() * 1000))
        api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
        assert main(poll(api, tmp_path, "a")) == 0
        assert outcome(capsys)["verdict"] == "unknown"  # a first read: age unknown
        final = w.line("exit", {"rc": "0"}).rstrip(b"\n").decode() + "\\r\\n"
        logs.add_serial(P, api.instance("vm-1").id, final, time.time())
        api.set_status("vm-1", "TERMINATED")  # the exit line never reached the Compute API
        assert main(poll(api, tmp_path, "a")) == 0
        assert outcome(capsys)["verdict"] == "ended_unread"  # the flag is off by default
        assert not logs.calls
        flags = ("--logging-evidence", "--logging-api-base", logs.base_url)
        assert main(poll(api, tmp_path, "a", *flags)) == 0
        out = outcome(capsys)
        assert out["verdict"] == "workload_ok" and out["action"] == "none", out
        assert "cloud_logging=line" in out["evidence"]  # type: ignore[operator]
    finally:
        logs.close()
