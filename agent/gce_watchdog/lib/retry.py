"""The one back-off: exponential, capped, jittered, as a value (deciding is separate from doing).

Its callers keep their own stop rule, the part that really differs: ``fetch`` stops at an absolute
deadline and honours ``Retry-After`` (:class:`gce_watchdog.bootstrap.fetch.FetchRetry`), the
action chain after N attempts or when the next wait would cross its deadline, the poller after N
attempts through tenacity (:func:`tenacity_wait`), the SQLite ledger's open when its next wait
would cross the busy timeout (tenacity too), the metadata watcher never (it backs off while
the server is unreachable, :class:`Backoff.counter`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


def tenacity_wait(
    backoff: Backoff, rng: Callable[[], float] = random.random
) -> Callable[[Any], float]:
    """A tenacity ``wait=`` callable drawing from ``backoff`` (attempt n -> wait n)."""

    def wait(rs: Any) -> float:
        return backoff.wait(int(rs.attempt_number), rng())

    return wait
