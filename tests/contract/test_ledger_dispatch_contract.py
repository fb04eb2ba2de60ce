"""The decisions interface's tables on both backends: details written with the claim, the
brake's holds and releases, gap-free tokens across holds and releases."""

from __future__ import annotations

from pathlib import Path

import pytest
from gce_watchdog.poller.brake import BrakeRule
from gce_watchdog.poller.decisions import decision_doc
from gce_watchdog.poller.ledgers import open_ledger

pytestmark = pytest.mark.process


@pytest.fixture(params=["sqlite", "postgres"])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "ledger.sqlite")
    return str(request.getfixturevalue("pg_database"))


def test_holds_releases_and_details_on_both_backends(spec: str) -> None:
    with open_ledger(spec, owner="a") as led:
        led.decisions.brake = BrakeRule(0.1, 600.0, 3)
        led.decisions.fleet_size = lambda: 20  # allowed: 3 per window
        got = [
            led.decisions.claim(f"id-{i}", "b", "preempted", "r", f"p/z/vm-{i}", 100.0 + i,
                      {"labels": {"gce-watchdog-job": f"j{i}"}, "job": f"j{i}", "evidence": ["e"]})
            for i in range(5)
        ]  # fmt: skip
        assert [d.won for d in got] == [True, True, True, False, False]
        assert [d.held for d in got] == [False, False, False, True, True]
        assert [h.instance_id for h in led.decisions.holds()] == ["id-3", "id-4"]
        (hold,) = [h for h in led.decisions.holds() if h.instance_id == "id-4"]
        d = led.decisions.release(hold, "operator", 200.0)
        assert d.won and d.token == 4
        assert [h.instance_id for h in led.decisions.holds()] == ["id-3"]
    with open_ledger(spec, owner="b") as led:  # another poller: same view, brake off
        rows = led.decisions.details_after(2)
        assert [r[0].token for r in rows] == [3, 4]
        doc = decision_doc(*rows[-1])
        assert (doc["name"], doc["job"], doc["labels"]) == (
            "vm-4",
            "j4",
            {"gce-watchdog-job": "j4"},
        )
        assert led.decisions.claim("id-3", "b", "preempted", "r", "p/z/vm-3", 300.0).token == 5
        assert (
            led.decisions.holds() == []
        )  # decided since (that poller had no brake): not held any more
