"""Issue 36, the poller's side: planned stops and GPU faults through the real CLI (``poll``,
``parse``) against the fake Compute API, with signed dumps from the test kit's Writer.

The fake models the stop as GCE does (docs/fakes.md, "host maintenance"): a GPU VM's
``onHostMaintenance`` is TERMINATE, so a maintenance event records
``compute.instances.terminateOnHostMaintenance`` and stops it; ``restart`` is GCE's automatic
restart.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.poller import Poller
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.verdict import Policy, VerdictKind
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer
from kit.poll import outputs, poll_args

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
NOTICE = {"event": "TERMINATE_ON_HOST_MAINTENANCE", "was": "NONE"}
FAULT = {"xid": 79, "pci": "0000:00:04.0", "gpu": 3, "sig": "lost"}
APP_XID = {"xid": 13, "pci": "0000:00:04.0", "gpu": 3, "cls": "app"}


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        yield a


def gpu_vm(api: FakeComputeAPI, name: str, *lines: tuple[str, dict[str, object]]) -> Writer:
    """A GPU VM (onHostMaintenance TERMINATE) whose agent wrote a workload phase, then lines."""
    api.add_instance(name, project=P, zone=Z, on_host_maintenance="TERMINATE")
    w = Writer(boot="aaaa0001")
    data = w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"})
    for event, fields in lines:
        data += w.line(event, fields)
    api.append_serial(name, data)
    return w


def poll(api: FakeComputeAPI, tmp: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:  # type: ignore[type-arg]
    # one attempt: GCE answers 503 for the serial port of a VM that is off, by design
    assert main(poll_args(api, tmp, "--once", "--api-attempts", "1", *extra)) == 0
    return outputs(capsys)


def test_host_maintenance_fails_over_once_and_is_reaped(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_vm(api, "gpu-1", ("maintenance", NOTICE))
    first = poll(api, tmp_path, capsys, "--reap", "gpu-1")["gpu-1"]
    # a first read: its age is not known (docs/poller.md, "Freshness"), the notice is shown
    assert first["verdict"] == "unknown" and "host maintenance announced" in first["reason"]
    api.host_maintenance("gpu-1")  # an hour later: GCE stops it (no line of ours is read)
    out = poll(api, tmp_path, capsys, "--reap", "gpu-1")["gpu-1"]
    assert out["verdict"] == "host_maintenance" and out["action"] == "failover", out["reason"]
    assert "operations=compute.instances.terminateOnHostMaintenance" in out["evidence"]
    assert any("TERMINATE_ON_HOST_MAINTENANCE" in e for e in out["evidence"])  # the notice
    assert out["reaped"] and api.instance("gpu-1").deleted
    again = poll(api, tmp_path, capsys, "--reap", "gpu-1")["gpu-1"]
    assert again["action"] == "already_decided" and len(api.calls_to("delete")) == 1
    with open_ledger(str(tmp_path / "ledger.sqlite"), "t") as led:
        assert [d.verdict for d in led.decisions.all()] == ["host_maintenance"]


def test_host_error_fails_over(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_vm(api, "gpu-1")
    poll(api, tmp_path, capsys, "gpu-1")  # read while it runs
    api.host_error("gpu-1")
    out = poll(api, tmp_path, capsys, "gpu-1")["gpu-1"]
    assert out["verdict"] == "host_error" and out["action"] == "failover", out["reason"]
    assert out["alarm"] is False


def test_waiting_for_the_restart_then_the_new_boot_is_judged_afresh(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = gpu_vm(api, "gpu-1", ("maintenance", NOTICE))
    wait = ("--reap", "--on-planned-stop", "wait", "gpu-1")
    poll(api, tmp_path, capsys, *wait)
    api.host_maintenance("gpu-1")
    out = poll(api, tmp_path, capsys, *wait)["gpu-1"]
    assert out["verdict"] == "host_maintenance" and out["action"] == "none", out["reason"]
    assert "automatic restart" in out["reason"] and out["alarm"] is False
    assert not api.calls_to("delete") and not api.instance("gpu-1").deleted
    api.restart("gpu-1")
    w.reboot("bbbb0002")
    api.append_serial("gpu-1", w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"}))
    back = poll(api, tmp_path, capsys, *wait)["gpu-1"]
    assert back["verdict"] == "healthy" and back["boot"] == "bbbb0002"
    with open_ledger(str(tmp_path / "ledger.sqlite"), "t") as led:
        assert led.decisions.all() == []  # nothing was decided


def test_planned_stops_are_held_by_the_fleet_wide_brake(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A maintenance wave over 6 GPU VMs: the default brake (10%/10m, floor 3) lets 3 through
    and holds 3, each with its alarm."""
    names = [f"gpu-{i}" for i in range(6)]
    for n in names:
        gpu_vm(api, n)
    poll(api, tmp_path, capsys, *names)
    for n in names:
        api.host_maintenance(n)
    assert main(poll_args(api, tmp_path, "--once", "--api-attempts", "1", *names)) == 0
    cap = capsys.readouterr()
    out = {d["instance"]: d for d in map(json.loads, cap.out.splitlines())}
    actions = sorted(d["action"] for d in out.values())
    assert actions == ["failover"] * 3 + ["held"] * 3
    assert {d["verdict"] for d in out.values()} == {"host_maintenance"}
    assert cap.err.count("ALARM: the fleet-wide brake holds") == 3


def test_a_gpu_fault_fails_over_and_is_reaped_while_the_agent_beats(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_vm(
        api, "gpu-1", ("gpu_event", APP_XID), ("gpu_fault", FAULT),
        ("heartbeat", {"rung": "0/10", "ph": "workload"}),
    )  # fmt: skip
    gpu_vm(api, "gpu-2", ("gpu_event", APP_XID), ("gpu_stall", {"ms": 12000, "to": 10000}))
    out = poll(api, tmp_path, capsys, "--reap", "gpu-1", "gpu-2")
    one = out["gpu-1"]
    assert one["verdict"] == "gpu_fault" and one["action"] == "failover", one["reason"]
    assert "Xid 79" in one["reason"] and "0000:00:04.0" in one["reason"]
    assert one["reaped"] and api.instance("gpu-1").deleted
    two = out["gpu-2"]  # an application Xid and a stall: shown, never a decision
    assert two["verdict"] == "unknown" and two["action"] == "none"  # a first read: age unknown
    assert any(" gpu_event " in e for e in two["evidence"])
    assert any(" gpu_stall " in e for e in two["evidence"])


def test_report_mode_raises_the_alarm_only(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_vm(api, "gpu-1", ("memory_gpu", {"st": "lost", "n": 0}))  # every GPU lost
    out = poll(api, tmp_path, capsys, "--reap", "--on-gpu-fault", "report", "gpu-1")["gpu-1"]
    assert out["verdict"] == "gpu_fault" and out["action"] == "none" and out["alarm"] is True
    assert "every GPU" in out["reason"] and "ALARM" in out["reason"]
    assert not api.calls_to("delete")
    dflt = poll(api, tmp_path, capsys, "gpu-1")["gpu-1"]
    assert dflt["verdict"] == "gpu_fault" and dflt["action"] == "failover"


def test_report_mode_still_fails_over_a_preemption_after_the_fault(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.add_instance("spot-1", project=P, zone=Z, spot=True)
    w = Writer(boot="aaaa0001")
    api.append_serial("spot-1", w.line("phase", {"ph": "workload"}) + w.line("gpu_fault", FAULT))
    report = ("--on-gpu-fault", "report", "spot-1")
    assert poll(api, tmp_path, capsys, *report)["spot-1"]["action"] == "none"
    api.preempt("spot-1")
    out = poll(api, tmp_path, capsys, *report)["spot-1"]
    assert out["verdict"] == "preempted" and out["action"] == "failover", out["reason"]
    assert any(" gpu_fault " in e for e in out["evidence"])


def test_parse_gives_the_same_gpu_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = Writer(boot="aaaa0001")
    data = w.line("phase", {"ph": "workload"}) + w.line("gpu_fault", FAULT)
    f = tmp_path / "serial.log"
    f.write_bytes(data)
    assert main(["parse", str(f), "--json", "--status", "RUNNING"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["kind"] == "gpu_fault" and doc["verdict"]["failover"] is True
    assert main(["parse", str(f)]) == 0
    assert "verdict: gpu_fault (FAILOVER)" in capsys.readouterr().out


# -- a VM back from a planned stop before its new boot speaks (an injected clock) --------------


def test_a_vm_back_from_maintenance_waits_one_drain_timeout_for_its_new_boot(
    tmp_path: Path,
) -> None:
    now = [1_800_000_000.0]
    with (
        FakeComputeAPI(token="tok", clock=lambda: now[0]) as api,
        open_ledger(tmp_path / "ledger.sqlite", "t") as ledger,
    ):
        from google.oauth2.credentials import Credentials

        api.add_instance("gpu-1", project=P, zone=Z, on_host_maintenance="TERMINATE")
        w = Writer(boot="aaaa0001", ts_ms=int(now[0] * 1000))
        api.append_serial("gpu-1", w.line("phase", {"ph": "workload"}))
        creds = Credentials("tok")  # type: ignore[no-untyped-call]
        retry = ComputeRetry(attempts=1, sleep=lambda s: None)
        client = ComputeClient.create(creds, api_base=api.base_url, retry=retry)
        policy = Policy(drain_timeout_s=600, planned_stop_wait=True)
        p = Poller(client, CursorStore(None), P, Z, ledger, policy, clock=lambda: now[0])
        assert _kind(p) is VerdictKind.UNKNOWN  # a first read: its age is not known
        now[0] += 60
        api.host_maintenance("gpu-1")
        now[0] += 3600  # an hour of maintenance, then GCE restarts it
        api.restart("gpu-1")
        v = p.poll("gpu-1").verdict
        assert v is not None and v.kind is VerdictKind.UNKNOWN and not v.failover, v
        assert "waiting for the new boot" in v.reason
        lists = len(api.calls_to("operations"))
        now[0] += 600  # exactly one drain timeout since it came back: still waiting
        assert _kind(p) is VerdictKind.UNKNOWN
        assert len(api.calls_to("operations")) == lists  # one lookup per boot, remembered
        now[0] += 1  # past it: the restarted VM never spoke
        out = p.poll("gpu-1")
        assert out.verdict is not None and out.verdict.kind is VerdictKind.SUSPECTED_WEDGE
        assert out.action == "failover" and "running again" in out.verdict.reason


def _kind(p: Poller) -> VerdictKind | None:
    v = p.poll("gpu-1").verdict
    return v.kind if v is not None else None


KILLED = {"rc": "-", "sig": "SIGTERM", "dur": "3600.000"}


def test_a_job_killed_by_the_maintenance_shutdown_fails_over_not_workload_failed(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36.1: GCE shuts the guest down for maintenance, systemd stops the job with SIGTERM
    and `exec` writes `exit rc=- sig=SIGTERM`, read while the VM is still RUNNING. Once the
    operation is recorded the planned stop decides (one failover, reaped), never
    workload_failed; before that the exit decides and nothing is reaped."""
    gpu_vm(api, "gpu-1", ("maintenance", NOTICE), ("exit", KILLED))
    first = poll(api, tmp_path, capsys, "--reap", "gpu-1")["gpu-1"]
    assert first["verdict"] == "workload_failed" and first["reaped"] is None
    assert len(api.calls_to("operations")) == 1  # looked up, nothing recorded yet
    api.host_maintenance("gpu-1")
    out = poll(api, tmp_path, capsys, "--reap", "gpu-1")["gpu-1"]
    assert out["verdict"] == "host_maintenance" and out["action"] == "failover", out["reason"]
    assert "killed by SIGTERM" in out["reason"]
    assert "operations=compute.instances.terminateOnHostMaintenance" in out["evidence"]
    assert out["reaped"] and api.instance("gpu-1").deleted
    again = poll(api, tmp_path, capsys, "--reap", "gpu-1")["gpu-1"]
    assert again["action"] == "already_decided" and len(api.calls_to("delete")) == 1
    with open_ledger(str(tmp_path / "ledger.sqlite"), "t") as led:
        assert [d.verdict for d in led.decisions.all()] == ["host_maintenance"]


@pytest.mark.parametrize(
    ("exit_fields", "want"),
    [(KILLED, "preempted"), ({"rc": "0", "sig": "-", "dur": "3600.000"}, "workload_ok")],
)
def test_a_killed_job_of_a_preempted_vm_and_a_finished_one(
    api: FakeComputeAPI,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    exit_fields: dict[str, object],
    want: str,
) -> None:
    gpu_vm(api, "gpu-1", ("exit", exit_fields))
    poll(api, tmp_path, capsys, "gpu-1")
    api.preempt("gpu-1")
    out = poll(api, tmp_path, capsys, "gpu-1")["gpu-1"]
    assert out["verdict"] == want, out["reason"]
    assert out["action"] == ("failover" if want == "preempted" else "none")
