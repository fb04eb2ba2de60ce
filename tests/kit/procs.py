"""Racing processes: start them, gather their results, reap them all (bounded). A command run
until an event: ``running``, ``wait_alive``, ``terminate``. ``sigint_default``: a command whose
Ctrl-C (SIGINT) does what it does in a terminal's foreground job, whatever this process got."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def gather(procs: list[Any], results: Any, n: int, wait_s: float) -> list[Any]:
    """Start ``procs`` (multiprocessing processes), take ``n`` results from the ``results``
    queue (each within ``wait_s``), join every process and check it exited 0; whatever
    happens, no process is left running."""
    try:
        for p in procs:
            p.start()
        out = [results.get(timeout=wait_s) for _ in range(n)]
        for p in procs:
            p.join(timeout=wait_s)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return out


@contextmanager
def running(
    argv: list[str], env: Mapping[str, str], cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` started (in ``cwd``) with its stdout and stderr piped; killed and reaped on exit
    from the context if it is still running (a failed assertion, a deadline), never left
    behind."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_alive(
    proc: subprocess.Popen[bytes], done: Callable[[], object], within_s: float, what: str
) -> None:
    """Until ``done()`` is true, looking every 0.2 s: an AssertionError with the process's
    output if it exits first, or with ``what`` once ``within_s`` seconds have passed."""
    deadline = time.monotonic() + within_s
    while not done():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def terminate(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> tuple[bytes, bytes]:
    """SIGTERM, then its stdout and stderr once it exited (within ``timeout_s``)."""
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=timeout_s)


# Run by a fresh interpreter before the command: SIGINT back to its default disposition, then exec
# (an exec keeps SIG_DFL and SIG_IGN, and resets only caught signals, POSIX execve(2)).
_SIGINT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def sigint_default(argv: list[str]) -> list[str]:
    """``argv`` started with SIGINT at its default disposition, as an interactive shell starts a
    foreground job. A non-interactive shell starts a background job (``make test &``, CI
    runners) with SIGINT ignored (POSIX 2.11, "Signals and Error Handling"), every child
    inherits that, and Python then installs no KeyboardInterrupt handler: a test that plays
    the operator's Ctrl-C must not depend on how pytest itself was started."""
    return [sys.executable, "-c", _SIGINT_DEFAULT, *argv]
