"""``validate``'s progress on stderr: one line per step, with the time since the run began; on a
terminal only, a spinner line between the steps, rewritten in place, saying what the run waits
for (a pipe or a log file gets the step lines alone, never a carriage return)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import TextIO

PROG = "gce-watchdog validate"
FRAMES = "|/-\\"
CLEAR = "\r\x1b[K"  # back to the line's start, erase it (ECMA-48 EL)


def elapsed(seconds: float) -> str:
    """``7s``, ``4m05s``, ``1h02m03s`` (whole seconds; a negative time reads 0s)."""
    s = max(0, int(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{sec:02d}s"
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


class Progress:
    """Step lines and, on a terminal, a spinner. ``tty`` None: ``stream.isatty()``."""

    def __init__(self, stream: TextIO, clock: Callable[[], float], tty: bool | None = None) -> None:
        self.stream = stream
        self.clock = clock
        self.started = clock()
        self.last_step = self.started  # when the last step line was written
        if tty is None:
            try:
                tty = stream.isatty()
            except (AttributeError, ValueError):
                tty = False
        self.tty = tty
        self._frame = 0
        self._shown = False

    def step(self, msg: str) -> None:
        """One line: ``gce-watchdog validate: [4m05s] msg``."""
        self._clear()
        self.last_step = self.clock()
        self._write(f"{PROG}: [{elapsed(self.last_step - self.started)}] {msg}\n")

    def waiting(self, what: str) -> None:
        """The spinner line (a terminal only): the next frame, the time, ``what``."""
        if not self.tty:
            return
        frame = FRAMES[self._frame % len(FRAMES)]
        self._frame += 1
        width = max(20, shutil.get_terminal_size().columns - 1)
        line = f"{frame} [{elapsed(self.clock() - self.started)}] {what}"[:width]
        self._write(CLEAR + line)
        self._shown = True

    def close(self) -> None:
        self._clear()

    def _clear(self) -> None:
        if self._shown:
            self._write(CLEAR)
            self._shown = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # stderr gone: the run and its report go on
            pass
