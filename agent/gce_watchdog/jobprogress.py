"""The job's progress, from Python: ``progress(step)``, with no process start.

Standard library only and no import of the rest of the package (like jobresult.py): import it
from the agent's install or copy this one file beside the job's code. It connects to the agent's
socket (``$GCEWD_PROGRESS``, which ``gce-watchdog exec`` sets; else
``/run/gce-watchdog/progress.sock``) and says ``progress <step>``; the agent takes the caller from
the kernel (``SO_PEERCRED``) and counts it only from the process tree of the job ``exec`` started
or from ``[job] progress_uid`` (docs/job-progress.md).

    from gce_watchdog import jobprogress      # or: import jobprogress (this file, copied)
    for step, batch in enumerate(loader):
        train_step(batch)
        jobprogress.progress(step)            # True: counted; False: not after the last step

Steps strictly increase; a repeated or lower step is not progress (``False``). No step: each call
is the next one. As a command: ``python3 jobprogress.py [STEP]``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

DEFAULT_SOCKET = "/run/gce-watchdog/progress.sock"
ENV = "GCEWD_PROGRESS"
# The agent answers from its own thread at once; this bounds a job's wait on an agent that is
# stopped (SIGSTOP, a debugger) so a training loop is never held by its watchdog.
TIMEOUT_S = 2.0


class ProgressRefused(RuntimeError):
    """The agent refused the caller (not the job's process tree, nor the configured uid)."""


class ProgressUnavailable(RuntimeError):
    """No agent answered on the socket (not running, or no such socket)."""


def socket_path() -> str:
    return os.environ.get(ENV, "") or DEFAULT_SOCKET


def progress(step: int | None = None, path: str | None = None) -> bool:
    """Report progress. True: counted; False: not after the latest step (not progress). Raises
    :class:`ProgressRefused` or :class:`ProgressUnavailable` (the job decides what that means)."""
    request = f"progress {'-' if step is None else int(step)}\n".encode()
    target = path or socket_path()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(TIMEOUT_S)
            s.connect(target)
            # the agent refuses a caller before reading: its answer is already here
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(request)
            answer = b""
            try:
                while not answer.endswith(b"\n") and len(answer) < 1024:
                    chunk = s.recv(1024)
                    if not chunk:
                        break
                    answer += chunk
            except ConnectionResetError:
                if not answer:
                    raise
    except OSError as e:
        raise ProgressUnavailable(f"no agent on {target}: {e.strerror or e}") from e
    word, _, rest = answer.decode("utf-8", "replace").strip().partition(" ")
    if word == "ok":
        return True
    if word == "same":
        return False
    if word == "refused":
        raise ProgressRefused(f"the agent refused this progress report: {rest}")
    raise ProgressUnavailable(f"unexpected answer from {target}: {answer[:100]!r}")


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and not argv[0].lstrip("-").isdigit()):
        print("usage: jobprogress.py [STEP]", file=sys.stderr)
        return 64
    try:
        counted = progress(int(argv[0]) if argv else None)
    except ProgressRefused as e:
        print(e, file=sys.stderr)
        return 77
    except ProgressUnavailable as e:
        print(e, file=sys.stderr)
        return 69
    if not counted:
        print("not progress: the step is not after the latest one", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
