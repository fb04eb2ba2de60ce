"""The stuck rule (job/stuck.py, pure): windows, "flat" CPU, GPU idleness, steps; properties and a
soak of jittered steps over many windows."""

from __future__ import annotations

import itertools
import random

import pytest
from gce_watchdog.job import stuck
from gce_watchdog.job.stuck import Observation, Windows, advance, cpu_flat, decide
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

TICK = 5.0  # the agent samples the tree once per heartbeat (a 5 s interval in these tests)


def _cpu(t0: float, t1: float, rate: float, base: float = 100.0) -> list[tuple[float, float]]:
    """Samples every TICK from t0 to t1 of a tree using ``rate`` cores."""
    out, t = [], t0
    while t <= t1 + 1e-9:
        out.append((t, base + rate * (t - t0)))
        t += TICK
    return out


def test_no_window_is_never_stuck() -> None:
    for step, quiet in itertools.product((None, 3), (0.0, 1e9)):
        o = Observation(now=quiet, started=0.0, step=step, progress_at=0.0 if step else None)
        assert not decide(Windows(), o).stuck


@pytest.mark.parametrize(
    ("rate", "gpu", "quiet", "stuck_", "rule"),
    [
        (0.0, [], 59.0, False, ""),  # inside `after`
        (0.0, [], 60.0, True, "idle"),  # idle for `after`
        (0.009, [], 60.0, True, "idle"),  # under 1 % of a core: flat
        (0.011, [], 60.0, False, ""),  # over 1 %: busy
        (0.0, [(50.0, 90.0)], 60.0, False, ""),  # a busy GPU in the window
        (0.0, [(-10.0, 90.0), (50.0, 0.0)], 60.0, True, "idle"),  # busy only before the window
        (0.0, [(50.0, 5.0)], 60.0, True, "idle"),  # 5 % is idle
        (2.0, [(50.0, 100.0)], 299.0, False, ""),  # busy: only `max` can say stuck
        (2.0, [(50.0, 100.0)], 300.0, True, "max"),
    ],
)
def test_the_rule_table(
    rate: float, gpu: list[tuple[float, float]], quiet: float, stuck_: bool, rule: str
) -> None:
    # progress at 100; gpu sample times are relative to it
    w = Windows(after=60.0, max=300.0)
    now = 100.0 + quiet
    o = Observation(
        now=now,
        started=0.0,
        step=7,
        progress_at=100.0,
        cpu=_cpu(0.0, now, rate),
        gpu=[(100.0 + t, u) for t, u in gpu],
    )
    v = decide(w, o)
    assert (v.stuck, v.rule) == (stuck_, rule), v


def test_a_window_the_samples_do_not_cover_is_not_idle() -> None:
    w = Windows(after=60.0)
    o = Observation(now=200.0, started=0.0, step=1, progress_at=100.0, cpu=_cpu(150.0, 200.0, 0))
    assert not decide(w, o).stuck
    assert not cpu_flat([(0.0, 1.0)], 0.0)  # one sample is no span


def test_a_fall_in_cpu_time_is_not_flat() -> None:
    # a process of the tree exited (its seconds left the sum): the tree changed
    assert not cpu_flat([(0.0, 10.0), (30.0, 5.0), (60.0, 5.0)], 0.0)
    assert cpu_flat([(0.0, 10.0), (30.0, 10.0), (60.0, 10.0)], 0.0)


def test_before_the_first_step_first_is_the_one_window() -> None:
    w = Windows(after=60.0, max=300.0, first=900.0)
    idle = _cpu(0.0, 2000.0, 0.0)
    assert not decide(w, Observation(now=899.0, started=0.0, cpu=idle)).stuck
    v = decide(w, Observation(now=900.0, started=0.0, cpu=idle))
    assert (v.stuck, v.rule) == (True, "first")
    # after the first step, first no longer applies
    o = Observation(now=1000.0, started=0.0, step=0, progress_at=950.0, cpu=idle)
    assert not decide(w, o).stuck
    o = Observation(now=1010.0, started=0.0, step=0, progress_at=950.0, cpu=idle)
    assert decide(w, o).rule == "idle"


def test_without_first_the_start_stands_for_the_last_progress() -> None:
    w = Windows(after=60.0)
    o = Observation(now=60.0, started=0.0, cpu=_cpu(0.0, 60.0, 0.0))
    assert decide(w, o).rule == "idle"
    assert not decide(w, Observation(now=60.0, started=0.0, cpu=_cpu(0.0, 60.0, 1.0))).stuck


def test_steps_strictly_increase() -> None:
    assert advance(None, None) == 0
    assert advance(4, None) == 5
    assert advance(None, -3) == -3
    assert advance(4, 5) == 5
    assert advance(4, 4) is None  # a repeated step: a beating thread over a stuck loop
    assert advance(4, 3) is None


def test_every_small_case() -> None:
    """Exhaustive over a grid: windows on/off, quiet time, activity, first step or not; the
    verdict equals the rule written out longhand."""
    vals = (None, 60.0, 300.0)
    for after, mx, first, quiet, rate, started in itertools.product(
        vals, vals, vals, (0.0, 59.0, 60.0, 299.0, 300.0, 1000.0), (0.0, 0.5), (True, False)
    ):
        w = Windows(after=after, max=mx, first=first)
        now = 2000.0
        since = now - quiet
        if started:  # a first step, `quiet` ago
            o = Observation(
                now=now, started=0.0, step=3, progress_at=since, cpu=_cpu(0.0, now, rate)
            )
        else:  # none yet: the job started `quiet` ago
            o = Observation(now=now, started=since, cpu=_cpu(0.0, now, rate))
        if not started and first is not None:
            want = quiet >= first
        else:
            want = (mx is not None and quiet >= mx) or (
                after is not None and quiet >= after and rate == 0.0
            )
        assert decide(w, o).stuck == want, (w, quiet, rate, started)


@given(
    after=st.floats(10, 1000),
    extra=st.floats(0, 5000),
    quiet=st.floats(0, 20000),
    rate=st.floats(0, 8),
)
def test_stuck_stays_stuck_as_time_passes(
    after: float, extra: float, quiet: float, rate: float
) -> None:
    w = Windows(after=after, max=after + extra)
    now = 30000.0
    cpu = _cpu(0.0, now + 10000, rate)
    o1 = Observation(now=now, started=0.0, step=1, progress_at=now - quiet, cpu=cpu)
    o2 = Observation(now=now + 5000, started=0.0, step=1, progress_at=now - quiet, cpu=cpu)
    if decide(w, o1).stuck:
        assert decide(w, o2).stuck


@given(mx=st.floats(60, 100000), frac=st.floats(0, 0.9), rate=st.floats(0.02, 64))
def test_a_checkpoint_for_nine_tenths_of_max_gives_nothing(
    mx: float, frac: float, rate: float
) -> None:
    """No progress and a busy CPU (a checkpoint write) for up to 0.9 of max: never stuck."""
    w = Windows(after=min(60.0, mx), max=mx)
    now = 200000.0
    o = Observation(
        now=now, started=0.0, step=10, progress_at=now - frac * mx, cpu=_cpu(0.0, now, rate)
    )
    assert not decide(w, o).stuck


@pytest.mark.parametrize("seed", range(5))
def test_a_soak_of_jittered_steps_gives_no_false_verdict(seed: int) -> None:
    """Two thousand windows per seed (ten thousand in all) of a job whose steps come 0.2 to 0.95
    of `after` apart (and up to 0.95 of max during a "checkpoint" now and then, CPU busy), idle
    or busy between them, checked at every tick: 0 verdicts."""
    rnd = random.Random(seed)
    after, mx = 60.0, 1800.0
    w = Windows(after=after, max=mx, first=600.0)
    t, step, last_at = 0.0, None, None
    cpu_total = 0.0
    cpu: list[tuple[float, float]] = [(0.0, 0.0)]
    next_step = rnd.uniform(0.2, 0.95) * w.first  # type: ignore[operator]
    checkpoint = False
    checked = 0
    while t < 2000 * after:
        t += TICK
        # idle between steps, except in a checkpoint (busy, long)
        cpu_total += (
            rnd.uniform(1.0, 4.0) if checkpoint else rnd.choice((0.0, rnd.uniform(0, 0.5)))
        ) * TICK
        cpu.append((t, cpu_total))
        if len(cpu) > 40:  # the rule reads the last `after` (12 ticks) only
            del cpu[:20]
        if t >= next_step:
            step = advance(step, None)
            last_at = t
            checkpoint = rnd.random() < 0.01
            gap = rnd.uniform(0.3, 0.95) * mx if checkpoint else rnd.uniform(0.2, 0.95) * after
            next_step = t + gap
        v = decide(w, Observation(now=t, started=0.0, step=step, progress_at=last_at, cpu=cpu))
        checked += 1
        assert not v.stuck, (t, v)
    assert checked == 2000 * after / TICK


def test_the_thresholds_are_what_the_docs_say() -> None:
    assert stuck.IDLE_CPU_FRACTION == 0.01
    assert stuck.IDLE_GPU_PCT == 5.0
