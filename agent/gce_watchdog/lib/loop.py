"""One daemon thread and the event that stops it: what each service beside the agent's ladder
runs (the GPU watch, the job watch, the progress socket)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Loop:
    def __init__(self, name: str) -> None:
        self.name = name
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, target: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=target, name=self.name, daemon=True)
        self._thread.start()

    def every(self, period: float, step: Callable[[], object]) -> None:
        """Start a thread that runs ``step`` now and then every ``period`` until stopped."""

        def run() -> None:
            while not self.stopping.is_set():
                step()
                self.stopping.wait(period)

        self.start(run)

    def stop(self, timeout: float = 5.0) -> bool:
        """Ask the thread to stop and wait up to ``timeout``; True when it ended (or never ran)."""
        self.stopping.set()
        t = self._thread
        if t is not None:
            t.join(timeout)
        return t is None or not t.is_alive()
