"""The agent's side of the GPU probe child (gpu/probe_child.py): a deadline, at most one child.

``GpuProbe.poll(now)`` never blocks: it sends a request when none is outstanding, takes an answer
when one is ready, and reports a stall once when the outstanding request has waited longer than
``timeout``. A stalled child is never replaced while it lives (a child stuck in NVML may be in
uninterruptible sleep: a second one would only get stuck beside it); when it answers or dies the
probe goes on. ``close()`` kills the child and does not wait for it beyond a short bound, so the
agent stops (``systemctl restart``) even while a probe is stuck. The child inherits the agent's
environment (so ``PYTHONPATH`` reaches a test's fake ``pynvml``) and returns numbers only.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# An answer is one JSON line of a few hundred bytes per GPU; past this the child is misbehaving.
MAX_ANSWER = 256 * 1024
CHILD_ARGV: tuple[str, ...] = (sys.executable, "-m", "gce_watchdog.gpu.probe_child")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one ``poll`` brought: an answer (``sample``), a new stall, or a child that ended."""

    sample: dict[str, Any] | None = None
    stalled_for: float | None = None  # set once, when the outstanding request passed its deadline
    ended: str = ""  # why the child ended (it is started again on a later poll)


Spawn = Callable[[Sequence[str]], "subprocess.Popen[bytes]"]


def _spawn(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # a fixed argv, no shell
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=False,
    )


class GpuProbe:
    def __init__(
        self,
        timeout: float,
        *,
        respawn_after: float = 300.0,
        argv: Sequence[str] = CHILD_ARGV,
        spawn: Spawn = _spawn,
    ) -> None:
        self.timeout = timeout
        self._argv = tuple(argv)
        self._spawn = spawn
        self._child: subprocess.Popen[bytes] | None = None
        self._since: float | None = None  # when the outstanding request was sent
        self._stall_said = False
        self._input_closed = False
        self._buf = b""
        self._respawn_at = float("-inf")
        self.respawn_after = respawn_after
        self.children_started = 0

    @property
    def child_pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    def poll(self, now: float) -> ProbeResult:
        if self._child is None:
            if now < self._respawn_at:
                return ProbeResult()
            self._child = self._spawn(self._argv)
            self.children_started += 1
        child = self._child
        if self._since is None:
            # A write that fails finds the child's input closed: almost always a child that is
            # ending (one that cannot start NVML answers, then exits) and not yet reaped. Its
            # exit, with its status, is what is said; a child that lives on with its input
            # closed is ended after the timeout.
            self._input_closed = not self._send(child)
            self._since = now
        line = self._read_line(child)
        if line is not None:
            self._since = None
            self._stall_said = False
            try:
                answer = json.loads(line)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                answer = {"error": "probe child answered with no JSON object"}
            return ProbeResult(sample=answer)
        if child.poll() is not None:
            return self._ended(now, f"probe child exited rc={child.returncode}")
        waited = now - self._since
        if self._input_closed:
            if waited > self.timeout:
                return self._ended(now, "probe child closed its input")
            return ProbeResult()
        if waited > self.timeout and not self._stall_said:
            self._stall_said = True
            return ProbeResult(stalled_for=waited)
        return ProbeResult()

    def _ended(self, now: float, why: str) -> ProbeResult:
        self._kill()
        # A child that cannot start NVML ends at once: start the next one no sooner than this.
        self._respawn_at = now + self.respawn_after
        return ProbeResult(ended=why)

    def close(self) -> None:
        self._kill()

    def _send(self, child: subprocess.Popen[bytes]) -> bool:
        assert child.stdin is not None
        try:
            child.stdin.write(b"sample\n")
            child.stdin.flush()
        except (BrokenPipeError, OSError):
            return False
        return True

    def _read_line(self, child: subprocess.Popen[bytes]) -> bytes | None:
        out = child.stdout
        assert out is not None
        fd = out.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], 0)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # EOF: the child is ending; the next poll sees its exit
            self._buf += chunk
            if len(self._buf) > MAX_ANSWER:
                self._buf = b""
                return b"{}"
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _kill(self) -> None:
        child = self._child
        self._reset()
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        for stream in (child.stdin, child.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        # Reap it when it goes at once; a child in uninterruptible sleep is left to systemd's
        # KillMode=control-group rather than holding the agent's stop.
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)

    def _reset(self) -> None:
        self._child = None
        self._since = None
        self._stall_said = False
        self._input_closed = False
        self._buf = b""


# How often sample_once looks for the child's answer: NVML answers in milliseconds, a child's
# start (Python, pynvml, nvmlInit) takes a few hundred.
SAMPLE_POLL_S = 0.02


def sample_once(
    timeout: float,
    argv: Sequence[str] = CHILD_ARGV,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any] | None:
    """One sample from a fresh probe child within ``timeout`` (None: no answer, the child
    ended, or it stalled; it is killed either way). For ``exec``'s check that the job released
    the GPUs (job/release.py)."""
    probe = GpuProbe(timeout, argv=argv)
    deadline = monotonic() + timeout
    try:
        while monotonic() < deadline:
            r = probe.poll(monotonic())
            if r.sample is not None:
                return r.sample
            if r.ended or r.stalled_for is not None:
                return None
            sleep(SAMPLE_POLL_S)
        return None
    finally:
        probe.close()
