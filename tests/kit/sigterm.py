"""A SIGTERM to pytest tears down what the tests started.

``timeout`` (CI's, ours) ends pytest with SIGTERM, whose default action ends the interpreter at
once: no fixture's teardown runs, so a server a fixture started (the Pub/Sub emulator, a
PostgreSQL cluster) outlived the run. :func:`install` makes a SIGTERM to the pytest process a
``KeyboardInterrupt``: pytest stops the running test, runs every finalizer (its session
teardown) and exits 2 (interrupted). A child forked from that process keeps the default action
(the handler sees another pid and ends it as SIGTERM would have).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

_owner: list[int] = []


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if not _owner or os.getpid() != _owner[0]:  # a forked child: the default action
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise KeyboardInterrupt("SIGTERM")


def install() -> bool:
    """Install the handler in this process; False where another handler is already there
    (someone chose what SIGTERM does) or this is not the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    _owner[:] = [os.getpid()]
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True
