"""bench/bench_fleet.py cannot rot: its tiny mode end to end (50 polled VMs; 10 VMs on Pub/Sub
with 3 workers), run as ``make bench`` runs it (bench/run.py's fleet section), its figures
turned into the run's target rows and table.
No timing is asserted: only that every part ran, decided exactly once, and reported numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kit.paths import REPO

sys.path.insert(0, str(REPO))

from bench import report
from bench import run as run_mod

pytestmark = pytest.mark.process


def test_bench_fleet_tiny_runs_and_decides_exactly_once(tmp_path: Path) -> None:
    logged: list[str] = []
    res = run_mod.run_fleet(run_mod.PLANS["tiny"], tmp_path, ["--tiny"], logged.append)
    assert res["rc"] == 0, logged[-20:]
    assert res["args"] == ["--tiny"] and logged  # its progress lines reach the run's log
    (poll,) = res["polling"]
    assert poll["vms"] == 50 and poll["exactly_once"] and poll["decisions"] == 5
    assert poll["api_calls_per_round"]["serial"] == 50 and poll["round_steady_s"] > 0
    assert poll["decision_latency_s"]["p99"] >= poll["decision_latency_s"]["p50"] > 0
    rows = {x["target"]: x for x in report.targets({"fleet": res})}
    assert rows["polling 50 VMs: every wedged VM decided exactly once"]["met"] is True
    steady = rows["polling 50 VMs: steady round (every VM read once)"]
    assert steady["measured"] == poll["round_steady_s"]
    table = report.t_fleet({"fleet": res})
    assert "polling, 50 VMs" in table and "--tiny" in table
    (ps,) = res["pubsub"]
    if "skipped" in ps:
        assert f"skipped: {ps['skipped']}" in table
        return
    assert ps["workers"] == 3 and ps["exactly_once"] and ps["finished_ended"]
    assert ps["messages_handled"] >= ps["published"] and len(ps["worker_rss_mib"]) == 3
    assert ps["decision_latency_s"]["n"] == ps["decisions"] > 0
    assert len(ps["loadavg_1m"]["samples"]) >= 2 and ps["loadavg_1m"]["max"] >= 0
    assert ps["publish_rate_per_s"] == report.TARGET_PUBSUB_RATE  # the target's rate by default
    once = rows["Pub/Sub 10 VMs: every wedged VM decided exactly once, no finished or healthy VM,"
                " the whole stream handled"]  # fmt: skip
    assert once["met"] is True and once["measured"] == f"{ps['decisions']} of {ps['wedged']}"
    (p99,) = [r for k, r in rows.items() if k.startswith("Pub/Sub 10 VMs, 3 workers, 1,200")]
    assert p99["measured"] == ps["decision_latency_s"]["p99"]
    assert "Pub/Sub, 10 VMs, 3 workers" in table
