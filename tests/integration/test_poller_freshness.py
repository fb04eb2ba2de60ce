"""Freshness is the reader's and it is shared (issue 35, item 2): the documented Cloud Run job
form (``poll --label ... --once`` with no cursors, docs/poller.md) against the fake Compute API,
through the real CLI, with a new cursor dir for every poll and one shared ledger."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer

pytestmark = pytest.mark.process

P = "test-project"
LABEL = "gce-watchdog-job"
DRAIN = 1.5  # the drain timeout, scaled down only through its setting
MAX_POLLS = 40  # every loop is bounded


def job_args(api: FakeComputeAPI, tmp_path: Path, run: int, *extra: str) -> list[str]:
    """One execution of the Cloud Run job form: ``--label ... --once`` with its own, new cursor
    dir (a container starts with an empty disk), the shared ledger, JSON out."""
    tok = tmp_path / "token"
    if not tok.exists():
        tok.write_text("tok\n")
    return [
        "poll",
        "--project",
        P,
        "--label",
        LABEL,
        "--once",
        "--api-base",
        api.base_url,
        "--access-token-file",
        str(tok),
        "--ledger",
        str(tmp_path / "ledger.sqlite"),
        "--cursor-dir",
        str(tmp_path / f"cursors-{run}"),
        "--drain-timeout",
        f"{DRAIN}s",
        "--json",
        *extra,
    ]


def execute(
    api: FakeComputeAPI, tmp_path: Path, run: int, capsys: pytest.CaptureFixture[str]
) -> dict[str, dict[str, object]]:
    assert main(job_args(api, tmp_path, run)) == 0
    lines = capsys.readouterr().out.splitlines()
    return {d["instance"]: d for d in map(json.loads, lines)}


def vm(api: FakeComputeAPI, name: str) -> Writer:
    api.add_instance(name, project=P, labels={LABEL: name})
    w = Writer(boot=f"b{abs(hash(name)) % 10**7:07d}")
    api.append_serial(name, w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"}))
    return w


def test_cloud_run_job_form_fails_a_silent_vm_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each execution starts with no cursors: the first never calls the VM healthy, none does
    while it stays silent, and every execution that starts a drain timeout after the first
    one's read fails it over (the first of them announces it, once)."""
    with FakeComputeAPI(token="tok") as api:
        vm(api, "vm-silent")
        verdicts: list[str] = []
        first_done = None
        announced = 0
        for run in range(MAX_POLLS):
            started = time.time()
            out = execute(api, tmp_path, run, capsys)["vm-silent"]
            first_done = first_done or time.time()
            verdicts.append(str(out["verdict"]))
            announced += out["action"] == "failover"
            if started > first_done + DRAIN:
                # its newest line was first received during the first execution: silent for
                # longer than the drain timeout by this reader's clock, whatever its cursor
                assert out["verdict"] == "suspected_wedge", out
                break
            assert out["verdict"] in ("unknown", "suspected_wedge"), out
            time.sleep(0.2)
        assert verdicts[0] == "unknown" and "healthy" not in verdicts
        assert verdicts[-1] == "suspected_wedge" and announced == 1, verdicts


def test_cloud_run_job_form_sees_a_live_vm_and_measures_silence_from_the_first_receipt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeComputeAPI(token="tok") as api:
        w = vm(api, "vm-live")
        first = execute(api, tmp_path, 0, capsys)["vm-live"]
        assert first["verdict"] == "unknown" and "fresh=no" in first["evidence"]  # type: ignore[operator]
        time.sleep(1.0)
        # the same newest line, read again by a new execution: silence counts from the first
        # execution's receipt (>= 1 s), not from this read (0 s)
        again = execute(api, tmp_path, 1, capsys)["vm-live"]
        assert again["verdict"] == "unknown"
        silent = next(e for e in again["evidence"] if str(e).startswith("silent="))  # type: ignore[attr-defined]
        assert float(str(silent)[len("silent=") : -1]) >= 1, again
        # a newer line arrives between two executions: the VM is alive, healthy
        api.append_serial("vm-live", w.line("heartbeat", {"ph": "workload", "rung": "0/10"}))
        live = execute(api, tmp_path, 2, capsys)["vm-live"]
        assert live["verdict"] == "healthy", live
        # and the next execution (no newer line, within the drain timeout) agrees
        assert execute(api, tmp_path, 3, capsys)["vm-live"]["verdict"] == "healthy"


def test_a_poller_with_a_cursor_calls_a_new_line_healthy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reader that read the port before receives the boot's lines as they come: a line that
    arrived after its previous read is fresh (the first read alone is not)."""
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-new", project=P, labels={LABEL: "x"})
        assert execute(api, tmp_path, 0, capsys)["vm-new"]["verdict"] == "unknown"  # no line
        w = Writer(boot="c0ffee01")
        api.append_serial("vm-new", w.line("start", {"v": "1"}))
        assert execute(api, tmp_path, 0, capsys)["vm-new"]["verdict"] == "healthy"
