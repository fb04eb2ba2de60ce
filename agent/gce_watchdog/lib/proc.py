"""The one subprocess runner: an argv (never a shell string), bounded, stdin from /dev/null.

Every caller gets the same facts (:class:`ProcResult`) and maps them to what it reports: the action
chain and the installer keep the exit code and the last stderr line (:func:`run_command`), the fault
CLI its rc 127/124 convention, the memory monitor a short word.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Lines keep a bounded excerpt of stderr (a serial line is 280 bytes in all).
DETAIL_MAX = 90


@dataclass(frozen=True)
class ProcResult:
    """What running an argv did. ``rc`` None: it did not run to an exit code (see ``reason``)."""

    rc: int | None
    out: str = ""
    err: str = ""
    timed_out: bool = False
    error: OSError | None = None  # the exec failed: not found, permission, ...
    reason: str = ""  # why rc is None, one short phrase


def run(
    argv: Sequence[str],
    timeout: float,
    *,
    env: Mapping[str, str] | None = None,
    stdout: bool = False,
    stderr: bool = False,
) -> ProcResult:
    """Run ``argv`` bounded by ``timeout``; never raises for the command's own failures.

    ``env``: variables added to this process's environment. ``stdout`` / ``stderr``: capture the
    stream (decoded as UTF-8, bad bytes replaced); otherwise it goes to /dev/null.
    """
    argv = list(argv)
    try:
        p = subprocess.run(
            argv,
            env=None if env is None else {**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
            stderr=subprocess.PIPE if stderr else subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ProcResult(None, timed_out=True, reason=f"timed out after {timeout:g}s")
    except FileNotFoundError as e:
        return ProcResult(None, error=e, reason=f"not found: {argv[0]}")
    except OSError as e:
        return ProcResult(None, error=e, reason=f"cannot run {argv[0]}: {e.strerror or e}")
    return ProcResult(
        p.returncode,
        p.stdout.decode("utf-8", "replace") if stdout else "",
        p.stderr.decode("utf-8", "replace") if stderr else "",
    )


@dataclass(frozen=True)
class RunResult:
    """The short form: ``rc`` None means it did not run to an exit code; ``detail`` says why, or
    holds the last line of stderr."""

    rc: int | None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0


def run_command(argv: Sequence[str], timeout: float) -> RunResult:
    """Run an argv with a bound; stdout is discarded, stderr's last line is kept."""
    r = run(argv, timeout, stderr=True)
    if r.rc is None:
        return RunResult(None, r.reason)
    lines = r.err.strip().splitlines()
    return RunResult(r.rc, lines[-1][:DETAIL_MAX] if lines else "")
