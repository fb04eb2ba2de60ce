"""The metadata fault request (faults/request.py), pure: parsing, the apply-once decision and the
``fault inject`` command line it maps to (checked against the real CLI parser)."""

from __future__ import annotations

import itertools
import json

import pytest
from gce_watchdog.cli import build_parser
from gce_watchdog.faults.plan import Cut
from gce_watchdog.faults.request import (
    KEEP_IDS,
    BadRequest,
    FaultRequest,
    decide,
    inject_argv,
    parse_request,
    remember,
)
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

CUTS = [Cut(*bits) for bits in itertools.product([False, True], repeat=4) if any(bits)]
ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True)


def value(rid: str = "w1", cut: str = "metadata+egress443", ttl: str = "15m") -> str:
    return json.dumps({"id": rid, "cut": cut, "ttl": ttl})


@given(ids, st.sampled_from(CUTS), st.integers(1, 24 * 3600))
def test_a_valid_request_round_trips(rid: str, cut: Cut, ttl: int) -> None:
    req = parse_request(value(rid, cut.label, f"{ttl}s"))
    assert (req.id, req.cut.label, req.ttl) == (rid, cut.label, float(ttl))


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("", "not JSON"),
        ("true", "not a JSON object"),
        ('["metadata"]', "not a JSON object"),
        (value(rid=""), "id must be"),
        (value(rid="a b"), "id must be"),
        (value(rid="x" * 64), "id must be"),
        (value(cut="metadata+ssh"), "unknown cut part"),
        (value(cut="none"), "nothing to cut"),
        (value(ttl="0s"), "--ttl must be between"),
        (value(ttl="3d"), "--ttl must be between"),
        (value(ttl="inf"), None),
        (value(ttl="nan"), None),
        (json.dumps({"id": "a", "cut": "dns", "ttl": 90}), "ttl must be a string"),
        (json.dumps({"id": "a", "cut": "dns", "ttl": "1m", "cmd": "rm"}), "unknown field"),
        ("{" + " " * 2000 + "}", "longer than"),
    ],
)
def test_invalid_requests_are_refused_with_a_reason(raw: str, why: str | None) -> None:
    with pytest.raises(BadRequest, match=why):
        parse_request(raw)


@given(st.text(max_size=200))
def test_any_text_is_a_request_or_a_refusal_never_a_crash(raw: str) -> None:
    try:
        req = parse_request(raw)
    except BadRequest:
        return
    assert req.cut and 1 <= req.ttl <= 24 * 3600


def test_off_by_default_means_never_applied() -> None:
    assert decide(value(), enabled=False, applied=[]).why == "disabled"
    assert not decide(value(), enabled=False, applied=[]).apply


def test_a_request_applies_once() -> None:
    d = decide(value("r1"), enabled=True, applied=[])
    assert d.apply and d.request is not None and d.request.id == "r1"
    assert decide(value("r1"), enabled=True, applied=["r1"]).why == "applied-before"
    assert decide(value("r2"), enabled=True, applied=["r1"]).apply


@pytest.mark.parametrize("raw", [None, "", "  \n"])
def test_an_absent_key_does_nothing(raw: str | None) -> None:
    d = decide(raw, enabled=True, applied=[])
    assert not d.apply and d.why == "absent"


def test_invalid_is_said_not_applied() -> None:
    d = decide("{", enabled=True, applied=[])
    assert not d.apply and d.why.startswith("invalid:")


@given(st.lists(ids, max_size=100), ids)
def test_remember_keeps_the_newest_bounded(applied: list[str], rid: str) -> None:
    out = remember(applied, rid)
    assert out[-1] == rid and out.count(rid) == 1 and len(out) <= KEEP_IDS


@given(st.sampled_from(CUTS), st.integers(1, 24 * 3600))
def test_the_command_is_the_operators_fault_inject(cut: Cut, ttl: int) -> None:
    req = FaultRequest("x", cut, float(ttl))
    argv = inject_argv(req, ["gce-watchdog"], "/etc/gce-watchdog/config.toml")
    assert argv[:3] == ["gce-watchdog", "fault", "inject"]
    args = build_parser().parse_args(argv[1:])
    got = Cut(args.metadata, args.egress443, args.dns, args.metadata_dns)
    assert got.label == cut.label
    assert args.ttl == f"{ttl}s" and args.config == "/etc/gce-watchdog/config.toml"
    assert args.func.__name__ == "cmd_inject"
