"""The pure climb detector: scenario table and properties over generated series."""

from __future__ import annotations

import random

import pytest
from gce_watchdog.memory import GIB, MIB
from gce_watchdog.memory.detector import (
    ClimbVerdict,
    DetectorParams,
    Status,
    clean,
    detect,
    mann_kendall,
    theil_sen,
)
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

P = DetectorParams()  # warm-up 10, window 30, band 1 GiB, alpha 0.01
PERIOD = 30.0  # the agent's default sampling period


def _series(values: list[float], period: float = PERIOD) -> list[tuple[float, float]]:
    return [(i * period, v) for i, v in enumerate(values)]


def _flat_noise(n: int, seed: int, level: float = 20 * GIB, sd: float = 0.08 * GIB) -> list[float]:
    r = random.Random(seed)
    return [level + max(-0.4 * GIB, min(0.4 * GIB, r.gauss(0, sd))) for _ in range(n)]


def _incident(n: int = 480, seed: int = 1) -> list[float]:
    """The real incident: reserved GPU memory from 22 to 38 GiB, with allocator noise."""
    r = random.Random(seed)
    return [22 * GIB + 16 * GIB * i / (n - 1) + r.gauss(0, 0.05 * GIB) for i in range(n)]


def _sawtooth(n: int, height: float, tooth: int = 10) -> list[float]:
    return [20 * GIB + height * (i % tooth) / (tooth - 1) for i in range(n)]


def _step(n: int, at: int, jump: float, seed: int) -> list[float]:
    base = _flat_noise(n, seed, sd=0.05 * GIB)
    return [v + (jump if i >= at else 0.0) for i, v in enumerate(base)]


CASES = [
    ("flat with noise", _flat_noise(120, 3), Status.PASS),
    ("22 -> 38 GiB climb", _incident(), Status.CLIMB),
    ("sawtooth within 0.8 GiB", _sawtooth(200, 0.8 * GIB), Status.PASS),
    ("sawtooth, tooth longer than the window", _sawtooth(60, 0.8 * GIB, tooth=45), Status.PASS),
    ("step up then flat", _step(120, 60, 4 * GIB, 5), Status.STEP),
    ("step down then flat", _step(120, 40, -3 * GIB, 6), Status.STEP),
    ("fewer samples than the window", _flat_noise(39, 7), Status.NOT_ENOUGH_DATA),
    ("wide sawtooth is out of band but no climb", _sawtooth(200, 3 * GIB), Status.UNSTABLE),
    (
        "step then a leak is a climb",
        _step(120, 30, 2 * GIB, 8)[:30] + [22 * GIB + i * 0.05 * GIB for i in range(90)],
        Status.CLIMB,
    ),
    (
        "staircase of small steps is a climb",
        [20 * GIB + (i // 8) * 0.3 * GIB for i in range(160)],
        Status.CLIMB,
    ),
]


@pytest.mark.parametrize(("name", "values", "want"), CASES, ids=[c[0] for c in CASES])
def test_scenarios(name: str, values: list[float], want: Status) -> None:
    v = detect(_series(values), P)
    assert v.status is want, v.reason


def test_incident_fails_early_with_numbers() -> None:
    values = _incident()
    series = _series(values)
    first = next(k for k in range(1, len(series) + 1) if detect(series[:k], P).status == "climb")
    # 16 GiB over 480 samples is 1 GiB per 30 samples: the band is crossed right after the first
    # full window, so the climb is reported within the first 10% of the run.
    assert first <= 48, first
    v = detect(series, P, capacity=40 * GIB)
    assert v.status is Status.CLIMB
    # 16 GiB over 479 x 30 s = 0.0668 GiB/min
    assert v.slope_gib_per_min == pytest.approx(16 / (479 * 0.5), rel=0.03)
    assert v.samples == 470
    assert v.seconds_to_full is not None
    # 2 GiB left at 0.0668 GiB/min is about 30 min.
    assert 1500 < v.seconds_to_full < 2100
    assert v.p_value < 1e-10


def test_not_enough_data_is_never_pass_or_fail() -> None:
    v = detect(_series([float(i) * GIB for i in range(39)]), P)
    assert v.status is Status.NOT_ENOUGH_DATA
    assert v.samples == 29
    assert "29 of 30" in v.reason


def test_step_reports_jump_and_time() -> None:
    v = detect(_series(_step(120, 60, 4 * GIB, 9)), P)
    assert v.status is Status.STEP
    assert v.step_bytes == pytest.approx(4 * GIB, rel=0.05)
    assert v.step_at_s == pytest.approx(60 * PERIOD, abs=2 * PERIOD)


def test_one_spike_does_not_make_a_climb() -> None:
    values = _flat_noise(100, 11, sd=0.02 * GIB)
    values[70] += 5 * GIB
    v = detect(_series(values), P)
    assert v.status is Status.UNSTABLE  # out of band (range), but neither a climb nor a step
    assert abs(v.slope_gib_per_min) < 0.001


def test_long_series_is_binned_and_still_right() -> None:
    r = random.Random(2)
    values = [20 * GIB + i * 200 * 1024 + r.gauss(0, 50 * MIB) for i in range(20_000)]
    v = detect(_series(values, 1.0), P)
    assert v.status is Status.CLIMB
    assert v.samples == 19_990
    assert v.slope_bytes_per_s == pytest.approx(200 * 1024, rel=0.05)


def test_bad_samples_are_dropped_not_raised() -> None:
    good = _series(_flat_noise(40, 1))
    bad: list[tuple[float, float]] = [
        (1.0, float("nan")),
        (float("inf"), 1.0),
        ("x", 2.0),  # type: ignore[list-item]
    ]
    assert len(clean(bad + good)) == 40
    assert detect(bad + good, P).status is Status.PASS
    # unsorted input is sorted by time
    assert detect(list(reversed(good)), P).status is Status.PASS


def test_params_are_validated_loudly() -> None:
    with pytest.raises(ValueError, match="window must be >= 10") as ei:
        DetectorParams(window=3, band=-1, alpha=0.7)
    assert "band must be > 0" in str(ei.value)
    assert "alpha must be in" in str(ei.value)


def test_verdict_to_dict_is_json_ready() -> None:
    import json

    d = detect(_series(_incident(100)), P, capacity=40 * GIB).to_dict()
    again = json.loads(json.dumps(d))
    assert again["status"] == "climb"
    assert again["samples_used"] == 90
    assert again["seconds_to_full"] > 0


def test_statistics_against_known_values() -> None:
    # Strictly increasing n=10: S = 45, var = 10*9*25/18 = 125, z = 44/sqrt(125) = 3.9355
    z, p = mann_kendall(list(range(10)))
    assert z == pytest.approx(44 / 125**0.5)
    assert p < 1e-4
    assert mann_kendall([5.0] * 20) == (0.0, 1.0)
    slope, icpt = theil_sen([0, 1, 2, 3, 4], [1, 3, 5, 7, 100])
    assert slope == 2.0
    assert icpt == 1.0


# --- properties ---------------------------------------------------------------------------------

_n = st.integers(min_value=P.warmup + P.window, max_value=160)


@given(
    n=_n,
    base=st.integers(min_value=0, max_value=2**40),
    scale=st.floats(min_value=1.0, max_value=50.0),
    data=st.data(),
)
def test_steady_strictly_increasing_out_of_band_is_climb(
    n: int, base: int, scale: float, data: st.DataObject
) -> None:
    # "Steady": increments within a factor of 2 of each other. A strictly increasing series whose
    # rise sits in a few samples is a step (or unstable), by design: see docs/memory-watch.md.
    unit = P.band / (P.window - 1) / 2 * scale
    incs = data.draw(st.lists(st.floats(1.0, 2.0), min_size=n - 1, max_size=n - 1))
    values = [float(base)]
    for k in incs:
        values.append(values[-1] + k * unit)
    if values[-1] - values[P.warmup] <= P.band:
        return
    assert detect(_series(values), P).status is Status.CLIMB


@given(n=st.integers(0, 200), level=st.integers(0, 2**44))
def test_constant_series_passes_or_needs_data(n: int, level: int) -> None:
    v = detect(_series([float(level)] * n), P)
    want = Status.PASS if n >= P.warmup + P.window else Status.NOT_ENOUGH_DATA
    assert v.status is want
    assert v.range_bytes == 0


@given(
    values=st.lists(
        st.integers(min_value=0, max_value=64 * GIB).map(float), min_size=0, max_size=120
    ),
    offset=st.integers(min_value=-(2**30), max_value=2**40),
)
def test_constant_offset_does_not_change_the_verdict(values: list[float], offset: int) -> None:
    # Integer-valued bytes and offsets keep float arithmetic exact below 2^53.
    a = detect(_series(values), P)
    b = detect(_series([v + offset for v in values]), P)
    assert a.status is b.status
    assert a.range_bytes == b.range_bytes


@given(
    values=st.lists(st.floats(min_value=0, max_value=1e12), min_size=0, max_size=120),
    period=st.floats(min_value=0.01, max_value=3600),
)
def test_any_finite_series_gets_a_verdict_with_consistent_numbers(
    values: list[float], period: float
) -> None:
    v = detect(_series(values, period), P)
    assert isinstance(v, ClimbVerdict)
    assert v.samples == max(0, len(values) - P.warmup)
    if v.status is Status.NOT_ENOUGH_DATA:
        assert v.samples < P.window
    else:
        assert v.range_bytes == v.max_bytes - v.min_bytes
        assert (v.status is Status.PASS) == (v.range_bytes < P.band)
        assert 0.0 <= v.p_value <= 1.0


@given(seed=st.integers(0, 10_000), sd=st.floats(0.0, 0.12))
def test_noise_within_band_never_alarms(seed: int, sd: float) -> None:
    v = detect(_series(_flat_noise(80, seed, sd=sd * GIB)), P)
    assert v.status is Status.PASS
