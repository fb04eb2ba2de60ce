"""A decision's delivery has a state (issue 39.3), on both ledger backends.

``poll --on-failover CMD`` whose CMD exits 3 on every attempt: the decision is ``failed`` with
its attempts and the last error, in the ledger and in the decisions view (v2), and ``poll``
exits 75 (EX_TEMPFAIL). A later ``poll`` with CMD fixed delivers it, exactly once (CMD's runs
are counted), and exits 0; a third delivers nothing. ``GET /metrics`` counts the states.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.lib.cli import EX_OK, EX_TEMPFAIL
from gce_watchdog.lib.health import HealthServer, Liveness
from gce_watchdog.poller.decisions import delivery_metrics
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer
from kit.paths import REPO
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
TIMEOUT_S = 120  # one poll: 3 failing attempts and their back-off (1 s, 2 s) take about 3 s
ENV = {**os.environ, "PYTHONPATH": str(REPO / "agent")}

# The dispatcher: counts its runs, then exits with the status the test put in its state dir.
HOOK = """
import json, os, sys

state = sys.argv[1]
doc = json.load(sys.stdin)
with open(os.path.join(state, "calls"), "a") as f:
    f.write(os.environ["GCE_WATCHDOG_TOKEN"] + " " + doc["delivery"] + "\\n")
sys.exit(int(open(os.path.join(state, "rc")).read()))
"""


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        yield a


def _poll(api: FakeComputeAPI, tmp: Path, ledger: str) -> subprocess.CompletedProcess[str]:
    hook = f"{sys.executable} {tmp / 'hook.py'} {tmp}"
    argv = [
        sys.executable, "-m", "gce_watchdog", "poll", "--project", P, "--zone", Z,
        "--api-base", api.base_url, "--access-token-file", str(tmp / "tok"),
        "--ledger", ledger, "--cursor-dir", str(tmp / "cursors"), "--json", "--once",
        "--brake", "off", "--on-failover", hook, "vm-1",
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=TIMEOUT_S)


def _decisions(ledger: str, *extra: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "gce_watchdog", "decisions", "--ledger", ledger, *extra],
        capture_output=True, text=True, env=ENV, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def _view(ledger: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in _decisions(ledger, "--json").splitlines()]


def _calls(tmp: Path) -> list[str]:
    path = tmp / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_a_failed_delivery_is_failed_then_delivered_exactly_once_by_a_later_poll(
    api: FakeComputeAPI, tmp_path: Path, ledger_spec: str
) -> None:
    (tmp_path / "hook.py").write_text(textwrap.dedent(HOOK))
    (tmp_path / "tok").write_text("tok\n")
    api.add_instance("vm-1", project=P, zone=Z, labels={"gce-watchdog-job": "job-1"})
    w = Writer(boot="0000000a")
    api.append_serial(
        "vm-1",
        w.line("phase", {"ph": "workload"})
        + w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "10/10: shutting down"),
    )

    (tmp_path / "rc").write_text("3")  # the hook fails on every attempt
    first = _poll(api, tmp_path, ledger_spec)
    assert first.returncode == EX_TEMPFAIL, first.stderr
    assert _calls(tmp_path) == ["1 pending"] * 3  # its three attempts
    with open_ledger(ledger_spec) as led:
        (d,) = led.decisions.all()
        assert led.decisions.delivery_counts() == {"pending": 0, "delivered": 0, "failed": 1}
    assert (d.delivery, d.delivery_attempts, d.announced_at) == ("failed", 3, None)
    assert d.delivery_error is not None and "exit status 3" in d.delivery_error
    (doc,) = _view(ledger_spec)
    assert doc["v"] == 2
    assert (doc["delivery"], doc["delivery_attempts"]) == ("failed", 3)
    assert "exit status 3" in str(doc["delivery_error"])
    assert _decisions(ledger_spec).split()[-1] == "delivery=failed/3"  # the operator's line

    (tmp_path / "rc").write_text("0")  # the dispatcher is fixed
    second = _poll(api, tmp_path, ledger_spec)
    assert second.returncode == EX_OK, second.stderr
    assert _calls(tmp_path) == ["1 pending"] * 3 + ["1 failed"]  # retried once, delivered
    (doc,) = _view(ledger_spec)
    assert (doc["delivery"], doc["delivery_attempts"], doc["delivery_error"]) == (
        "delivered", 4, None,
    )  # fmt: skip

    third = _poll(api, tmp_path, ledger_spec)
    assert third.returncode == EX_OK, third.stderr
    assert len(_calls(tmp_path)) == 4  # delivered exactly once: never run again
    with open_ledger(ledger_spec) as led:
        assert led.decisions.delivery_counts() == {"pending": 0, "delivered": 1, "failed": 0}


def test_the_delivery_states_are_a_prometheus_gauge_on_get_metrics() -> None:
    counts = {"pending": 2, "delivered": 5, "failed": 1}
    server = HealthServer(Liveness(60.0), "127.0.0.1", 0, lambda: delivery_metrics(counts))
    with server as srv:
        url = f"http://127.0.0.1:{srv.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
    (family,) = text_string_to_metric_families(text)  # the reference parser, as an oracle
    assert family.name == "gce_watchdog_poller_decisions" and family.type == "gauge"
    got = {s.labels["delivery"]: s.value for s in family.samples}
    assert got == {"pending": 2.0, "delivered": 5.0, "failed": 1.0}
