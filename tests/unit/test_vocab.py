"""The event vocabulary (wire/vocab): names match the specification, codecs are inverses, fitting
keeps every line within MAX_LINE."""

from __future__ import annotations

import re

import pytest
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.wire import protocol, vocab
from hypothesis import given
from hypothesis import strategies as st
from kit.paths import REPO

pytestmark = pytest.mark.pure

SPEC = REPO / "docs" / "serial-protocol.md"
_REASON = st.from_regex(r"[a-z_0-9]{1,20}", fullmatch=True)


def test_every_event_name_is_in_the_specification_and_back() -> None:
    spec = SPEC.read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)`", spec, re.M))
    assert documented >= vocab.ALL_EVENTS, vocab.ALL_EVENTS - documented
    names = {v for k, v in vars(vocab).items() if k.isupper() and isinstance(v, str)}
    assert names & documented == vocab.ALL_EVENTS


def test_event_sets_are_made_of_known_events() -> None:
    for s in (vocab.VERDICT_EVENTS, vocab.MARKER_EVENTS, vocab.HIGHLIGHT_EVENTS):
        assert s <= vocab.ALL_EVENTS
    assert vocab.VERDICT_EVENTS <= vocab.MARKER_EVENTS


@given(st.sampled_from(["ok", "fail", "unknown"]), _REASON, st.integers(0, 10**6))
def test_probe_field_roundtrip(verdict: str, reason: str, ms: int) -> None:
    raw = vocab.encode_probe(verdict, reason, ms)
    pf = vocab.decode_probe(raw)
    assert (pf.verdict, pf.reason, pf.latency_ms) == (verdict, reason, ms)
    # and it is a valid field value on the wire
    ev = protocol.make_event(vocab.TICK, "0" * 8, 1, 0, {"md": raw})
    decoded = protocol.decode_line(protocol.encode(ev, SYNTH_KEY), pin=SYNTH_KEY.public)
    assert isinstance(decoded, protocol.Event) and decoded.get("md") == raw


def test_bare_verdict_of_older_writers() -> None:
    pf = vocab.decode_probe("fail")
    assert (pf.verdict, pf.reason, pf.latency_ms) == ("fail", "", None)


@given(
    st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True),
        st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True),
        max_size=5,
    ),
    st.text(max_size=400),
)
def test_fit_text_keeps_the_line_within_max_line(fields: dict[str, str], text: str) -> None:
    fitted = vocab.fit_text(vocab.SETUP_FAILED, fields, text)
    ev = protocol.make_event(vocab.SETUP_FAILED, "f" * 8, 10**12, 0, fields, fitted)
    assert len(protocol.encode(ev, SYNTH_KEY)) <= protocol.MAX_LINE
    assert ev.text == fitted  # never dropped by make_event: it fits
    clean = protocol.sanitize_text(text)
    assert fitted == clean or fitted.endswith("...") or fitted == ""


@given(st.integers(0, 10**6), st.integers(1, 10**6))
def test_rung_field_roundtrip(rung: int, threshold: int) -> None:
    assert vocab.decode_rung(vocab.encode_rung(rung, threshold)) == (rung, threshold)


def test_malformed_rungs_are_none() -> None:
    for raw in (None, "", "3", "3/", "/10", "a/10", "3/10/2", "-1/10", "3 /10"):
        assert vocab.decode_rung(raw) is None, raw
