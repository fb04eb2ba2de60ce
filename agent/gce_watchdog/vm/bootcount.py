"""The boot counter: the ``bc`` field of every line (docs/serial-protocol.md, "Boot counter").

``<state_dir>/boot.count`` (root, 0600, next to ``signing.key``) holds ``"<counter> <boot id>\\n"``:
the counter of the last boot that wrote a line and that boot's full kernel boot id (32 hex). The
first writer of a boot (the stored boot id is another one) increments it under an flock
(``<state_dir>/boot.count.lock``) and makes the new value durable (tmp + fsync + rename + dir
fsync) **before** any line uses it, so a value is never handed to two boots. Later writers of the
boot read it back (or the per-boot cache ``<run_dir>/bc.<8 hex boot>``, tmpfs).

:func:`plan` is the rule (pure): which value for this boot, given what the file holds, whether the
line key exists and the boot id. :class:`BootCounter` is the edge (paths injected): it reads, locks,
writes and caches, and answers a :class:`BootCount` once per process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path

COUNT_FILE = "boot.count"
LOCK_FILE = "boot.count.lock"
KEY_FILE = "signing.key"  # vm.state.KEY_FILE (not imported: the rule needs only its presence)
MAX_COUNT = 999_999_999_999  # the wire's bound: 1..12 digits
NONE = "-"  # the wire's "no counter"
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Stored:
    """What ``boot.count`` holds: the last counted boot's value (0: none counted yet, an
    operator's seed) and its full boot id."""

    count: int
    boot_id: str


@dataclass(frozen=True)
class Unusable:
    """``boot.count`` is there but cannot be used (not a regular file, a symlink, garbage,
    unreadable): the counter is lost, never restarted."""

    why: str


@dataclass(frozen=True)
class Plan:
    """The rule's answer. ``value`` None: ``bc=-`` (``problem`` says why). ``write``: persist
    ``Stored(value, boot_id)`` durably before any line uses ``value``; if that fails the boot
    gets ``-`` (:func:`unwritable`)."""

    value: int | None
    write: bool
    problem: str = ""


def plan(stored: Stored | Unusable | None, key_exists: bool, boot_id: str) -> Plan:
    """Which counter the boot ``boot_id`` gets (pure).

    - the file names this boot: its value, nothing written (a later writer of the boot);
    - the file names another boot: that value + 1, written first (the boot's first write);
    - no file and no line key yet (the instance's first boot): 1, written first;
    - no file while the key exists, or a file that cannot be used: the counter was lost.
      ``-``, never a restart at 1 (that would hand out values earlier boots used);
    - the counter at its maximum: ``-`` (never wraps).
    """
    if isinstance(stored, Unusable):
        return Plan(None, False, f"{COUNT_FILE} {stored.why}: the counter is lost")
    if stored is None:
        if key_exists:
            return Plan(None, False, f"{COUNT_FILE} is missing while {KEY_FILE} exists: lost")
        return Plan(1, True)
    if stored.boot_id == boot_id and stored.count >= 1:
        return Plan(stored.count, False)
    if stored.count >= MAX_COUNT:
        return Plan(None, False, f"{COUNT_FILE} is at its maximum ({MAX_COUNT})")
    return Plan(stored.count + 1, True)


def unwritable(why: str) -> Plan:
    """The plan when the write a :func:`plan` asked for failed: ``-`` for this boot."""
    return Plan(None, False, f"{COUNT_FILE} cannot be written ({why})")


def parse(data: bytes) -> Stored | Unusable:
    """``boot.count``'s content: ``"<counter> <32 hex>\\n"``, counter 0..MAX_COUNT, no leading
    zeros (pure)."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return Unusable("is not ASCII")
    parts = text.split()
    if len(parts) != 2 or not text.endswith("\n"):
        return Unusable("is not '<counter> <boot id>'")
    n, bid = parts
    if not n.isdigit() or not n.isascii() or (len(n) > 1 and n[0] == "0") or int(n) > MAX_COUNT:
        return Unusable(f"holds a bad counter {n[:16]!r}")
    if len(bid) != 32 or not set(bid) <= _HEX:
        return Unusable("holds a bad boot id")
    return Stored(int(n), bid)


def render(s: Stored) -> bytes:
    return f"{s.count} {s.boot_id}\n".encode()


def wire_value(value: int | None) -> str:
    """The ``bc`` field's value: decimal, or ``-``."""
    return NONE if value is None else str(value)


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
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symlink (not followed)"
    return f"cannot be read ({e.strerror or e})"


class BootCounter:
    """The counter of the current boot (the edge: the state dir, the run dir, the boot id).

    :meth:`get` answers once per process (the same :class:`BootCount` afterwards). The per-boot
    cache ``<run_dir>/bc.<8 hex>`` (tmpfs) is read first and written after a value is settled,
    ``-`` included, so every writer of a boot carries the same ``bc`` even when the state dir
    changes under it (space freed, ``boot.count`` restored): those take effect at the next boot.
    """

    def __init__(self, state_dir: str | Path, run_dir: str | Path, boot_id: str) -> None:
        self.state = Path(state_dir)
        self.run = Path(run_dir)
        self.boot_id = (boot_id + "0" * 32)[:32]  # vm.state.read_boot_id's form
        self.cache = self.run / f"bc.{boot_id[:8]}"
        self._answer: BootCount | None = None

    def get(self) -> BootCount:
        if self._answer is None:
            self._answer = self._resolve()
        return self._answer

    def _resolve(self) -> BootCount:
        cached = self._read_cache()
        if cached is not None:
            return cached
        try:
            p = self._locked_plan()
        except OSError as e:
            p = unwritable(e.strerror or str(e))
        answer = BootCount(wire_value(p.value), p.problem)
        self._write_cache(answer)
        return answer

    def _read_cache(self) -> BootCount | None:
        try:
            data = _read_regular(self.cache, 64)
        except OSError:
            return None
        if data is None:
            return None
        parts = data.decode("ascii", "replace").split(" ", 1)
        v = parts[0].strip()
        why = parts[1].strip() if len(parts) > 1 else ""
        if v == NONE:
            return BootCount(NONE, why or "settled earlier in this boot")
        if v.isdigit() and v.isascii() and v[0] != "0" and int(v) <= MAX_COUNT:
            return BootCount(v)
        return None  # damaged: decided again (the state file answers the same for this boot)

    def _write_cache(self, answer: BootCount) -> None:
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

    def _read_stored(self) -> Stored | Unusable | None:
        try:
            data = _read_regular(self.state / COUNT_FILE)
        except OSError as e:
            return Unusable(_why(e))
        return None if data is None else parse(data)

    def _locked_plan(self) -> Plan:
        """The rule applied under the lock, and its write done before it returns. Raises
        OSError when the lock cannot be taken where a write is needed."""
        lock = self._lock()
        try:
            stored = self._read_stored()
            key = os.path.lexists(self.state / KEY_FILE)
            p = plan(stored, key, self.boot_id)
            if not p.write or p.value is None:
                return p
            if lock is None:
                return unwritable("no lock")
            try:
                self._persist(Stored(p.value, self.boot_id))
            except OSError as e:
                return unwritable(e.strerror or str(e))
            return p
        finally:
            if lock is not None:
                os.close(lock)  # releases the flock

    def _lock(self) -> int | None:
        """The flock on ``boot.count.lock``; None when it cannot be opened (a read-only or full
        state dir: the stored value can still be read, nothing can be written)."""
        try:
            self.state.mkdir(mode=0o755, parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(self.state / LOCK_FILE, flags, 0o600)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "the lock is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            return None
        return fd

    def _persist(self, s: Stored) -> None:
        """tmp + fsync + rename + dir fsync: durable before any line uses the value."""
        path = self.state / COUNT_FILE
        tmp = self.state / f".{COUNT_FILE}.{os.getpid()}.tmp"
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
        dfd = os.open(self.state, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
