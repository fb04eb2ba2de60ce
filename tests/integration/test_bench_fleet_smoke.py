"""bench/bench_fleet.py cannot rot: its tiny mode end to end (50 polled VMs; 10 VMs on Pub/Sub
with 3 workers).
No timing is asserted: only that every part ran, decided exactly once, and reported numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kit.paths import REPO

pytestmark = pytest.mark.process


def test_bench_fleet_tiny_runs_and_decides_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    argv = [sys.executable, "-m", "bench.bench_fleet", str(out), "--tiny"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    (poll,) = res["polling"]
    assert poll["vms"] == 50 and poll["exactly_once"] and poll["decisions"] == 5
    assert poll["api_calls_per_round"]["serial"] == 50 and poll["round_steady_s"] > 0
    assert poll["decision_latency_s"]["p99"] >= poll["decision_latency_s"]["p50"] > 0
    (ps,) = res["pubsub"]
    if "skipped" not in ps:
        assert ps["workers"] == 3 and ps["exactly_once"] and ps["finished_ended"]
        assert ps["messages_handled"] >= ps["published"] and len(ps["worker_rss_mib"]) == 3
        assert ps["decision_latency_s"]["n"] == ps["decisions"] > 0
        assert len(ps["loadavg_1m"]["samples"]) >= 2 and ps["loadavg_1m"]["max"] >= 0
