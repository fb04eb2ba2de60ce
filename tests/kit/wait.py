"""Waiting for an event, bounded: never sleep-and-hope."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(pred: Callable[[], object], timeout: float = 15.0, interval: float = 0.05) -> bool:
    """True as soon as ``pred()`` is truthy; False once ``timeout`` seconds have passed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())  # one last look: the deadline may have passed while it slept
