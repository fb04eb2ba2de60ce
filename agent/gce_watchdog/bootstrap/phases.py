"""Job phases and terminal events: ``gce-watchdog phase``, ``setup-failed`` and ``exec``.

These lines decide money (the poller fails a job over, or does not, because of them), so each is
emitted with ``sync=True`` (written and drained before ``emit`` returns) and the port is closed
(draining anything queued) before the command returns: the last line is the one you lose otherwise.
The phase is also recorded in the state directory (``state.write_phase``) so the agent's heartbeat
lines carry it.

``exec -- CMD ARGS`` runs the workload as an argv (never through a shell), forwards SIGTERM, SIGINT
and SIGHUP to it, writes an ``exit`` line with the exit code or signal and the duration, and returns
the child's status the way shells do (128 + signal number for a signal death; 127 when the command
is not found, 126 when it cannot be executed).

``result ok|fail [--detail k=v ...]`` is the job's own word on its run: a signed, drained
``result`` line, through no log pipeline. Under ``exec`` the job's environment carries
``GCEWD_RESULT_RUN`` (fresh per run) and ``GCEWD_CONFIG``; ``result`` also records
``<run_dir>/result.<token>``, so ``exec --expect-result`` can tell, on its ``exit`` line, whether
this very run reported (``result=reported``) or not (``result=missing``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from gce_watchdog.job.notice import NOTICE_ENV, NoticeFollower, notice_path
from gce_watchdog.job.progress import (
    PROGRESS_ENV,
    JobRecord,
    Proc,
    clear_job,
    socket_path,
    write_job,
)
from gce_watchdog.job.release import released
from gce_watchdog.job.stuck import Windows
from gce_watchdog.lib.cli import EX_NOEXEC, EX_NOTFOUND
from gce_watchdog.vm.runtime import CommandConsole, open_console
from gce_watchdog.vm.state import write_phase
from gce_watchdog.wire import vocab

if TYPE_CHECKING:
    from gce_watchdog.vm.config import Config

PHASES = ("bootstrap", "workload", "done")
SETUP_FAILED = vocab.SETUP_FAILED  # also recorded as the phase in the state directory
# Why bootstrap failed, for the poller (docs/poller.md row 1): `infra` (network, DNS, the package
# source never came up: the job never ran, failing over is safe) or `job` (the step itself failed).
CAUSES = ("infra", "job")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The job's environment under exec: which run a `result` belongs to, and the config to use.
RESULT_RUN_ENV = "GCEWD_RESULT_RUN"
CONFIG_ENV = "GCEWD_CONFIG"
AGENT_ENV = "GCEWD_AGENT"
_TOKEN_RE = re.compile(r"[0-9a-f]{16}\Z")
DETAIL_MAX = 64  # a field value's limit (wire/protocol.py)


def emit_terminal(
    cfg: Config,
    event: str,
    fields: dict[str, object],
    text: str = "",
    phase: str | None = None,
    opened: CommandConsole | None = None,
) -> bool:
    """Record the phase (if given), write one line synchronously and close the port (draining).

    Returns whether the line was confirmed written; a warning is printed when it was not.
    """
    if phase is not None:
        try:
            write_phase(cfg.agent.state_dir, phase)
        except OSError as e:
            print(
                f"gce-watchdog: cannot record phase in {cfg.agent.state_dir}: {e}", file=sys.stderr
            )
    con = opened or open_console(cfg)
    try:
        ok = con.write(event, fields, vocab.fit_text(event, fields, text))
    finally:
        con.close()
    if not ok:
        print(f"gce-watchdog: the {event} line was not confirmed written", file=sys.stderr)
    return ok


# ---------------------------------------------------------------------------------------------
# result


def result_path(run_dir: str, token: str) -> str:
    return os.path.join(run_dir, f"result.{token}")


def encode_detail(pairs: Sequence[str]) -> tuple[str, str]:
    """``k=v`` pairs as the ``detail`` field (``k:v``, ``,``-joined: ``=`` is not in the value
    alphabet; cut to 64 characters) and as the readable text (``k=v k=v``)."""
    from gce_watchdog.wire.protocol import sanitize_value

    cleaned = [p.strip() for p in pairs if p.strip()]
    field_value = ",".join(
        sanitize_value(p.replace("=", ":", 1).replace(",", ";"), DETAIL_MAX) for p in cleaned
    )
    return field_value[:DETAIL_MAX], " ".join(cleaned)


def report_result(
    cfg: Config,
    status: str,
    detail: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> bool:
    """Write the ``result`` line (drained) and, under ``exec``, record that this run reported.
    Returns whether the line was confirmed written."""
    fields: dict[str, object] = {"status": status}
    value, readable = encode_detail(detail)
    if value:
        fields["detail"] = value
    text = f"job result: {status}" + (f" {readable}" if readable else "")
    ok = emit_terminal(cfg, vocab.RESULT, fields, text)
    token = (os.environ if env is None else env).get(RESULT_RUN_ENV, "")
    if _TOKEN_RE.match(token):
        try:
            from gce_watchdog.lib.files import atomic_write

            atomic_write(result_path(cfg.agent.run_dir, token), f"{status}\n".encode(), 0o600)
        except OSError as e:
            print(f"gce-watchdog result: cannot record the result: {e}", file=sys.stderr)
    elif token:
        print(f"gce-watchdog result: ignoring a malformed ${RESULT_RUN_ENV}", file=sys.stderr)
    return ok


def took_result(run_dir: str, token: str) -> bool:
    """Whether this run's job reported (and forget it: the file is this run's only)."""
    path = result_path(run_dir, token)
    try:
        os.lstat(path)
    except OSError:
        return False
    with contextlib.suppress(OSError):
        os.unlink(path)
    return True


# ---------------------------------------------------------------------------------------------
# exec


@dataclass(frozen=True)
class ExitStatus:
    """How a child ended: exactly one of rc and sig is set."""

    rc: int | None
    sig: int | None

    @staticmethod
    def from_returncode(code: int) -> ExitStatus:
        """subprocess's returncode: negative for a signal death."""
        return ExitStatus(None, -code) if code < 0 else ExitStatus(code, None)

    @property
    def shell_status(self) -> int:
        return 128 + self.sig if self.sig is not None else (self.rc or 0)

    @property
    def sig_name(self) -> str:
        if self.sig is None:
            return "-"
        try:
            return signal.Signals(self.sig).name
        except ValueError:
            return f"SIG{self.sig}"

    def fields(self, dur: float) -> dict[str, object]:
        return {
            "rc": "-" if self.rc is None else self.rc,
            "sig": self.sig_name,
            "dur": f"{dur:.3f}",
        }


class _Forwarder:
    """Forwards signals to the child; signals that arrive before it exists are replayed."""

    def __init__(self) -> None:
        self.child: Any = None
        self.pending: list[int] = []
        self.forwarded: list[int] = []

    def handler(self, signum: int, frame: object) -> None:
        if self.child is None:
            self.pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            self.child.send_signal(signum)
            self.forwarded.append(signum)

    def attach(self, child: Any) -> None:
        self.child = child
        while self.pending:
            self.handler(self.pending.pop(0), None)


class _Defuser:
    """What the child's stdout and stderr pass through: one lock, the last bytes written to
    either and the last bytes written to each, so a marker can be split across the two streams,
    across writes, or across a close (``GCEW`` at the end of stdout, ``D3 ...`` on stderr: the
    runner gives both one pipe to the console) and still never reach the console whole
    (``protocol.neutralize_after``), whether the two streams share a destination or not (our
    stdout and stderr on two pipes, with the other stream's bytes between the two halves)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._last = b""
        self._last_by_fd: dict[int, bytes] = {}

    def write(self, dst: int, chunk: bytes) -> None:
        from gce_watchdog.wire.protocol import neutralize_after

        with self._lock:  # the order of our writes is the order on the shared pipe
            # each pass only lowers a marker's D in ``chunk``: neither can make a marker
            data = neutralize_after(self._last, chunk)
            data = neutralize_after(self._last_by_fd.get(dst, b""), data)
            self._last = (self._last + data)[-8:]
            self._last_by_fd[dst] = (self._last_by_fd.get(dst, b"") + data)[-8:]
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(dst, view) :]
                except OSError:
                    return  # our own output is gone: keep draining the child so it never blocks


def _pass_through(src: IO[bytes], dst: int, defuser: _Defuser) -> None:
    """Copy the child's output to ours with every protocol marker defused (``GCEWD`` becomes
    ``GCEWd``): what the workload prints can never read as a line of ours, whatever reaches the
    console (the start-up script runner copies this output to serial port 1)."""
    while True:
        try:
            chunk = os.read(src.fileno(), 65536)
        except OSError:
            chunk = b""
        if not chunk:
            src.close()
            return
        defuser.write(dst, chunk)


# How often exec looks at the notice file while the job runs: one stat() a second; GCE's
# shortest notice (a preemption) is about 30 s.
NOTICE_POLL_S = 1.0


def _wait_with_notices(child: Any, follower: NoticeFollower, cfg: Config) -> int:
    """The child's return code; meanwhile each new stop notice sends it ``[job] notice_signal``."""
    import subprocess

    name = cfg.job.notice_signal
    if name == "off":
        return int(child.wait())
    signum = signal.Signals[name]
    while True:
        try:
            return int(child.wait(timeout=NOTICE_POLL_S))
        except subprocess.TimeoutExpired:
            pass
        if follower.changed():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)


def job_windows(cfg: Config) -> Windows:
    """``[job]``'s stuck windows (0: off)."""
    j = cfg.job
    return Windows(j.stuck_after or None, j.stuck_max or None, j.stuck_first or None)


def _record_job(cfg: Config, pid: int, windows: Windows) -> None:
    """Tell the agent which tree may report progress, and the windows (best effort: without the
    record the job runs as before, its progress refused and never stuck)."""
    st = Proc().stat(pid)
    if st is None:
        return  # already gone
    try:
        write_job(cfg.agent.run_dir, JobRecord(pid, st.start_ticks, windows))
    except OSError as e:
        print(f"gce-watchdog exec: cannot record the job for the agent: {e}", file=sys.stderr)


def _gpu_on(cfg: Config) -> bool:
    from gce_watchdog.gpu.service import gpu_enabled

    return gpu_enabled(cfg.gpu)


def _gpu_sample(cfg: Config) -> dict[str, Any] | None:
    """One NVML sample through the probe child, where the GPU watch is on (no GPU library is
    imported here either way); None elsewhere or when none came within the probe timeout."""
    if not _gpu_on(cfg):
        return None
    from gce_watchdog.gpu.probe import sample_once

    return sample_once(cfg.gpu.probe_timeout)


def run_exec(
    cfg: Config,
    argv: Sequence[str],
    clock: Callable[[], float] = time.monotonic,
    expect_result: bool = False,
    config_path: str | None = None,
    windows: Windows | None = None,
) -> int:
    """Phase workload, run argv, forward signals, write the `exit` line drained; child's status.

    ``expect_result``: the job is configured to report (``gce-watchdog result``); the ``exit`` line
    then says ``result=reported`` or ``result=missing``. ``config_path`` goes to the job as
    ``$GCEWD_CONFIG``, so its ``result`` writes where this exec does. ``windows``: the stuck
    windows (default: ``[job]``'s); exec records them with the job's pid in ``<run_dir>/job.json``
    for the agent (job/progress.py) and removes the record when the job ends."""
    import subprocess
    import threading

    emit_terminal(cfg, vocab.PHASE, {"ph": "workload"}, phase="workload")
    gpu_before = _gpu_sample(cfg)
    opened = open_console(cfg)  # opened before the child runs: no surprise at the end
    fwd = _Forwarder()
    old = {s: signal.signal(s, fwd.handler) for s in FORWARDED}
    t0 = clock()
    text = ""
    token = secrets.token_hex(8)
    env = dict(os.environ)
    env[RESULT_RUN_ENV] = token
    if config_path:
        env[CONFIG_ENV] = os.path.abspath(config_path)
    env[NOTICE_ENV] = notice_path(cfg.agent.run_dir)
    env[PROGRESS_ENV] = socket_path(cfg.agent.run_dir)
    follower = NoticeFollower(env[NOTICE_ENV])
    exe = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(exe) == "gce-watchdog" and os.access(exe, os.X_OK):
        env[AGENT_ENV] = exe  # the gce-watchdog the job's `result` runs (gce_watchdog.jobresult)
    try:
        try:
            # argv, no shell; stdout and stderr pass through us, markers defused
            child = subprocess.Popen(
                list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
        except FileNotFoundError:
            status, text = ExitStatus(EX_NOTFOUND, None), f"command not found: {argv[0]}"
        except OSError as e:
            status, text = ExitStatus(EX_NOEXEC, None), f"cannot run {argv[0]}: {e.strerror}"
        else:
            assert child.stdout is not None and child.stderr is not None
            defuser = _Defuser()
            pumps = [
                threading.Thread(target=_pass_through, args=(p, fd, defuser), daemon=True)
                for p, fd in ((child.stdout, 1), (child.stderr, 2))
            ]
            for t in pumps:
                t.start()
            fwd.attach(child)
            _record_job(cfg, child.pid, windows if windows is not None else job_windows(cfg))
            status = ExitStatus.from_returncode(_wait_with_notices(child, follower, cfg))
            for t in pumps:
                t.join(5.0)  # output of a grandchild that outlives the workload is not awaited
    finally:
        clear_job(cfg.agent.run_dir)
        for s, h in old.items():
            signal.signal(s, h)
    dur = clock() - t0
    if text:
        print(f"gce-watchdog exec: {text}", file=sys.stderr)
    elif status.sig is not None:
        text = f"workload killed by {status.sig_name}"
    else:
        text = f"workload exited with {status.rc}"
    fields = status.fields(dur)
    reported = took_result(cfg.agent.run_dir, token)
    if expect_result:
        fields["result"] = vocab.EXIT_RESULT_REPORTED if reported else vocab.EXIT_RESULT_MISSING
        if not reported:
            text += ", without its result"
    if gpu_before is not None or _gpu_on(cfg):
        rel = released(gpu_before, _gpu_sample(cfg))
        fields["idle"] = rel.state
        if rel.state != "ok":
            text += f"; GPUs {rel.state}: {rel.why}"
    emit_terminal(cfg, vocab.EXIT, fields, text, opened=opened)
    return status.shell_status


# ---------------------------------------------------------------------------------------------
# CLI
