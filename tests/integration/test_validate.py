"""``gce-watchdog validate`` against the fake Compute API with simulated guests
(testing/simguest.py): the whole run, the plan, the refusals, and cleanup after a kill at every
step (issue 28 items 4 and 5)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import FakeComputeAPI, FakeInstance
from gce_watchdog.testing.simguest import SimGuest
from gce_watchdog.validate.plan import LABEL
from gce_watchdog.validate.scenarios import DEFAULT_SCENARIOS
from kit.paths import REPO
from kit.procs import sigint_default

pytestmark = pytest.mark.process

P, Z = "val-project", "us-central1-a"
FAST = ["--poll-every", "0.05", "--agent-interval", "0.2", "--deadline", "90", "--op-poll", "0.05"]
SOURCE = ["--deb-url", "https://example.invalid/gce-watchdog.deb", "--deb-sha256", "0" * 64]


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    # a simulated maintenance event announces the stop 2 s ahead: 10 guest ticks, 40 polls
    with FakeComputeAPI(token="tok", serial_needs_running=True, maintenance_notice_s=2.0) as a:
        a.add_zone(P, Z)
        yield a


@pytest.fixture
def guest(api: FakeComputeAPI) -> Iterator[SimGuest]:
    with SimGuest(api) as g:
        yield g
    assert g.errors == []


def argv(api: FakeComputeAPI, tmp: Path, *extra: str) -> list[str]:
    tok = tmp / "token"
    tok.write_text("tok\n")
    return ["validate", "--project", P, "--zone", Z, *SOURCE, "--api-base", api.base_url,
            "--access-token-file", str(tok), *extra]  # fmt: skip


def alive(api: FakeComputeAPI) -> list[FakeInstance]:
    return [i for i in api._instances.values() if not i.deleted]


def inserted(api: FakeComputeAPI) -> list[FakeInstance]:
    return [i for i in api._instances.values() if i.inserted]


def test_plan_lists_vms_cost_and_permissions_and_touches_nothing(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv(api, tmp_path, "--plan", "--run-id", "vplan1")) == 0
    out = capsys.readouterr().out
    for scenario in ("wedge", "done", "setup-failed", "setup-failed-infra", "maintenance", "flap"):
        assert f"gcewd-vplan1-{scenario}" in out
    assert "e2-small" in out and "estimated cost: $" in out
    assert "compute.instances.create" in out and "roles/compute.instanceAdmin.v1" in out
    assert api.calls == []  # not one request: nothing read, nothing created
    assert main(argv(api, tmp_path, "--plan", "--json", "--run-id", "vplan1")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["estimated_cost_usd"] > 0 and len(doc["instances"]) == 6
    assert "compute.instances.simulateMaintenanceEvent" in doc["permissions"]
    assert api.calls == []


def test_a_real_run_needs_yes(api: FakeComputeAPI, tmp_path: Path) -> None:
    assert main(argv(api, tmp_path, "--run-id", "vnoyes")) == 64
    assert api.calls == []


def test_a_plan_needs_no_source_and_a_run_does(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = [a for a in argv(api, tmp_path) if a not in SOURCE]
    assert main([*bare, "--plan", "--run-id", "vnosrc"]) == 0
    out = capsys.readouterr().out
    assert "gcewd-vnosrc-wedge" in out and "agent source: none given yet" in out
    assert main([*bare, "--plan", "--json", "--run-id", "vnosrc"]) == 0
    assert len(json.loads(capsys.readouterr().out)["instances"]) == len(DEFAULT_SCENARIOS)
    assert main([*bare, "--yes", "--run-id", "vnosrc"]) == 64
    assert "give exactly one agent source" in capsys.readouterr().err
    two = [*bare, "--image", "img", "--wheel-url", "https://x.invalid/w.tgz"]
    assert main([*two, "--wheel-sha256", "0" * 64, "--plan"]) == 64, "two sources: still refused"
    assert main(argv(api, tmp_path, "--plan", "--run-id", "vsrc")) == 0
    assert "agent source: the .deb https://example.invalid/gce-watchdog.deb" in (
        capsys.readouterr().out
    )
    assert api.calls == []


def test_the_whole_run_wedge_fails_over_once_the_rest_never_and_nothing_is_left(
    api: FakeComputeAPI, guest: SimGuest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    # The scenarios of issue 28 (those of issue 36 below): a VM that goes off costs a poll's
    # retries of its serial read (503, up to ~7 s), which may pass a simulated linger of 3 s
    four = [a for n in ("wedge", "done", "setup-failed", "flap") for a in ("--scenario", n)]
    rc = main(argv(api, tmp_path, "--yes", "--run-id", "vfull1", "--out", str(out), *four, *FAST))
    err = capsys.readouterr().err
    _check_progress(err)
    doc = json.loads((out / "validate.json").read_text())
    by = {s["scenario"]: s for s in doc["scenarios"]}
    assert rc == 0, [(s["scenario"], [e for e in s["evidence"] if "FAIL" in e], s["notes"])
                     for s in doc["scenarios"]]  # fmt: skip
    assert doc["passed"] and doc["interrupted"] is None
    wedge = by["wedge"]
    assert wedge["failovers"] == 1 and wedge["verdict"] == "self_shutdown"
    t = wedge["timings"]
    for k in ("fault_to_first_rung_s", "fault_to_top_rung_s", "fault_to_shutdown_line_s",
              "fault_to_left_running_s", "fault_to_decision_s"):  # fmt: skip
        assert t[k] is not None and t[k] >= 0, (k, t)
    assert t["fault_to_first_rung_s"] < t["fault_to_top_rung_s"] <= t["fault_to_decision_s"]
    for name in ("done", "setup-failed", "flap"):
        assert by[name]["failovers"] == 0 and by[name]["passed"], by[name]
    assert by["done"]["verdict"] == "workload_ok" and by["done"]["deleted"]
    assert by["done"]["reaped_by_poller"]
    assert by["flap"]["timings"]["fault_to_recovered_s"] is not None
    assert all(s["deleted"] for s in doc["scenarios"])
    assert alive(api) == []
    assert {i.labels[LABEL] for i in inserted(api)} == {"vfull1"}
    for s in doc["scenarios"]:
        assert (out / s["files"]["serial"]).stat().st_size > 0
        assert "<html" in (out / s["files"]["html"]).read_text().lower()
    assert (out / "ledger.sqlite").exists()


def _check_progress(err: str) -> None:
    """validate's stderr: one line per step with the time since the run began, every
    scenario's milestones in order, no spinner (not a terminal)."""
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    stamped = [
        ln for ln in lines if re.match(r"gce-watchdog validate: \[(\d+h)?(\d+m)?\d+s\] ", ln)
    ]
    assert len(stamped) == len(lines) - 1, [ln for ln in lines if ln not in stamped]  # + `run ...`
    for scenario in ("wedge", "done", "setup-failed", "flap"):
        mine = [ln.split("] ", 1)[1] for ln in stamped if f"gcewd-vfull1-{scenario}: " in ln]
        said = [m.split(": ", 1)[1] for m in mine]
        assert said[0].startswith("creating") or said[0].startswith("its agent's first line")
        assert said[-1].startswith("scenario finished (verdict "), said
    wedge = [ln for ln in stamped if "gcewd-vfull1-wedge: " in ln]
    order = ["first line", "the workload runs", "requesting the fault", "the fault is on",
             "the ladder climbs", "the agent decided", "the poller decided: 1 failover",
             "no longer RUNNING", "scenario finished"]  # fmt: skip
    at = [next(i for i, ln in enumerate(wedge) if what in ln) for what in order]
    assert at == sorted(at), list(zip(order, at, strict=True))


def test_a_dns_failure_in_bootstrap_and_host_maintenance_fail_over_once_each(
    api: FakeComputeAPI, guest: SimGuest, tmp_path: Path
) -> None:
    """Issue 36: `setup-failed-infra` (a bootstrap curl of an .invalid host: exit 6, cause=infra)
    and `maintenance` (validate calls instances.simulateMaintenanceEvent; the agent's notice,
    then terminateOnHostMaintenance stops the VM), each exactly one failover, nothing left."""
    out = tmp_path / "out"
    two = ["--scenario", "setup-failed-infra", "--scenario", "maintenance"]
    rc = main(argv(api, tmp_path, "--yes", "--run-id", "vmaint1", "--out", str(out), *two, *FAST))
    doc = json.loads((out / "validate.json").read_text())
    by = {s["scenario"]: s for s in doc["scenarios"]}
    assert rc == 0, [(s["scenario"], s["evidence"], s["notes"]) for s in doc["scenarios"]]
    infra = by["setup-failed-infra"]
    assert infra["failovers"] == 1 and infra["verdict"] == "setup_failed_infra", infra
    maint = by["maintenance"]
    assert maint["failovers"] == 1 and maint["verdict"] == "host_maintenance", maint
    assert "info: the agent's maintenance notice was read" in maint["evidence"]
    assert maint["timings"]["maintenance_to_decision_s"] is not None
    sims = api.calls_to("simulate_maintenance")
    assert [c.path.rsplit("/", 2)[1] for c in sims] == ["gcewd-vmaint1-maintenance"]
    assert [o.type for o in api.zone_operations("gcewd-vmaint1-maintenance")][:3] == [
        "insert", "simulateMaintenanceEvent", "compute.instances.terminateOnHostMaintenance"
    ]  # fmt: skip
    bootstrap = json.loads(api.instance("gcewd-vmaint1-setup-failed-infra").metadata[
        "gce-watchdog-bootstrap"])  # fmt: skip
    assert bootstrap == [["curl", "-fsS", "--max-time", "20", "-o", "/dev/null",
                          "https://gcewd-validate.invalid/"]]  # fmt: skip
    assert all(s["deleted"] for s in doc["scenarios"]) and alive(api) == []
    maint_log = (out / maint["files"]["serial"]).read_text()
    assert "maintenance event=TERMINATE_ON_HOST_MAINTENANCE" in maint_log
    infra_log = (out / infra["files"]["serial"]).read_text()
    assert "setup_failed step=bootstrap:md0" in infra_log and "cause=infra" in infra_log


def test_the_saved_console_is_what_the_poller_read_even_when_the_vm_stops_right_after(
    api: FakeComputeAPI, guest: SimGuest, tmp_path: Path
) -> None:
    """The flaky run of the test above, made certain: the VM powers off right after the read
    that brought its `setup_failed` line (the API serves no console once it is not RUNNING).
    `validate` once kept its own copy from reads of its own before each poll, so such a VM
    left `serial-NAME.log` empty (or the poller never saw the line); the copy is now the bytes
    the poller's reads brought, so the verdict, the evidence and the saved console agree."""
    name = "gcewd-vstop1-setup-failed-infra"

    def stop_after_the_line(inst: FakeInstance, contents: str) -> None:
        if inst.name == name and "setup_failed" in contents and inst.status == "RUNNING":
            api.guest_shutdown(name)  # no linger: nothing more can be read

    api.on_serial.append(stop_after_the_line)
    out = tmp_path / "out"
    rc = main(argv(api, tmp_path, "--yes", "--run-id", "vstop1", "--out", str(out),
                   "--scenario", "setup-failed-infra", *FAST))  # fmt: skip
    doc = json.loads((out / "validate.json").read_text())
    (infra,) = doc["scenarios"]
    assert rc == 0, (infra["evidence"], infra["notes"])
    assert infra["failovers"] == 1 and infra["verdict"] == "setup_failed_infra", infra
    log = (out / infra["files"]["serial"]).read_text()
    assert "setup_failed step=bootstrap:md0" in log and "cause=infra" in log, log
    assert api.instance(name).deleted and alive(api) == []


def test_a_vm_that_does_not_enable_faults_fails_its_scenario(
    api: FakeComputeAPI, guest: SimGuest, tmp_path: Path
) -> None:
    """The fault switch is off (e.g. a start-up script without the config drop-in): the agent
    refuses the fault, and validate says so and exits non-zero."""

    def strip_config(inst: FakeInstance) -> None:
        inst.metadata.pop("gce-watchdog-config", None)

    api.on_insert.insert(0, strip_config)  # before the guest reads its metadata
    out = tmp_path / "out"
    rc = main(argv(api, tmp_path, "--yes", "--run-id", "voff1", "--out", str(out),
                   "--scenario", "flap", *FAST))  # fmt: skip
    assert rc == 1
    flap = json.loads((out / "validate.json").read_text())["scenarios"][0]
    assert not flap["passed"]
    assert any("refused the fault" in e for e in flap["evidence"])
    assert alive(api) == []


# -- killed at any step -------------------------------------------------------------------------


def spawn(api: FakeComputeAPI, tmp: Path, run: str) -> subprocess.Popen[bytes]:
    args = argv(api, tmp, "--yes", "--run-id", run, "--out", str(tmp / "out"),
                "--scenario", "wedge", "--scenario", "done", *FAST)  # fmt: skip
    # validate's own scratch folder (its ledger and cursors, tempfile.mkdtemp) under the test's:
    # a SIGKILLed run cannot remove it, and it must not be left in the machine's /tmp
    scratch = tmp / "scratch"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO / "agent"), TMPDIR=str(scratch))
    # SIGINT at its default, as in a terminal: the Ctrl-C test must not inherit the SIG_IGN
    # of a `make test &` (kit/procs.py, sigint_default)
    return subprocess.Popen(sigint_default([sys.executable, "-m", "gce_watchdog", *args]),
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def wait_until(pred: Callable[[], bool], proc: subprocess.Popen[bytes], within: float) -> None:
    deadline = time.monotonic() + within
    while not pred():
        assert proc.poll() is None, "validate ended before the step"
        assert time.monotonic() < deadline, "the step was not reached"
        time.sleep(0.005)


def count(api: FakeComputeAPI, endpoint: str) -> int:
    return len(api.calls_to(endpoint))


STEPS: dict[str, Callable[[FakeComputeAPI], bool]] = {
    "first insert sent": lambda a: count(a, "insert") >= 1,
    "every VM created": lambda a: count(a, "insert") >= 2,
    "polling": lambda a: count(a, "serial") >= 3,
    "fault requested": lambda a: count(a, "set_metadata") >= 1,
    "deleting": lambda a: count(a, "delete") >= 1,
}


@pytest.mark.parametrize("step", list(STEPS))
def test_sigkill_at_any_step_leaves_only_what_cleanup_removes(
    api: FakeComputeAPI, guest: SimGuest, tmp_path: Path, step: str
) -> None:
    run = "vkill" + str(list(STEPS).index(step))
    proc = spawn(api, tmp_path, run)
    try:
        wait_until(lambda: STEPS[step](api), proc, 60)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    # what SIGKILL left on this machine is in the test's folder, nowhere else
    assert [p.name.split("-")[2] for p in (tmp_path / "scratch").iterdir()] == [run]
    # Everything the killed run created carries its label, so --cleanup finds it.
    assert all(i.labels.get(LABEL) == run for i in inserted(api))
    assert main(argv(api, tmp_path, "--cleanup", run)) == 0
    assert alive(api) == []
    assert main(argv(api, tmp_path, "--cleanup", run)) == 0  # again: nothing to do


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_deletes_everything_itself(
    api: FakeComputeAPI, guest: SimGuest, tmp_path: Path, sig: signal.Signals
) -> None:
    proc = spawn(api, tmp_path, "vsig" + str(int(sig)))
    try:
        wait_until(lambda: count(api, "set_metadata") >= 1, proc, 60)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err.decode()
    assert alive(api) == [], err.decode()
    doc = json.loads((tmp_path / "out" / "validate.json").read_text())
    assert doc["interrupted"] and not doc["passed"]


def test_cleanup_without_a_run_deletes_every_validation_vm_and_nothing_else(
    api: FakeComputeAPI, tmp_path: Path
) -> None:
    api.add_instance("gcewd-vaa1-wedge", project=P, zone=Z, labels={LABEL: "vaa1"})
    api.add_instance("gcewd-vbb1-done", project=P, zone="europe-west4-b", labels={LABEL: "vbb1"})
    api.add_instance("production-1", project=P, zone=Z, labels={"team": "ml"})
    assert main(argv(api, tmp_path, "--cleanup", "vaa1")) == 0
    assert sorted(i.name for i in alive(api)) == ["gcewd-vbb1-done", "production-1"]
    assert main(argv(api, tmp_path, "--cleanup")) == 0
    assert [i.name for i in alive(api)] == ["production-1"]
    assert main(argv(api, tmp_path, "--cleanup", "Not-A-Run")) == 64
