"""The one back-off (lib/retry): bounds by property, the counter's reset, tenacity's use of it."""

from __future__ import annotations

import pytest
import tenacity
from gce_watchdog.lib.retry import Backoff, tenacity_wait
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure


@given(
    n=st.integers(1, 500),
    u=st.floats(0, 1, exclude_max=True),
    initial=st.floats(0.01, 10),
    cap=st.floats(0.01, 100),
    jitter=st.floats(0, 1),
)
def test_wait_is_capped_exponential_shortened_by_jitter(
    n: int, u: float, initial: float, cap: float, jitter: float
) -> None:
    b = Backoff(initial, 2.0, cap, jitter)
    base = min(cap, initial * 2.0 ** min(n - 1, 64))
    w = b.wait(n, u)
    assert base * (1 - jitter) - 1e-9 <= w <= base + 1e-9
    assert b.wait(n, 0.0) == pytest.approx(base)  # no draw: the full step


def test_counter_doubles_then_resets() -> None:
    c = Backoff(1.0, 2.0, 5.0, jitter=0.5).counter(rng=lambda: 0.0)
    assert [c.next() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    c.reset()
    assert c.next() == 1.0


def test_tenacity_uses_the_backoff() -> None:
    slept: list[float] = []
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 4:
            raise OSError("not yet")
        return "ok"

    r = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(5),
        wait=tenacity_wait(Backoff(0.5, 2.0, 1.5, jitter=1.0), rng=lambda: 0.0),
        sleep=slept.append,
    )
    assert r(flaky) == "ok"
    assert slept == [0.5, 1.0, 1.5]
