"""Issue 37, the poller's side: a signed ``job_stuck`` line through the real CLI (``poll``)
against the fake Compute API (testing/simcompute.py): a failover under the fleet-wide brake, or
an alarm only with ``--on-job-stuck report``; a ``job_stuck`` line the job prints itself
(unsigned) decides nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer
from kit.poll import outputs, poll_args

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
STUCK = {"rule": "idle", "step": 41, "quiet": 600, "act": "end"}


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        yield a


def vm(api: FakeComputeAPI, name: str, *lines: tuple[str, dict[str, object]]) -> None:
    api.add_instance(name, project=P, zone=Z)
    w = Writer(boot="aaaa0001")
    data = w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"})
    for event, fields in lines:
        data += w.line(event, fields)
    api.append_serial(name, data)


def poll(api: FakeComputeAPI, tmp: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:  # type: ignore[type-arg]
    assert main(poll_args(api, tmp, "--once", "--api-attempts", "1", *extra)) == 0
    return outputs(capsys)


def test_a_stuck_job_fails_over_or_is_reported(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vm(api, "job-1", ("progress", {"step": 41, "age": 2}), ("job_stuck", STUCK))
    rep = poll(api, tmp_path, capsys, "--on-job-stuck", "report", "job-1")["job-1"]
    assert rep["verdict"] == "job_stuck" and rep["action"] == "none" and rep["alarm"] is True
    assert "ALARM" in rep["reason"]
    out = poll(api, tmp_path, capsys, "job-1")["job-1"]
    assert out["verdict"] == "job_stuck" and out["action"] == "failover", out["reason"]
    assert "600s" in out["reason"] and "step 41" in out["reason"]


def test_a_printed_job_stuck_line_decides_nothing(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vm(api, "job-1")
    forged = b"GCEWD3 job_stuck boot=aaaa0001 seq=9 rule=idle step=1 quiet=600 act=end\n"
    api.append_serial("job-1", forged)
    out = poll(api, tmp_path, capsys, "job-1")["job-1"]
    assert out["verdict"] == "unknown" and out["action"] == "none"  # a first read: age unknown


def test_stuck_jobs_are_held_by_the_fleet_wide_brake(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Six stuck jobs at once (a shared filesystem hangs them all): the default brake
    (10%/10m, floor 3) lets 3 through and holds 3, each with its alarm."""
    names = [f"job-{i}" for i in range(6)]
    for n in names:
        vm(api, n, ("job_stuck", STUCK))
    assert main(poll_args(api, tmp_path, "--once", "--api-attempts", "1", *names)) == 0
    cap = capsys.readouterr()
    out = {d["instance"]: d for d in map(json.loads, cap.out.splitlines())}
    assert sorted(d["action"] for d in out.values()) == ["failover"] * 3 + ["held"] * 3
    assert {d["verdict"] for d in out.values()} == {"job_stuck"}
    assert cap.err.count("ALARM: the fleet-wide brake holds") == 3
