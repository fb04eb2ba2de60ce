"""The one back-off and the one retry loop (lib/retry): bounds by property, the counter's reset,
retry_call's attempts, waits and stop."""

from __future__ import annotations

import pytest
from gce_watchdog.lib.retry import Backoff, retry_call
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


def test_retry_call_waits_the_backoff_until_it_succeeds() -> None:
    slept: list[float] = []
    asked: list[int] = []
    told: list[tuple[int, str, float]] = []
    b = Backoff(0.5, 2.0, 1.5, jitter=1.0)

    def flaky(n: int) -> str:
        if n < 4:
            raise OSError(f"not yet {n}")
        return f"ok at {n}"

    def next_wait(n: int, _e: BaseException) -> float | None:
        asked.append(n)
        return b.wait(n, 0.0) if n < 5 else None

    got = retry_call(
        flaky,
        next_wait,
        sleep=slept.append,
        before_sleep=lambda n, e, w: told.append((n, str(e), w)),
    )
    assert got == "ok at 4"
    assert slept == [0.5, 1.0, 1.5]
    assert asked == [1, 2, 3]  # once per failed attempt
    assert told == [(1, "not yet 1", 0.5), (2, "not yet 2", 1.0), (3, "not yet 3", 1.5)]


def test_retry_call_gives_up_with_the_last_error() -> None:
    slept: list[float] = []

    def always(n: int) -> None:
        raise OSError(f"down {n}")

    with pytest.raises(OSError, match="down 3"):
        retry_call(always, lambda n, _e: 1.0 if n < 3 else None, sleep=slept.append)
    assert slept == [1.0, 1.0]


def test_retry_call_raises_a_refused_error_at_once() -> None:
    slept: list[float] = []
    asked: list[int] = []

    def refused(n: int) -> None:
        raise ValueError(f"final {n}")

    with pytest.raises(ValueError, match="final 1"):
        retry_call(
            refused,
            lambda n, _e: asked.append(n) or 1.0,
            retry_on=lambda e: isinstance(e, OSError),
            sleep=slept.append,
        )
    assert slept == [] and asked == []


def test_a_sleep_that_raises_ends_the_loop() -> None:
    class Stopped(Exception):
        pass

    calls: list[int] = []

    def pause(_s: float) -> None:
        raise Stopped

    def fail(n: int) -> None:
        calls.append(n)
        raise OSError("x")

    with pytest.raises(Stopped):
        retry_call(fail, lambda _n, _e: 5.0, sleep=pause)
    assert calls == [1]


@given(fails=st.integers(0, 8), attempts=st.integers(1, 8))
def test_attempts_are_counted_exactly(fails: int, attempts: int) -> None:
    """A stop rule of N attempts makes at most N calls, and succeeds iff a call can."""
    calls: list[int] = []

    def f(n: int) -> int:
        calls.append(n)
        if n <= fails:
            raise OSError(n)
        return n

    try:
        got: int | None = retry_call(
            f, lambda n, _e: 0.0 if n < attempts else None, sleep=lambda _s: None
        )
    except OSError:
        got = None
    assert calls == list(range(1, min(fails + 1, attempts) + 1))
    assert got == (fails + 1 if fails < attempts else None)


def test_a_deadline_loop_without_jitter_fits_it() -> None:
    """The shape of the ledger's open (poller/ledger.py: SQLITE_BUSY until a deadline, waits
    doubling to a cap, no jitter): the same waits, then the last error."""
    now = [0.0]
    slept: list[float] = []
    b = Backoff(0.05, 2.0, 0.4, jitter=0.0)
    deadline = 1.0

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    def busy(_n: int) -> None:
        raise RuntimeError("database is locked")

    def next_wait(n: int, _e: BaseException) -> float | None:
        w = b.wait(n, 0.0)
        return None if now[0] + w > deadline else w

    with pytest.raises(RuntimeError, match="locked"):
        retry_call(busy, next_wait, retry_on=lambda e: "locked" in str(e), sleep=sleep)
    assert slept == pytest.approx([0.05, 0.1, 0.2, 0.4])  # 0.75 s; the next 0.4 s would cross 1 s
