"""The boot counter's file edge: the ``bc`` field of every line (docs/serial-protocol.md, "Boot
counter"; the rule is :mod:`vm.bootrule`, pure).

``<state_dir>/boot.count`` (root, 0600, next to ``signing.key``) holds ``"<counter> <boot id>\\n"``.
The first writer of a boot (the stored boot id is another one) increments it under an flock
(``<state_dir>/boot.count.lock``) and makes the new value durable (tmp + fsync + rename + dir
fsync) **before** any line uses it, so a value is never handed to two boots. Later writers of the
boot read it back (or the per-boot cache ``<run_dir>/bc.<8 hex boot>``, tmpfs).
:class:`BootCounter` (paths injected) answers a :class:`BootCount` once per counter; a process
makes one (vm.console.boot_count, when its console is opened).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gce_watchdog.vm.bootrule import (
    COUNT_FILE,
    KEY_FILE,
    LOCK_FILE,
    NONE,
    Plan,
    Stored,
    Unusable,
    parse,
    plan,
    render,
    unwritable,
    wire_value,
)
from gce_watchdog.vm.state import untrusted_dir
from gce_watchdog.wire.protocol import bc_counter

__all__ = ["COUNT_FILE", "LOCK_FILE", "WARN_TEXT", "BootCount", "BootCounter"]


@dataclass(frozen=True)
class BootCount:
    """The counter of this boot as lines carry it (``value``: digits or ``-``) and, for ``-``,
    why (``problem``: said once per process as ``warn what=bootcount``)."""

    value: str
    problem: str = ""


WARN_TEXT = "no boot counter, bc=-: boots of this VM are ordered by position only ({why})"


def _read_regular(path: Path, limit: int = 256) -> bytes | None:
    """A regular file's bytes, never following a link nor blocking on a FIFO. None: absent.
    Raises OSError (ELOOP for a link, EINVAL for anything not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        _regular(fd)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _regular(fd: int) -> None:
    """Raises OSError (EINVAL) unless ``fd`` is a regular file (opened O_NOFOLLOW|O_NONBLOCK:
    a FIFO or a device planted there is neither read nor locked)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise OSError(errno.EINVAL, "not a regular file")


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symlink (not followed)"
    return f"cannot be read ({e.strerror or e})"


class BootCounter:
    """The counter of the current boot (the edge: the state dir, the run dir, the boot id).

    :meth:`get` resolves once per counter (the same :class:`BootCount` afterwards). The per-boot
    cache ``<run_dir>/bc.<8 hex>`` (tmpfs) is read first and written after a value is settled,
    ``-`` included, so every writer of a boot carries the same ``bc`` even when the state dir
    changes under it (space freed, ``boot.count`` restored): those take effect at the next boot.
    The cache is neither read nor written in a run dir the agent does not trust (another owner,
    writable by group or others, a symlink: a planted value would speak for the boot).

    ``state_dir`` None: the writer has no trusted state dir (the agent's untrusted-state
    fallback keeps its state in a private directory for one run: counting there would start at
    1 again). The boot's cached value is used when there is one, else ``-``.
    """

    def __init__(self, state_dir: str | Path | None, run_dir: str | Path, boot_id: str) -> None:
        self.state = Path(state_dir) if state_dir is not None else None
        self.run = Path(run_dir)
        self.boot_id = (boot_id + "0" * 32)[:32]  # vm.state.read_boot_id's form
        self.cache = self.run / f"bc.{boot_id[:8]}"
        self._answer: BootCount | None = None
        # a run dir someone else could write (vm.state.untrusted_dir): its cache is not used
        self._cache_ok = untrusted_dir(self.run) is None

    def get(self) -> BootCount:
        if self._answer is None:
            self._answer = self._resolve()
        return self._answer

    def _resolve(self) -> BootCount:
        cached = self._read_cache()
        if cached is not None:
            return cached
        if self.state is None:
            p = Plan(None, False, "no trusted state dir (docs/agent.md)")
        else:
            p = self._plan_in(self.state)
        answer = BootCount(wire_value(p.value), p.problem)
        self._write_cache(answer)
        return answer

    def _plan_in(self, state: Path) -> Plan:
        try:
            return self._locked_plan(state)
        except OSError as e:
            return unwritable(e.strerror or str(e))

    def _read_cache(self) -> BootCount | None:
        if not self._cache_ok:
            return None
        try:
            data = _read_regular(self.cache, 256)
        except OSError:
            return None
        if data is None:
            return None
        parts = data.decode("ascii", "replace").split(" ", 1)
        v = parts[0].strip()
        why = parts[1].strip() if len(parts) > 1 else ""
        if v == NONE:
            return BootCount(NONE, why or "settled earlier in this boot")
        if bc_counter(v) is not None:
            return BootCount(v)
        return None  # damaged: decided again (the state file answers the same for this boot)

    def _write_cache(self, answer: BootCount) -> None:
        if not self._cache_ok:
            return
        data = f"{answer.value} {answer.problem}"[:200].strip() + "\n"
        with contextlib.suppress(OSError):
            self.run.mkdir(mode=0o755, parents=True, exist_ok=True)
            tmp = self.run / f".bc.{self.boot_id[:8]}.{os.getpid()}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(tmp, flags, 0o600)
            try:
                os.write(fd, data.encode("ascii", "replace"))
            finally:
                os.close(fd)
            try:
                os.replace(tmp, self.cache)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _read_stored(self, state: Path) -> Stored | Unusable | None:
        try:
            data = _read_regular(state / COUNT_FILE)
        except OSError as e:
            return Unusable(_why(e))
        return None if data is None else parse(data)

    def _locked_plan(self, state: Path) -> Plan:
        """The rule applied under the lock, and its write done before it returns (``-`` when
        the lock cannot be taken where a write is needed)."""
        lock, lock_error = self._lock(state)
        try:
            stored = self._read_stored(state)
            key = os.path.lexists(state / KEY_FILE)
            p = plan(stored, key, self.boot_id)
            if not p.write or p.value is None:
                return p
            if lock is None:
                return unwritable(f"{LOCK_FILE}: {lock_error}")
            try:
                self._persist(state, Stored(p.value, self.boot_id))
            except OSError as e:
                return unwritable(e.strerror or str(e))
            return p
        finally:
            if lock is not None:
                os.close(lock)  # releases the flock

    def _lock(self, state: Path) -> tuple[int | None, str]:
        """The flock on ``boot.count.lock``; (None, why) when it cannot be taken (a read-only
        or full state dir: the stored value can still be read, nothing can be written)."""
        try:
            state.mkdir(mode=0o755, parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(state / LOCK_FILE, flags, 0o600)
        except OSError as e:
            return None, e.strerror or str(e)
        try:
            _regular(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            os.close(fd)
            return None, e.strerror or str(e)
        return fd, ""

    def _persist(self, state: Path, s: Stored) -> None:
        """tmp + fsync + rename + dir fsync: durable before any line uses the value."""
        path = state / COUNT_FILE
        tmp = state / f".{COUNT_FILE}.{os.getpid()}.tmp"
        data = render(s)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(tmp, flags, 0o600)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, "short write")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        dfd = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
