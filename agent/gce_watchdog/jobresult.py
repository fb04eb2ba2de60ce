"""The job's own result, from Python: ``report(ok=True, step=1)``.

Standard library only and no import of the rest of the package, so a job whose Python is not the
agent's can import it from the agent's install or copy this one file beside its code. It runs
``gce-watchdog result ok|fail --detail k=v ...``, which writes a signed ``result`` line on the
serial console and drains it before it returns: the result reaches the poller through no log
pipeline (docs/bootstrap.md, "The job's own result"). Under ``gce-watchdog exec --expect-result``
the ``exit`` line then says ``result=reported``; a job that exits 0 without reporting gets
``result=missing`` (the poller's ``workload_unverified``).

Which ``gce-watchdog``: ``$GCEWD_AGENT`` (``exec`` sets it for its job), else
``/opt/gce-watchdog/bin/gce-watchdog`` (the start-up script's install), else the one on ``PATH``.

    from gce_watchdog import jobresult   # or: import jobresult (this file, copied)
    jobresult.report(ok=loss < 0.5, step=1000, loss=f"{loss:.3f}")

As a command: ``python3 jobresult.py ok --detail step=1``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

DEFAULT_AGENT = "/opt/gce-watchdog/bin/gce-watchdog"
# The line is written and drained within the console's own bound (5 s); this leaves room for a
# slow start of the agent's Python.
TIMEOUT_S = 30.0


class ResultNotWritten(RuntimeError):
    """``gce-watchdog result`` could not write the line (its exit status and message)."""


def agent_path() -> str:
    """The ``gce-watchdog`` executable this helper runs."""
    env = os.environ.get("GCEWD_AGENT", "")
    if env:
        return env
    if os.access(DEFAULT_AGENT, os.X_OK):
        return DEFAULT_AGENT
    return shutil.which("gce-watchdog") or "gce-watchdog"


def command(ok: bool, **detail: object) -> list[str]:
    """The argv of ``gce-watchdog result`` for this result (no shell ever)."""
    argv = [agent_path(), "result", "ok" if ok else "fail"]
    for k, v in detail.items():
        argv += ["--detail", f"{k}={v}"]
    return argv


def report(ok: bool, /, **detail: object) -> None:
    """Report the job's result. Raises :class:`ResultNotWritten` when the line was not written
    (the job decides whether that fails it); never prints on success."""
    try:
        done = subprocess.run(
            command(ok, **detail),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ResultNotWritten(f"gce-watchdog result: {e}") from e
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()[-500:]
        raise ResultNotWritten(f"gce-watchdog result exited {done.returncode}: {err}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("ok", "fail"):
        print("usage: jobresult.py ok|fail [--detail K=V ...]", file=sys.stderr)
        return 64
    detail: dict[str, object] = {}
    rest = argv[1:]
    while rest:
        if rest[0] != "--detail" or len(rest) < 2 or "=" not in rest[1]:
            print("usage: jobresult.py ok|fail [--detail K=V ...]", file=sys.stderr)
            return 64
        k, _, v = rest[1].partition("=")
        detail[k] = v
        rest = rest[2:]
    try:
        report(argv[0] == "ok", **detail)
    except ResultNotWritten as e:
        print(e, file=sys.stderr)
        return 74
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
