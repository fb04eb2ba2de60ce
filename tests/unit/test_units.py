"""lib/durations and lib/sizes: the one parser for every duration and size, by example and by
property (the formatter's output always parses back to the same value)."""

from __future__ import annotations

import pytest
from gce_watchdog.lib.durations import format_duration, parse_duration
from gce_watchdog.lib.sizes import GIB, format_size, parse_size
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("1h30m", 5400.0),
        ("2m 30s", 150.0),
        ("1d12h", 129_600.0),
        ("1h0m5s", 3605.0),
        ("1.5h", 5400.0),
        ("1m500ms", 60.5),
        ("90", 90.0),
        (" 10m ", 600.0),
    ],
)
def test_compound_durations(raw: str, want: float) -> None:
    assert parse_duration(raw) == pytest.approx(want)


@pytest.mark.parametrize(
    "raw", ["30m1h", "1h1h", "1h 30", "1h30mx", "ms", "", "1 h 3", "-5m", float("inf"), -1]
)
def test_bad_durations_are_refused_with_the_accepted_forms(raw: object) -> None:
    with pytest.raises(ValueError, match=r"1h30m|>= 0"):
        parse_duration(raw)


@pytest.mark.parametrize(
    ("secs", "text"),
    [(0, "0s"), (30, "30s"), (0.5, "500ms"), (1.5, "1.5s"), (5400, "1h30m"), (86_400, "1d")],
)
def test_format_duration(secs: float, text: str) -> None:
    assert format_duration(secs) == text


@given(st.integers(min_value=0, max_value=10**12))
def test_format_duration_round_trips_whole_milliseconds(ms: int) -> None:
    secs = ms / 1000
    assert parse_duration(format_duration(secs)) == pytest.approx(secs, rel=1e-12, abs=1e-9)


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False))
def test_format_duration_round_trips_any_float(secs: float) -> None:
    assert parse_duration(format_duration(secs)) == pytest.approx(secs, rel=1e-9, abs=1e-9)


_UNIT_S = {"d": 86_400, "h": 3600, "m": 60, "s": 1}


@given(
    st.lists(st.integers(min_value=0, max_value=999), min_size=4, max_size=4),
    st.lists(st.booleans(), min_size=4, max_size=4),
    st.sampled_from(["", " "]),
)
def test_any_ordered_compound_parses_to_its_sum(ns: list[int], use: list[bool], sep: str) -> None:
    parts = [
        (n, u) for (n, u), keep in zip(zip(ns, _UNIT_S, strict=True), use, strict=True) if keep
    ]
    if not parts:
        return
    text = sep.join(f"{n}{u}" for n, u in parts)
    assert parse_duration(text) == sum(n * _UNIT_S[u] for n, u in parts)


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("1GiB", GIB),
        ("1.5GiB", GIB * 3 // 2),
        ("512MiB", 512 << 20),
        ("512M", 512 << 20),
        ("2GB", 2 * 10**9),
        ("4096B", 4096),
        ("1 gib", GIB),
    ],
)
def test_sizes(raw: str, want: int) -> None:
    assert parse_size(raw) == want


@pytest.mark.parametrize("raw", ["1.5", "4096", 1.5, 2])
def test_a_bare_number_is_refused_and_the_unit_suggested(raw: object) -> None:
    with pytest.raises(ValueError, match=r"needs a unit.*GiB"):
        parse_size(raw)


@pytest.mark.parametrize("raw", ["1XB", "GiB", "", "-1GiB", True])
def test_bad_sizes(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_size(raw)


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_size_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n
