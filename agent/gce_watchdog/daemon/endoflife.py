"""The one end-of-life path of a job: ``gce-watchdog end`` hands the ending to the agent.

The job's terminal line (``exit``, ``phase done``, ``setup_failed``) is written and drained by the
command that wrote it. Then ``gce-watchdog end --reason done|failed|setup_failed`` asks the agent
for the rest: the action chain's :meth:`~gce_watchdog.daemon.actions.ActionChain.end_of_life`
(an ``end`` line, the linger so a poller reads the terminal line while the VM is RUNNING, the
configured action, the power-off with escalation). docs/actions.md, "The one end-of-life path".

The hand-off is two files in the run directory (a tmpfs, gone at the next boot; the boot id is
checked too):

- ``end.json``: the request and how far its chain got (``reason``, ``linger``, ``boot``,
  ``state`` = ``requested`` | ``taken``, ``step``, ``since``, ``by``), replaced atomically.
- ``end.lock``: an exclusive ``flock`` held by whoever runs the chain, for as long as it runs
  (the kernel drops it when that process dies, so a dead runner's chain is resumed, never lost).

The agent looks for a request at every tick (:class:`EndWatch`, on the loop's thread like the
ladder's chain). The command waits ``hand_off_wait`` for the agent to take it; when no agent
takes it (the unit is not running), the command takes it and runs the chain itself, ignoring
SIGTERM and SIGHUP as the agent does during a chain. Either way the chain runs exactly once per
boot: one request per boot (a second ``end`` joins the first), one lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gce_watchdog.daemon.actions import ChainStopped
from gce_watchdog.lib.cli import EX_UNAVAILABLE
from gce_watchdog.lib.files import read_json, write_json
from gce_watchdog.wire import vocab

REQUEST_FILE = "end.json"
LOCK_FILE = "end.lock"
# The linger a request may carry: what the config allows for actions.linger.
LINGER_MAX_S = 3600.0
# The steps a chain can be resumed at (actions.STEP_ORDER, and "end": it ran through).
STEPS = ("shutdown", "linger", "delete", "stop", "poweroff", "force", "kernel", "end")
# How often a chain that ran through with the VM still up is tried again (from the power-off).
RETRY_S = 60.0


def parse_linger(raw: str) -> float:
    """A linger as a command line or metadata value gives it ('90s', '2m', '75'): finite, 0 to
    1 h. Raises ValueError (``inf``, ``-1s``, ``nan`` and garbage are refused)."""
    from gce_watchdog.lib.durations import parse_duration

    v = parse_duration(raw.strip())
    if not math.isfinite(v) or not 0 <= v <= LINGER_MAX_S:
        raise ValueError(f"linger must be 0 to 1h, got {raw!r}")
    return v


@dataclass(frozen=True)
class EndRequest:
    """One end of life asked for in this boot, and how far its chain got."""

    reason: str
    boot: str
    linger: float | None = None  # None: actions.linger
    state: str = "requested"  # requested | taken
    step: str = "shutdown"  # the chain's mark (persisted before each step)
    since: float = 0.0  # wall time the chain started (a resumed linger waits what is left)
    by: int = 0  # pid of the process running the chain

    def to_json(self) -> dict[str, object]:
        return {
            "reason": self.reason,
            "boot": self.boot,
            "linger": self.linger,
            "state": self.state,
            "step": self.step,
            "since": self.since,
            "by": self.by,
        }

    @staticmethod
    def from_json(raw: Any) -> EndRequest | None:
        """Any content at all gives a request or None, never an exception."""
        if not isinstance(raw, dict):
            return None
        reason, boot = raw.get("reason"), raw.get("boot")
        if reason not in vocab.END_REASONS or not isinstance(boot, str) or not boot:
            return None
        linger = raw.get("linger")
        if linger is not None:
            if not isinstance(linger, int | float) or isinstance(linger, bool):
                return None
            if not math.isfinite(linger) or not 0 <= linger <= LINGER_MAX_S:
                return None
        state = raw.get("state") if raw.get("state") in ("requested", "taken") else "requested"
        step = raw.get("step") if raw.get("step") in STEPS else "shutdown"
        since = raw.get("since")
        ok_since = isinstance(since, int | float) and not isinstance(since, bool)
        by = raw.get("by")
        return EndRequest(
            str(reason),
            boot[:64],
            None if linger is None else float(linger),
            str(state),
            str(step),
            float(since) if ok_since and math.isfinite(since) else 0.0,  # type: ignore[arg-type]
            by if isinstance(by, int) and not isinstance(by, bool) else 0,
        )


class EndBox:
    """The request file and the runner's lock in ``run_dir``, for one boot."""

    def __init__(self, run_dir: str | Path, boot: str) -> None:
        self.dir = Path(run_dir)
        self.boot = boot
        self.path = self.dir / REQUEST_FILE
        self.lock_path = self.dir / LOCK_FILE

    def load(self) -> EndRequest | None:
        """This boot's request, or None (none, garbage, or another boot's)."""
        req = EndRequest.from_json(read_json(self.path))
        return req if req is not None and req.boot == self.boot else None

    def request(self, reason: str, linger: float | None) -> EndRequest:
        """Ask for the end of life. The first request of a boot wins: a later one joins it (its
        reason and linger are not taken), so one boot ends once."""
        old = self.load()
        if old is not None:
            return old
        req = EndRequest(reason, self.boot, linger)
        write_json(self.path, req.to_json())
        return req

    def _open_lock(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted at the lock's name is refused, never opened through.
        return os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)

    def busy(self) -> bool:
        """Whether a live process holds the runner's lock (runs the chain) now."""
        try:
            fd = self._open_lock()
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops a lock we got
        return False

    def take(self) -> Taken | None:
        """The request with the runner's lock, when one is pending and nobody runs it; else None.
        The caller runs the chain and keeps the lock (:meth:`Taken.release`) until it is done."""
        if not self.path.exists():  # the cheap check at every tick
            return None
        try:
            fd = self._open_lock()
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        req = self.load()
        if req is None:
            os.close(fd)
            return None
        return Taken(self, req, fd)


class Taken:
    """A request whose runner's lock this process holds."""

    def __init__(self, box: EndBox, req: EndRequest, fd: int) -> None:
        self.box = box
        self.req = req
        self.fd = fd

    def mark(self, step: str, since: float) -> None:
        """Persist the chain's progress (before each step); best effort."""
        self.req = EndRequest(
            self.req.reason,
            self.req.boot,
            self.req.linger,
            "taken",
            step if step in STEPS else "shutdown",
            since,
            os.getpid(),
        )
        with contextlib.suppress(OSError):
            write_json(self.box.path, self.req.to_json())

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class EndChain(Protocol):
    """``ActionChain.end_of_life``."""

    def __call__(
        self,
        reason: str,
        *,
        linger: float | None = None,
        resume_at: str | None = None,
        linger_left: float | None = None,
        progress: Callable[[str], object] | None = None,
    ) -> None: ...


def run_taken(
    taken: Taken,
    chain: EndChain,
    wall: Callable[[], float],
    default_linger: float,
) -> None:
    """Run (or resume) the chain of a taken request; the mark is ``end`` when it ran through."""
    req = taken.req
    fresh = req.state != "taken"
    since = wall() if fresh or req.since <= 0 else req.since
    resume_at = None if fresh or req.step == "shutdown" else req.step
    linger_left = None
    if resume_at == "linger":
        full = default_linger if req.linger is None else req.linger
        spent = wall() - since
        linger_left = full if spent < 0 else max(0.0, full - spent)  # the clock went back: all
    taken.mark("shutdown" if resume_at is None else resume_at, since)

    def progress(step: str) -> None:
        taken.mark(step, since)

    try:
        chain(
            req.reason,
            linger=req.linger,
            resume_at=resume_at,
            linger_left=linger_left,
            progress=progress,
        )
    except ChainStopped:
        raise  # the agent stopped in the linger: the mark stays there, a restart resumes it
    except BaseException:
        taken.mark("end", since)
        raise
    # Ran through (or raised) with the VM still up: the next attempt powers off again.
    taken.mark("end", since)


class EndWatch:
    """The agent's side: at every tick, take a pending request and run its chain (blocking the
    loop's thread, as the ladder's chain does). Keeps the lock once taken; a chain that ran
    through with the VM still up is tried again from the power-off every ``retry_s``."""

    def __init__(
        self,
        box: EndBox,
        chain: EndChain,
        wall: Callable[[], float],
        monotonic: Callable[[], float],
        default_linger: float,
        retry_s: float = RETRY_S,
    ) -> None:
        self.box = box
        self.chain = chain
        self.wall = wall
        self.monotonic = monotonic
        self.default_linger = default_linger
        self.retry_s = retry_s
        self.taken: Taken | None = None
        self.running = False
        self._ended: float | None = None

    def poll(self) -> bool:
        """Run the end-of-life chain when one is due; True when it ran."""
        if self.taken is None:
            self.taken = self.box.take()
            if self.taken is None:
                return False
        elif self._ended is not None and self.monotonic() - self._ended < self.retry_s:
            return False
        self.running = True
        try:
            run_taken(self.taken, self.chain, self.wall, self.default_linger)
        finally:
            self.running = False
            self._ended = self.monotonic()
        return True

    @property
    def step(self) -> str:
        """The step the running chain is at ("-": none running)."""
        return self.taken.req.step if self.running and self.taken is not None else "-"

    @property
    def lingers(self) -> bool:
        """Whether the taken request's chain lingers."""
        if self.taken is None:
            return False
        linger = self.taken.req.linger
        return (self.default_linger if linger is None else linger) > 0

    def start(self) -> None:
        return None

    def stop(self, timeout: float = 0.0) -> None:
        if self.taken is not None:
            self.taken.release()


# ---------------------------------------------------------------------------------------------
# the command side


class Waiter(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


def flock_held(path: str | Path, locks: str = "/proc/locks") -> bool | None:
    """Whether a process holds an ``flock`` on ``path`` now, read from the kernel's lock table
    (``/proc/locks``: ``N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF``) without taking it, so
    an agent starting at this moment never finds its lock busy. None: cannot tell."""
    try:
        st = os.stat(path)
        with open(locks, encoding="ascii", errors="replace") as f:
            table = f.read(1 << 20)
    except FileNotFoundError:
        return False if not os.path.exists(path) else None
    except OSError:
        return None
    for line in table.splitlines():
        parts = line.split()
        if len(parts) < 6 or "FLOCK" not in parts or "->" in parts:
            continue
        dev = parts[parts.index("FLOCK") + 4] if len(parts) > parts.index("FLOCK") + 4 else ""
        maj, _, rest = dev.partition(":")
        mnr, _, ino = rest.partition(":")
        try:
            ours = (int(maj, 16), int(mnr, 16), int(ino)) == (
                os.major(st.st_dev),
                os.minor(st.st_dev),
                st.st_ino,
            )
        except ValueError:
            continue
        if ours:
            return True
    return False


def hand_off(
    box: EndBox,
    wait_s: float,
    waiter: Waiter,
    agent_up: Callable[[], bool | None] = lambda: None,
    step_s: float = 0.25,
) -> Taken | None:
    """Wait (bounded) for the agent to take this boot's request. None: the agent has it (it
    runs the chain, or already ran it); a :class:`Taken`: no agent took it within ``wait_s``
    (or ``agent_up()`` says no agent runs: no wait at all), and this process holds the lock and
    must run the chain itself."""
    end = waiter.monotonic() + wait_s
    for _ in range(int(wait_s / step_s) + 2):  # bounded: one pass per step
        req = box.load()
        # Taken and its runner alive (the agent keeps the lock while it runs). A runner that died
        # left its mark: this process resumes it below.
        if req is not None and req.state == "taken" and box.busy():
            return None
        if waiter.monotonic() >= end or agent_up() is False:
            break
        waiter.sleep(min(step_s, max(0.0, end - waiter.monotonic())))
    # Taken by the agent just now: None. Else this process runs it (also a chain whose runner
    # died mid-way: it resumes at its mark).
    return box.take()


class RealWaiter:
    def monotonic(self) -> float:
        import time

        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        import time

        time.sleep(max(0.0, seconds))


def run_here(cfg: Any, box: EndBox, taken: Taken | None, reason: str, linger: float | None) -> int:
    """The chain in this process (no agent took the ending)."""
    import time

    from gce_watchdog.daemon.actions import ActionChain
    from gce_watchdog.daemon.metawatch import MetadataWatcher, load_instance_cache
    from gce_watchdog.vm.runtime import open_console

    print("gce-watchdog end: no agent took the ending; running the chain here", file=sys.stderr)
    con = open_console(cfg)
    try:
        if load_instance_cache(cfg.agent.state_dir) is None and cfg.agent.action in (
            "delete",
            "stop",
        ):
            # No agent ever learnt who this VM is: ask the metadata server once (bounded by
            # watch.request_timeout per request), so a delete still finds its instance.
            with contextlib.suppress(Exception):
                MetadataWatcher.from_config(cfg, con.emitter).refresh_once()
        chain = ActionChain.from_config(cfg, con.emitter, keepalive=lambda: None)
        if taken is None:  # no request file could be written: run without persisting
            chain.end_of_life(reason, linger=linger)
        else:
            try:
                run_taken(taken, chain.end_of_life, time.time, cfg.actions.linger)
            finally:
                taken.release()
    finally:
        con.close()
    print("gce-watchdog end: the chain ran through and the VM is still up", file=sys.stderr)
    return EX_UNAVAILABLE


__all__ = [
    "EndBox",
    "EndRequest",
    "EndWatch",
    "Taken",
    "hand_off",
    "parse_linger",
    "run_taken",
]
