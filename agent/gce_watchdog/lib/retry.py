"""The one back-off and the one retry loop.

:class:`Backoff` is the wait: exponential, capped, jittered, as a value (deciding is separate from
doing). :func:`retry_call` is the loop every bounded retry runs (tenacity underneath): an
attempt, and after each failed one the caller's ``next_wait`` says how long to wait or to give up.

Its callers keep their own stop rule, the part that really differs: ``fetch`` stops at an absolute
deadline and honours ``Retry-After`` (:class:`gce_watchdog.bootstrap.fetch.FetchRetry`), the
action chain after N attempts or when the next wait would cross its deadline, the Compute API
client and the poller's deliveries after N attempts, the SQLite ledger's open when its next wait
would cross the busy timeout (no jitter: ``Backoff(jitter=0)``). The metadata watcher never gives
up (it backs off while the server is unreachable and starts over after a success):
:meth:`Backoff.counter`, not a retry loop.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Wait ``n`` (1-based) is ``min(max_wait, initial * multiplier**(n-1))`` shortened by up to
    ``jitter`` of itself: 0.5 keeps at least half (many VMs booting together spread out and none
    retries at once), 1.0 is full jitter."""

    initial: float = 1.0
    multiplier: float = 2.0
    max_wait: float = 30.0
    jitter: float = 0.5

    def wait(self, n: int, u: float) -> float:
        """The wait after failed attempt ``n``; ``u`` in [0, 1) is the random draw."""
        base = min(self.max_wait, self.initial * self.multiplier ** min(max(n, 1) - 1, 64))
        return float(base * (1.0 - self.jitter * u))

    def counter(self, rng: Callable[[], float] = random.random) -> BackoffCounter:
        """A stateful walk along this back-off for loops that never give up."""
        return BackoffCounter(self, rng)


class BackoffCounter:
    """``next()`` is the next wait; ``reset()`` after a success starts over."""

    def __init__(self, backoff: Backoff, rng: Callable[[], float]) -> None:
        self.backoff = backoff
        self.rng = rng
        self._n = 0

    def next(self) -> float:
        self._n = min(self._n + 1, 64)
        return self.backoff.wait(self._n, self.rng())

    def reset(self) -> None:
        self._n = 0


def retry_call(
    attempt: Callable[[int], T],
    next_wait: Callable[[int, BaseException], float | None],
    *,
    retry_on: Callable[[BaseException], bool] = lambda _e: True,
    sleep: Callable[[float], None] = time.sleep,
    before_sleep: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """``attempt(n)`` (n = 1, 2, ...) until it returns; its value is returned.

    An exception ``retry_on`` refuses is raised at once. After a retryable failure of attempt
    ``n``, ``next_wait(n, error)`` is asked once: None gives up (the error is raised), else
    ``before_sleep(n, error, wait)`` is told and ``sleep(wait)`` runs (a ``sleep`` may raise to
    end the loop: a stop event set). Never retries forever: ``next_wait`` holds the stop rule.
    """
    import tenacity  # imported here: the agent's start-up does not need it

    plans: dict[int, float | None] = {}  # the one answer of next_wait per failed attempt

    def plan(rs: tenacity.RetryCallState) -> float | None:
        n = rs.attempt_number
        if n not in plans:
            error = rs.outcome.exception() if rs.outcome is not None else None
            assert error is not None  # tenacity asks only after a failed attempt
            plans[n] = next_wait(n, error)
        return plans[n]

    def told(rs: tenacity.RetryCallState) -> None:
        error = rs.outcome.exception() if rs.outcome is not None else None
        if before_sleep is not None and error is not None:
            before_sleep(rs.attempt_number, error, plan(rs) or 0.0)

    retrying = tenacity.Retrying(
        stop=lambda rs: plan(rs) is None,
        wait=lambda rs: plan(rs) or 0.0,
        retry=tenacity.retry_if_exception(retry_on),
        sleep=sleep,
        before_sleep=told,
        reraise=True,
    )
    for att in retrying:
        with att:
            return attempt(att.retry_state.attempt_number)
    raise AssertionError("unreachable: tenacity returns or raises")  # pragma: no cover
