"""What it cost in the decisions view and on ``GET /metrics`` (issue 37.4), on both ledger
backends: each decision carries its boot's cost (the reap adds the zombie time), ``job_cost``
sums a job's boots across two failovers without counting one twice, and the counters are the
ledger's totals. The process test: ``poll`` records a wedge's facts from the fake Compute API
(the machine type's GPUs), ``decisions --json`` shows them, ``GET /metrics`` counts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.lib.health import HealthServer, Liveness
from gce_watchdog.poller.cost import BootFacts, Cost
from gce_watchdog.poller.decisions import all_rows, cost_metrics, follow, poller_metrics
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import T0_MS, Writer
from kit.paths import REPO
from kit.schemas import validate
from prometheus_client.parser import text_string_to_metric_families

T0 = 1_700_000_000.0
ENV = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
P, Z = "test-project", "us-central1-a"

# The job of tests/unit/test_cost.py: A wedged (ladder 800..900, linger 900..1000), B preempted,
# C clean; 1 GPU each. A is reaped at 1200, B at 2050, C at 3010 (the ledger's reap time).
A = BootFacts("A", "a1", T0, T0 + 1000, T0 + 700, T0 + 800, T0 + 900, None, 1, "a2-highgpu-1g")
B = BootFacts("B", "b1", T0 + 1100, T0 + 2000, T0 + 1900, None, None, None, 1, "a2-highgpu-1g")
C = BootFacts("C", "c1", T0 + 2100, T0 + 3000, T0 + 2990, None, None, None, 1, "a2-highgpu-1g")
REAPED = {"A": T0 + 1200, "B": T0 + 2050, "C": T0 + 3010}
JOB = Cost(billed=2800, useful=2390, ladder=100, linger=100, zombie=260, gpu=2800)


def _claim_the_job(spec: str) -> None:
    with open_ledger(spec) as led:
        for i, f in enumerate((A, B, C)):
            details = {"labels": {}, "job": "job-1", "evidence": [], "cost": f.to_json()}
            led.decisions.claim(f.instance, f.boot, "suspected_wedge", "r", f"p/z/{f.instance}",
                                T0 + 1000 * (i + 1), details)  # fmt: skip
            led.decisions.mark_reaped(f.instance, f.boot, "op", REAPED[f.instance])
        # another job, and a decision an older poller recorded without cost facts
        other = BootFacts("D", "d1", T0, T0 + 50, gpus=8)
        led.decisions.claim("D", "d1", "preempted", "r", "p/z/D", T0 + 5000,
                            {"job": "job-2", "cost": other.to_json()})  # fmt: skip
        led.decisions.claim("E", "e1", "preempted", "r", "p/z/E", T0 + 6000, {"job": "job-1"})


@pytest.mark.process
def test_the_view_carries_each_boots_cost_and_its_jobs_sum(ledger_spec: str) -> None:
    _claim_the_job(ledger_spec)
    with open_ledger(ledger_spec) as led:
        docs: list[dict[str, Any]] = []
        follow(led.decisions, 0, docs.append, threading.Event(), keep_following=False)
        later: list[dict[str, Any]] = []  # resuming after token 2 still counts A and B
        follow(led.decisions, 2, later.append, threading.Event(), keep_following=False)
        rows = all_rows(led.decisions)
    for doc in docs:
        validate("decisions", doc)
    cost = [d["cost"] for d in docs]
    assert {k: v for k, v in cost[0].items() if k.endswith("_seconds")} == {
        "billed_seconds": 1000, "useful_seconds": 700, "ladder_seconds": 100,
        "linger_seconds": 100, "zombie_seconds": 200, "gpu_seconds": 1000,
    }  # fmt: skip
    assert cost[0]["deleted"] == "2023-11-14T22:33:20Z"  # T0 + 1200: the reap
    assert docs[2]["job_cost"] == JOB.to_json()  # two failovers: three boots, each once
    assert later[0]["job_cost"] == JOB.to_json()
    assert docs[1]["job_cost"] == Cost(1900, 1500, 100, 100, 250, 1900).to_json()
    assert docs[3]["job_cost"] == Cost(50, 0, 0, 0, 0, 400).to_json()  # job-2 alone
    assert docs[4]["cost"] is None and docs[4]["job_cost"] == JOB.to_json()  # nothing to add
    text = cost_metrics(rows)
    got = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)}
    assert all(f.type == "counter" for f in text_string_to_metric_families(text))
    # the ledger's totals: job-1 and job-2 (different instances) add up
    assert got["gce_watchdog_poller_cost_billed_seconds"] == 2850
    assert got["gce_watchdog_poller_cost_zombie_seconds"] == 260
    assert got["gce_watchdog_poller_cost_gpu_seconds"] == 2800 + 400


@pytest.mark.process
def test_poll_records_a_wedges_cost_and_metrics_show_it(tmp_path: Path) -> None:
    spec = str(tmp_path / "ledger.sqlite")
    (tmp_path / "tok").write_text("tok\n")
    w = Writer(boot="0000000a")
    dump = w.line("phase", {"ph": "workload"}, step_ms=600_000)  # T0 .. progress at 600 s
    dump += w.line("progress", {"step": "7"}, step_ms=60_000)
    dump += w.line("tick", {"rung": "1/2", "md": "fail/timeout/5001"}, step_ms=30_000)
    dump += w.line("shutdown", {"reason": "ladder", "rung": "2/2"}, "off", step_ms=30_000)
    dump += w.line("shutdown", {"reason": "ladder", "rung": "2/2", "rep": "1"})
    with FakeComputeAPI(token="tok") as api:
        inst = api.add_instance("vm-1", project=P, zone=Z, labels={"gce-watchdog-job": "j"})
        inst.machine_type = "a3-highgpu-8g"
        api.append_serial("vm-1", dump)
        argv = [
            sys.executable, "-m", "gce_watchdog", "poll", "--project", P, "--zone", Z,
            "--api-base", api.base_url, "--access-token-file", str(tmp_path / "tok"),
            "--ledger", spec, "--cursor-dir", str(tmp_path / "c"), "--json", "--once",
            "--brake", "off", "vm-1",
        ]  # fmt: skip
        r = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["action"] == "failover", r.stdout  # decided while it runs
    out = subprocess.run(
        [sys.executable, "-m", "gce_watchdog", "decisions", "--ledger", spec, "--json"],
        capture_output=True, text=True, env=ENV, timeout=120, check=True,
    )  # fmt: skip
    (doc,) = [json.loads(line) for line in out.stdout.splitlines()]
    validate("decisions", doc)
    c = doc["cost"]
    # billed T0 .. the last line at 720 s (still running: as far as seen); useful to the
    # progress at 600 s; ladder 660..690 (the failing rung, the decision); linger 690..720 (the
    # repeated verdict); not reaped: no zombie; 8 GPUs from the machine type
    assert (c["gpus"], c["machine_type"]) == (8, "a3-highgpu-8g")
    assert c["start"] == "2025-11-30T03:58:14Z" and T0_MS == 1_764_475_094_000
    secs = [c[f"{k}_seconds"] for k in ("billed", "useful", "ladder", "linger", "zombie", "gpu")]
    assert secs == [720, 600, 30, 30, 0, 5760]
    assert doc["job_cost"]["billed_seconds"] == 720
    with open_ledger(spec) as led:
        decisions = led.decisions
        server = HealthServer(Liveness(60.0), "127.0.0.1", 0, lambda: poller_metrics(decisions))
        with (
            server as srv,
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as resp,
        ):
            text = resp.read().decode()
    got = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)}
    assert "gce_watchdog_poller_decisions" in got  # the delivery gauge is still there
    assert got["gce_watchdog_poller_cost_gpu_seconds"] == 5760
    assert got["gce_watchdog_poller_cost_ladder_seconds"] == 30


@pytest.mark.pure
def test_the_apis_start_and_stop_and_accelerators_win() -> None:
    from gce_watchdog.lib.compute import InstanceStatus, instance_cost_fields, last_start_of
    from gce_watchdog.poller.poller import decided_boot_facts
    from gce_watchdog.poller.timeline import Timeline

    body = {
        "machineType": "zones/us-central1-a/machineTypes/n1-standard-8",
        "guestAccelerators": [{"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 2}],
        "lastStartTimestamp": "2025-11-29T19:57:14.000-08:00",  # T0 - 60 s, another offset
        "lastStopTimestamp": "2025-11-30T04:09:14Z",  # T0 + 660 s
    }
    fields = instance_cost_fields(body) | {"last_start": last_start_of(body)}
    assert fields == {
        "machine_type": "n1-standard-8",
        "accelerators": 2,
        "last_start": T0_MS / 1000 - 60,
        "last_stop": T0_MS / 1000 + 660,
    }
    w = Writer(boot="0000000b")
    tl = Timeline()
    tl.feed(w.line("phase", {"ph": "workload"}, step_ms=600_000) + w.line("progress", {}))
    info = InstanceStatus("vm", "1", "TERMINATED", True, **fields)
    f = decided_boot_facts("1", tl, info, "0000000b", now=T0_MS / 1000 + 5000)
    assert f is not None
    assert (f.start, f.end, f.useful_end, f.gpus) == (
        T0_MS / 1000 - 60, T0_MS / 1000 + 660, T0_MS / 1000 + 600, 2,
    )  # fmt: skip
    running = InstanceStatus("vm", "1", "RUNNING", True, **fields)  # its old stop: not this one
    g = decided_boot_facts("1", tl, running, "0000000b", now=T0_MS / 1000 + 5000)
    assert g is not None and g.end == T0_MS / 1000 + 600  # as far as its last line
