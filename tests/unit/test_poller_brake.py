"""The fleet-wide brake: its pure rule (hypothesis), and the ledger holding, listing and
releasing failovers beyond it; the decisions view's details and its gap-free tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from gce_watchdog.poller.brake import BrakeRule, parse_share
from gce_watchdog.poller.decisions import decision_doc, selected
from gce_watchdog.poller.ledger import Decision
from gce_watchdog.poller.ledgers import Ledger, open_ledger
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

shares = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)
fleets = st.integers(min_value=0, max_value=1_000_000)
floors = st.integers(min_value=1, max_value=1000)


@given(shares, fleets, floors, st.integers(min_value=0, max_value=2_000_000))
def test_the_rule_admits_exactly_below_its_allowance(
    share: float, fleet: int, floor: int, recent: int
) -> None:
    rule = BrakeRule(share, 600.0, floor)
    allowed = rule.allowed(fleet)
    assert allowed >= floor  # a real wedge in a small fleet always goes through
    assert allowed <= max(floor, math.ceil(share * fleet))  # never more than the share
    assert rule.admits(recent, fleet) == (recent < allowed)


@given(shares, fleets, fleets, floors)
def test_a_larger_fleet_is_never_allowed_fewer(share: float, a: int, b: int, floor: int) -> None:
    rule = BrakeRule(share, 60.0, floor)
    lo, hi = sorted((a, b))
    assert rule.allowed(lo) <= rule.allowed(hi)


@given(fleets, floors)
def test_a_share_of_all_admits_the_whole_fleet(fleet: int, floor: int) -> None:
    assert BrakeRule(1.0, 60.0, floor).allowed(fleet) == max(floor, fleet)


@pytest.mark.parametrize(
    ("share", "window", "floor"),
    [(0.0, 60.0, 3), (1.5, 60.0, 3), (math.nan, 60.0, 3), (0.1, 0.0, 3), (0.1, math.inf, 3),
     (0.1, 60.0, 0)],
)  # fmt: skip
def test_a_rule_that_cannot_hold_anything_sensible_is_refused(
    share: float, window: float, floor: int
) -> None:
    with pytest.raises(ValueError):
        BrakeRule(share, window, floor)


def test_shares_parse_as_percentages_or_fractions() -> None:
    assert parse_share("10%") == pytest.approx(0.1)
    assert parse_share("0.25") == 0.25
    for bad in ("0", "0%", "150%", "nan", "inf", "ten", ""):
        with pytest.raises(ValueError):
            parse_share(bad)


def claim(led: Ledger, i: int, now: float) -> Decision:
    labels = {"gce-watchdog-job": f"job-{i}"}
    return led.decisions.claim(
        f"id-{i}", f"b{i}", "self_shutdown", "shut down", f"p/z/vm-{i}", now,
        {"labels": labels, "job": labels["gce-watchdog-job"], "evidence": [f"line {i}"]},
    )  # fmt: skip


def test_the_ledger_holds_failovers_beyond_the_share_and_releases_them(tmp_path: Path) -> None:
    """A zone outage: 50 of a 60-VM fleet fail over within the window. 6 (10 %) are decided,
    44 held (no token spent), the held ones stay held when polled again, and a release decides
    each with the next token, so the view stays gap-free."""
    with open_ledger(tmp_path / "l.sqlite", owner="a") as led:
        led.decisions.brake = BrakeRule(0.1, 600.0, 3)
        led.decisions.fleet_size = lambda: 60
        got = [claim(led, i, 1000.0 + i) for i in range(50)]
        won = [d for d in got if d.won]
        held = [d for d in got if d.held]
        assert (len(won), len(held)) == (6, 44)
        assert [d.token for d in won] == [1, 2, 3, 4, 5, 6]
        assert all(d.token == 0 for d in held)
        assert claim(led, 10, 1100.0).held
        holds = led.decisions.holds()
        assert [h.instance_id for h in holds] == [f"id-{i}" for i in range(6, 50)]
        picked, unknown = selected(holds, ["id-7", "p/z/vm-8", "nope"], every=False)
        assert {h.instance_id for h in picked} == {"id-7", "id-8"} and unknown == ["nope"]
        released = [led.decisions.release(h, "operator", 1200.0) for h in picked]
        assert [d.token for d in released] == [7, 8] and all(d.won for d in released)
        assert len(led.decisions.holds()) == 42
        released_all = [led.decisions.release(h, "operator", 1200.0) for h in led.decisions.holds()]
        assert [d.token for d in released_all] == list(range(9, 51))
        # at 1606 the six admitted at 1000..1005 aged out; the 44 released at 1200 would not
        assert claim(led, 60, 1606.0).won  # released ones do not fill the window
        assert not claim(led, 7, 1300.0).won
        rows = led.decisions.details_after(0)
        assert [d.token for d, _ in rows] == list(range(1, 52))  # gap-free, increasing
        doc = decision_doc(*rows[7])
        assert (doc["v"], doc["project"], doc["zone"], doc["name"]) == (2, "p", "z", "vm-8")
        assert doc["job"] == "job-8" and doc["labels"] == {"gce-watchdog-job": "job-8"}
        assert doc["evidence"] == ["line 8"] and doc["request_id"] == rows[7][0].request_id


def test_the_window_slides_and_a_wedge_in_a_healthy_fleet_goes_through(tmp_path: Path) -> None:
    with open_ledger(tmp_path / "l.sqlite", owner="a") as led:
        led.decisions.brake = BrakeRule(0.1, 600.0, 3)
        led.decisions.fleet_size = lambda: 20  # allowed: max(3, 2) = 3
        assert [claim(led, i, 0.0).won for i in range(4)] == [True, True, True, False]
        assert claim(led, 5, 601.0).won  # the first three aged out
        assert [h.instance_id for h in led.decisions.holds()] == [
            "id-3"
        ]  # still held: only a release
