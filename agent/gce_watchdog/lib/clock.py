"""The one clock protocol: every loop that reads time or waits takes a :class:`Clock`.

One argument order for every wait: ``wait(event, seconds)``, as ``threading.Event.wait`` reads
("wait for this event, at most this long"). The agent's tick loop, the shutdown chain and the
tests' fake clocks (tests/kit/fakes.py, tests/kit/clocks.py) all implement this one protocol.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (a negative wait is no wait)."""
        ...

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``event``; True when it is set."""
        ...


class RealClock:
    """The process's clocks: ``time.monotonic``, ``time.time``, ``Event.wait``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(0.0, seconds))
