"""The one time format of --json output (lib/jsontime.py, docs/json.md): properties."""

from __future__ import annotations

import re
from datetime import datetime

import pytest
from gce_watchdog.lib import jsontime
from gce_watchdog.wire.protocol import format_ts, parse_ts
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

# 1970 .. 9999: what an RFC 3339 four-digit year holds
MS = st.integers(min_value=0, max_value=253_402_300_799_999)


@given(MS)
def test_milliseconds_are_written_as_the_wire_writes_a_line_time(ms: int) -> None:
    s = jsontime.from_ms(ms)
    assert s == format_ts(ms) and parse_ts(s) == ms
    assert re.match(jsontime.PATTERN, s)


@given(st.floats(min_value=0, max_value=253_402_300_799, allow_nan=False), st.booleans())
def test_epoch_seconds_round_trip_to_the_microsecond(t: float, fraction: bool) -> None:
    s = jsontime.from_epoch(t, fraction=fraction)
    assert re.match(jsontime.PATTERN, s) and s.endswith("Z")
    back = datetime.fromisoformat(s).timestamp()
    assert abs(back - t) < (1e-5 if fraction else 1.0)


def test_times_renames_and_converts_only_time_fields() -> None:
    doc = {"ts_ms": 1_000, "first_rx": None, "last_rx": 2.5, "latency_ms": 7, "end": "open"}
    assert jsontime.times(doc) == {
        "ts": "1970-01-01T00:00:01.000Z",
        "first_received": None,
        "last_received": "1970-01-01T00:00:02.500000Z",
        "latency_ms": 7,  # a duration, not a time
        "end": "open",
    }
