"""Benchmarks: the agent against monit and watchdog(8) (``make bench``, docs/performance.md)."""

from __future__ import annotations

import signal
from types import FrameType


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM (a CI job's timeout, ``kill``, a parent giving up) ends this process as Ctrl-C
    does: SystemExit unwinds every ``with`` and ``finally``, so the namespaces, servers and
    processes it started are torn down (the default action ends it at once and runs none)."""
    signal.signal(signal.SIGTERM, _exit)
