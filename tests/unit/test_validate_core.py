"""validate's pure cores: the plan (what is created, its cost, its permissions) and the judgement
of each scenario from what was observed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.faults.request import parse_request
from gce_watchdog.validate import plan as P
from gce_watchdog.validate.scenarios import SCENARIOS, Observation, judge, select
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

SRC = P.AgentSource(deb_url="https://example.com/a.deb", deb_sha256="a" * 64)
SCRIPT = "#!/bin/bash\necho hi\n"


def make(**kw: Any) -> P.Plan:
    args: dict[str, Any] = dict(
        run="vtest1", project="p", zone="us-central1-a",
        scenarios=list(SCENARIOS.values()), source=SRC, startup_script=SCRIPT,
    )  # fmt: skip
    args.update(kw)
    return P.make_plan(**args)


def md(body: dict[str, Any]) -> dict[str, str]:
    return {i["key"]: i["value"] for i in body["metadata"]["items"]}


def test_one_labelled_small_vm_per_scenario_with_the_real_script_and_the_fault_switch() -> None:
    plan = make()
    assert [v.scenario for v in plan.vms] == list(SCENARIOS)
    for v in plan.vms:
        b = v.body
        assert b["name"] == v.name and v.name.startswith("gcewd-vtest1-")
        assert b["labels"] == {P.LABEL: "vtest1", P.SCENARIO_LABEL: v.scenario}
        assert str(b["machineType"]).endswith("/e2-small")
        m = md(b)
        assert m["startup-script"] == SCRIPT
        assert "faults_from_metadata = true" in m["gce-watchdog-config"]
        assert "trust_metadata = true" in m["gce-watchdog-config"]  # cloud-platform VMs
        assert m["gce-watchdog-deb-url"] == SRC.deb_url
        assert m["gce-watchdog-deb-sha256"] == SRC.deb_sha256
        sched = b["scheduling"]
        assert sched["maxRunDuration"] == {"seconds": str(P.MAX_RUN_S)}  # type: ignore[index]
        assert sched["instanceTerminationAction"] == "DELETE"  # type: ignore[index]
    assert json.loads(md(plan.vms[2].body)["gce-watchdog-bootstrap"]) == [["false"]]


def test_cost_is_list_price_times_minutes_and_says_its_source() -> None:
    plan = make()
    minutes = sum(P.MINUTES[s] for s in SCENARIOS)
    assert plan.minutes == minutes
    hourly = P.MACHINE_PRICES["e2-small"][0] + P.DISK_PRICE_GB_MONTH * P.DISK_GB / 730
    assert plan.cost_usd == pytest.approx(hourly * minutes / 60)
    assert make(spot=True).cost_usd < plan.cost_usd
    text = "\n".join(plan.render())
    assert P.PRICES_DATE in text and P.PRICES_SOURCE in text and "e2-small" in text
    assert all(p in text for p, _ in P.PERMISSIONS)
    j = plan.to_json()
    assert j["prices"] == {"date": P.PRICES_DATE, "source": P.PRICES_SOURCE}
    assert len(j["instances"]) == len(SCENARIOS)  # type: ignore[arg-type]


def test_the_price_table_holds_the_cited_values() -> None:
    # The values cited in plan.py (us-central1, Cloud Billing Catalog export of 2026-07-30):
    # a changed price must change the citation too, and this test with it.
    assert P.PRICES_DATE == "2026-07-30"
    assert P.MACHINE_PRICES["e2-small"] == (0.016753, 0.010053)
    assert P.MACHINE_PRICES["g2-standard-4"] == (0.706832, 0.397336)
    assert P.DISK_PRICE_GB_MONTH == 0.10
    # docs/validate.md quotes these two estimates for the six scenarios (59 VM-minutes)
    assert make().minutes == 59
    assert f"{make().cost_usd:.4f}" == "0.0178"
    assert f"{make(spot=True).cost_usd:.4f}" == "0.0112"
    assert "your bill may differ" in "\n".join(make().render())
    assert "Spot prices can change once a day" in "\n".join(make(spot=True).render())


def test_docs_quote_the_price_table() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "validate.md").read_text()
    for machine, (hourly, spot) in P.MACHINE_PRICES.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{machine}`"))
        assert f"| {hourly:.6f} | {spot:.6f} |" in row, row
    assert f"list prices of **{P.PRICES_DATE}**" in doc


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"machine_type": "g2-standard-4"}, "--allow-gpu"),
        ({"machine_type": "n1-ultramem-160"}, "--machine-type"),
        ({"run": "Bad"}, "run id"),
        ({"source": P.AgentSource()}, "exactly one agent source"),
        ({"source": P.AgentSource(deb_url="http://x/a.deb", deb_sha256="a" * 64)}, "https"),
        ({"source": P.AgentSource(wheel_url="https://x/w.tgz", wheel_sha256="xyz")}, "sha256"),
        ({"source": P.AgentSource(image="img", deb_url="https://x/a", deb_sha256="a" * 64)},
         "exactly one"),
        ({"startup_script": "echo no shebang"}, "#!"),
        ({"scenarios": []}, "no scenario"),
    ],
)  # fmt: skip
def test_bad_inputs_are_refused_before_anything_is_created(kw: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        make(**kw)


def test_a_gpu_only_when_asked() -> None:
    assert make(machine_type="g2-standard-4", allow_gpu=True).machine_type == "g2-standard-4"


@given(st.sampled_from(list(SCENARIOS.values())), st.floats(1, 300), st.integers(2, 50))
def test_fault_requests_are_what_the_agent_accepts(s: object, interval: float, n: int) -> None:
    sc = SCENARIOS[s.name]  # type: ignore[attr-defined]
    value = sc.fault_request("vtest1", interval, n)
    if sc.fault_ticks is None:
        assert value is None
        return
    assert value is not None
    req = parse_request(value)  # the agent's own parser (faults/request.py)
    assert req.cut.label == "metadata+egress443"
    if sc.name == "flap":
        assert req.ttl < 9 * interval  # ends before the 10th tick: no shutdown
    else:
        assert req.ttl >= (n + 1) * interval  # outlasts the ladder


def wedge_seen() -> Observation:
    return Observation(
        "wedge", "vm", fault_at=100.0, first_rung_at=130.0, top_rung_at=400.0,
        shutdown_at=400.0, shutdown_read_at=405.0, left_running_at=420.0, decided_at=406.0,
        failovers=1, verdict="self_shutdown", final_status="gone", deleted=True,
    )  # fmt: skip


def test_a_full_wedge_passes_with_every_timing() -> None:
    o = wedge_seen()
    j = judge(SCENARIOS["wedge"], o)
    assert j.passed, j.evidence
    t = o.timings()
    assert t["fault_to_first_rung_s"] == 30.0 and t["fault_to_top_rung_s"] == 300.0
    assert t["fault_to_shutdown_line_s"] == 300.0 and t["fault_to_decision_s"] == 306.0
    assert t["fault_to_left_running_s"] == 320.0


MILESTONES = ["fault_at", "first_rung_at", "top_rung_at", "shutdown_at", "shutdown_read_at",
              "left_running_at", "decided_at"]  # fmt: skip


@given(st.sampled_from(MILESTONES))
def test_a_wedge_missing_any_milestone_fails(missing: str) -> None:
    o = wedge_seen()
    setattr(o, missing, None)
    j = judge(SCENARIOS["wedge"], o)
    assert not j.passed and any(e.startswith("FAIL") for e in j.evidence)


@given(st.integers(0, 5))
def test_failover_count_must_be_exact(n: int) -> None:
    o = replace(wedge_seen(), failovers=n)
    assert judge(SCENARIOS["wedge"], o).passed == (n == 1)
    done = Observation("done", "vm", left_running_at=1.0, failovers=n, verdict="workload_ok",
                       deleted=True, reaped_by_poller=True)  # fmt: skip
    assert judge(SCENARIOS["done"], done).passed == (n == 0)
    assert not judge(SCENARIOS["done"], replace(done, failovers=0, reaped_by_poller=False)).passed


def test_a_shutdown_read_only_after_the_vm_was_off_fails() -> None:
    o = replace(wedge_seen(), shutdown_read_at=500.0)
    assert not judge(SCENARIOS["wedge"], o).passed


def test_a_flap_that_shut_down_a_refused_fault_or_a_leftover_fails() -> None:
    ok = Observation("flap", "vm", fault_at=1.0, first_rung_at=2.0, recovered_at=9.0,
                     verdict="healthy", deleted=True)  # fmt: skip
    assert judge(SCENARIOS["flap"], ok).passed
    assert not judge(SCENARIOS["flap"], replace(ok, shutdown_at=8.0)).passed
    assert not judge(SCENARIOS["flap"], replace(ok, fault_refused="disabled")).passed
    assert not judge(SCENARIOS["flap"], replace(ok, deleted=False)).passed
    assert not judge(SCENARIOS["flap"], replace(ok, timed_out=True)).passed


def test_select_keeps_order_and_refuses_unknown() -> None:
    assert [s.name for s in select(["flap", "wedge", "flap"])] == ["flap", "wedge"]
    with pytest.raises(ValueError, match="unknown scenario"):
        select(["preempt"])


# -- issue 36: setup-failed-infra and maintenance ---------------------------------------------


def test_the_infra_scenario_downloads_from_a_name_that_never_resolves() -> None:
    vm = next(v for v in make().vms if v.scenario == "setup-failed-infra")
    steps = json.loads(md(vm.body)["gce-watchdog-bootstrap"])
    assert steps[0][0] == "curl" and steps[0][-1].startswith("https://")
    assert steps[0][-1].split("/")[2].endswith(".invalid")  # RFC 6761: never resolves
    # the maintenance scenario's VM is stopped, not migrated, and not restarted by GCE
    maint = next(v for v in make().vms if v.scenario == "maintenance")
    sched = maint.body["scheduling"]
    assert sched["onHostMaintenance"] == "TERMINATE"  # type: ignore[index]
    assert sched["automaticRestart"] is False  # type: ignore[index]
    assert "compute.instances.simulateMaintenanceEvent" in [p for p, _ in P.PERMISSIONS]


def maintenance_seen() -> Observation:
    return Observation(
        "maintenance", "vm", maintenance_at=100.0, notice_at=101.0, left_running_at=130.0,
        decided_at=131.0, failovers=1, verdict="host_maintenance", final_status="gone",
        deleted=True,
    )  # fmt: skip


def test_maintenance_passes_with_one_failover_and_its_timings() -> None:
    o = maintenance_seen()
    j = judge(SCENARIOS["maintenance"], o)
    assert j.passed, j.evidence
    assert "info: the agent's maintenance notice was read" in j.evidence
    t = o.timings()
    assert t["maintenance_to_left_running_s"] == 30.0 and t["maintenance_to_decision_s"] == 31.0
    # no notice read: shown, not a failure (none is documented for a simulated stop)
    quiet = judge(SCENARIOS["maintenance"], replace(o, notice_at=None))
    assert quiet.passed and any("no maintenance notice" in e for e in quiet.evidence)


@given(
    st.sampled_from(["maintenance_at", "left_running_at", "decided_at"]),
    st.sampled_from(["host_maintenance", "ended_unread", "workload_failed", None]),
    st.integers(0, 3),
)
def test_maintenance_fails_without_the_event_the_stop_the_verdict_or_one_failover(
    missing: str, verdict: str | None, n: int
) -> None:
    o = replace(maintenance_seen(), verdict=verdict, failovers=n)
    assert judge(SCENARIOS["maintenance"], o).passed == (verdict == "host_maintenance" and n == 1)
    setattr(o, missing, None)
    assert not judge(SCENARIOS["maintenance"], o).passed


@given(st.sampled_from(["setup_failed_infra", "setup_failed", "self_shutdown"]), st.integers(0, 3))
def test_setup_failed_infra_needs_its_verdict_and_exactly_one_failover(
    verdict: str, n: int
) -> None:
    o = Observation("setup-failed-infra", "vm", left_running_at=5.0, decided_at=4.0,
                    failovers=n, verdict=verdict, deleted=True)  # fmt: skip
    want = verdict == "setup_failed_infra" and n == 1
    assert judge(SCENARIOS["setup-failed-infra"], o).passed == want


def test_the_agents_maintenance_line_is_observed() -> None:
    from gce_watchdog.wire.protocol import make_event

    o = Observation("maintenance", "vm")
    migrate = make_event(
        "maintenance", "aaaa0001", 3, 5_000, {"event": "MIGRATE_ON_HOST_MAINTENANCE"}
    )
    o.observe_line(migrate)
    assert o.notice_at is None
    stop = make_event(
        "maintenance", "aaaa0001", 4, 7_000, {"event": "TERMINATE_ON_HOST_MAINTENANCE"}
    )
    o.observe_line(stop)
    o.observe_line(
        make_event("maintenance", "aaaa0001", 5, 9_000, {"event": "TERMINATE_ON_HOST_MAINTENANCE"})
    )
    assert o.notice_at == 7.0
