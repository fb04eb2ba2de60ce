"""Issue 37, the poller's side: a signed ``job_stuck`` line through the real CLI (``poll``)
against the fake Compute API (testing/simcompute.py): a failover under the fleet-wide brake, or
an alarm only with ``--on-job-stuck report``; a ``job_stuck`` line the job prints itself
(unsigned) decides nothing. An ``exit`` line that says ``idle=busy`` (the GPUs not released) is
an alarm beside the verdict: in poll's JSON and text lines and in the decisions view."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer
from kit.poll import outputs, poll_args
from kit.schemas import validate

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
STUCK = {"rule": "idle", "step": 41, "quiet": 600, "act": "end"}
BUSY_TEXT = "workload exited with 0; GPUs busy: gpu0 held by pid 4242"


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        yield a


def vm(api: FakeComputeAPI, name: str, *lines: tuple[str, dict[str, object]]) -> None:
    api.add_instance(name, project=P, zone=Z)
    w = Writer(boot="aaaa0001")
    data = w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"})
    for event, fields in lines:
        data += w.line(event, fields, BUSY_TEXT if fields.get("idle") == "busy" else "")
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


def test_gpus_not_released_are_an_alarm_in_poll_and_in_the_decisions_view(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    busy_ok = ("exit", {"rc": "0", "sig": "-", "dur": "60.000", "idle": "busy"})
    busy_kill = ("exit", {"rc": "-", "sig": "SIGTERM", "dur": "900.000", "idle": "busy"})
    vm(api, "done-busy", busy_ok)  # finished: no failover, an alarm
    vm(api, "stuck-busy", ("job_stuck", STUCK), busy_kill)
    vm(api, "stuck-clean", ("job_stuck", STUCK), ("exit", {"rc": "-", "sig": "SIGTERM",
       "idle": "ok"}))  # fmt: skip
    names = ("done-busy", "stuck-busy", "stuck-clean")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out = poll(api, tmp_path / "a", capsys, *names)
    for d in out.values():
        validate("poll", d)
    done, stuck, clean = (out[n] for n in names)
    assert (done["verdict"], done["action"], done["alarm"]) == ("workload_ok", "none", True)
    assert done["alarms"] == ["idle_busy"] and "gpu0 held by pid 4242" in done["reason"]
    assert (stuck["verdict"], stuck["action"], stuck["alarms"]) == (
        "job_stuck", "failover", ["idle_busy"]
    )  # fmt: skip
    assert (clean["action"], clean["alarm"], clean["alarms"]) == ("failover", False, [])
    # the decisions view: the two failovers, the alarm with the one whose GPUs stayed busy
    ledger = str(tmp_path / "a" / "ledger.sqlite")
    assert main(["decisions", "--ledger", ledger, "--json"]) == 0
    docs = {d["name"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert sorted(docs) == ["stuck-busy", "stuck-clean"]
    for d in docs.values():
        validate("decisions", d)
    assert docs["stuck-busy"]["alarms"] == ["idle_busy"]
    assert docs["stuck-busy"]["reason"].startswith("ALARM: the GPUs were not released")
    assert docs["stuck-clean"]["alarms"] == []
    assert main(["decisions", "--ledger", ledger]) == 0
    text = capsys.readouterr().out.splitlines()
    assert [("alarms=idle_busy" in ln) for ln in text] == [
        "name=stuck-busy" in ln for ln in text
    ] and len(text) == 2
    # the alarms view: both boots whose GPUs stayed busy, the finished one too (no decision)
    assert main(["decisions", "alarms", "--ledger", ledger, "--json"]) == 0
    alarms = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    for a in alarms:
        validate("decisions-alarms", a)
    assert sorted((a["name"], a["alarm"]) for a in alarms) == [
        ("done-busy", "idle_busy"), ("stuck-busy", "idle_busy")
    ]  # fmt: skip
    # poll's text line (the journal's): ALARM and the alarm's name, as for a key alarm
    argv = [a for a in poll_args(api, tmp_path / "b", "--once", *names) if a != "--json"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [(" ALARM idle_busy " in ln) for ln in lines] == [
        "stuck-clean" not in ln for ln in lines
    ] and len(lines) == 3
