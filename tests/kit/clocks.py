"""Clocks a test moves by hand (the daemon's fake clock is kit.fakes.FakeClock)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kit.fakes import FakeClock


class ManualClock:
    """A callable clock (``clock()`` is the time) that moves only when the test sets ``t``,
    calls ``advance``, or the code under test calls ``sleep``."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


@dataclass
class ChainClock:
    """The shutdown chain's clock (``gce_watchdog.lib.clock.Clock``) on the daemon's fake clock:
    sleeping advances time; a wait gives another thread ``real_slice`` real seconds to set the
    event before time moves on."""

    fc: FakeClock
    real_slice: float = 1.0
    fail_sleep: BaseException | None = None

    def monotonic(self) -> float:
        return self.fc.monotonic()

    def wall(self) -> float:
        return self.fc.wall()

    def sleep(self, seconds: float) -> None:
        if self.fail_sleep is not None:
            exc, self.fail_sleep = self.fail_sleep, None
            raise exc
        self.fc.advance(max(0.0, seconds))

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if event.wait(self.real_slice):
            return True
        self.fc.advance(max(0.0, seconds))
        return event.is_set()
