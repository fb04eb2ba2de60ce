"""Pipes in awkward states, for code that writes to stdout."""

from __future__ import annotations

import fcntl
import os

F_SETPIPE_SZ = 1031  # fcntl(2), Linux


def blocked_pipe() -> tuple[int, int]:
    """(read end, write end) of a pipe whose buffer is already full: the first write to it
    blocks (nobody reads it)."""
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)  # the smallest buffer, one page
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    return r, w
