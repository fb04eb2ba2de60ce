"""Small durable state in the state directory: the boot id, the line counter, the job phase.

Files are written atomically (``gce_watchdog.lib.files``); readers treat a missing or unreadable
file as "no state" and never raise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path

from gce_watchdog.lib.files import atomic_write

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """The kernel boot id without dashes (32 hex); 'unknown' style fallback is all zeros."""
    try:
        raw = Path(path).read_text().strip().replace("-", "").lower()
    except OSError:
        return "0" * 32
    return raw if raw and all(c in "0123456789abcdef" for c in raw) else "0" * 32


def short_boot(boot_id: str) -> str:
    """The 8-hex form used on the wire."""
    return (boot_id + "0" * 8)[:8]


def untrusted_dir(path: str | Path, euid: int | None = None) -> str | None:
    """Why a state or run directory must not be trusted by an agent running as root, or None.

    As root, a directory owned by another user, writable by group or others, or a symlink could
    have been prepared by someone else (a planted ``disarm.json``, a link where the lock goes).
    A directory that does not exist yet is fine: the agent creates it (root, 0755). Not root:
    nothing to check (the kernel's permissions are the owner's).
    """
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != 0:
        return f"is owned by uid {st.st_uid}, not root"
    if st.st_mode & 0o022:
        who = " and ".join(
            w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit
        )
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class SeqAllocator:
    """Per-boot line counter shared by every process that writes lines (agent, CLI, start-up
    script): ``<run_dir>/seq.<boot>`` (tmpfs, so a full or read-only state dir cannot touch it)
    under an exclusive flock. A new boot has a new file and starts at 0.

    The record is fixed-width and rewritten in place (``pwrite``, never truncated), so once the
    file exists an update needs no new block: a full tmpfs cannot fail it. If the file cannot be
    used at all (it could not even be created), numbering never falls back to 0: it continues
    from CLOCK_BOOTTIME in microseconds, above every seq the counter can have handed out (the
    console carries far fewer than one line per microsecond), and strictly increasing within
    this process.
    """

    WIDTH = 20  # digits of the in-place record: up to 10**20 lines

    def __init__(
        self,
        directory: str | Path,
        boot: str,
        floor: Callable[[], int] = lambda: time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1000,
    ) -> None:
        self.path = Path(directory) / f"seq.{boot}"
        self.boot = boot
        self.floor = floor
        self.fallbacks = 0  # lines numbered without the file
        self._last = -1

    def next(self) -> int:
        try:
            n = self._next_locked()
        except OSError:
            self.fallbacks += 1
            n = max(self._last + 1, self.floor())
        self._last = n
        return n

    def _next_locked(self) -> int:
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW  # a planted link: refused
        fd = os.open(self.path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            n = int(raw) if raw.isdigit() else 0
            data = f"{n + 1:0{self.WIDTH}d}\n".encode()
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(errno.ENOSPC, "short write of the seq record")
            return n
        finally:
            os.close(fd)  # releases the lock


class KeyUnavailable(Exception):
    """The line-signing key can be neither read nor created (not root, or no writable place)."""


KEY_FILE = "key"


def load_or_create_key(state_dir: str | Path, run_dir: str | Path) -> tuple[bytes, Path]:
    """The instance's secret line key and where it lives, creating it (0600) on first use.

    ``<state_dir>/key`` is the key for the life of the instance (the poller pins it). A key file
    that is not ours alone (another owner, group or world bits) may have leaked: it is replaced.
    When the state dir cannot hold a new key (full, read-only), a key for this boot is kept in
    the run dir (tmpfs); the poller will see another key at the next boot and raise a conflict.
    """
    from gce_watchdog.wire.protocol import KEY_BYTES

    errors = []
    for d in (Path(state_dir), Path(run_dir)):
        p = d / KEY_FILE
        bad = False
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            pass
        except OSError as e:
            errors.append(f"{p}: {e.strerror or e}")
            continue
        else:
            try:
                st = os.fstat(fd)
                data = os.read(fd, KEY_BYTES + 1)
            finally:
                os.close(fd)
            if st.st_uid == os.geteuid() and not st.st_mode & 0o077 and len(data) == KEY_BYTES:
                return data, p
            bad = True
        try:
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            key = secrets.token_bytes(KEY_BYTES)
            tmp = d / f".{KEY_FILE}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                if os.write(fd, key) != KEY_BYTES:
                    raise OSError(errno.ENOSPC, "short write of the key")
                os.fsync(fd)
            finally:
                os.close(fd)
            # link, not rename: of two writers creating the key at once, the second keeps the first
            if bad:
                os.replace(tmp, p)  # a key that may have leaked is replaced
                return key, p
            try:
                os.link(tmp, p)
            except FileExistsError:
                os.unlink(tmp)
                return load_or_create_key(state_dir, run_dir)
            os.unlink(tmp)
            return key, p
        except OSError as e:
            errors.append(f"{p}: {e.strerror or e}")
            with contextlib.suppress(OSError):
                os.unlink(d / f".{KEY_FILE}.{os.getpid()}.tmp")
    raise KeyUnavailable("; ".join(errors))


# The current job phase (bootstrap, workload, done, setup_failed), written by `gce-watchdog phase`
# and friends, read by the agent for its heartbeat lines.
PHASE_FILE = "phase"


def read_phase(state_dir: str | Path) -> str:
    try:
        fd = os.open(Path(state_dir) / PHASE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(256)
        return raw.decode("utf-8").strip() or "unknown"
    except (OSError, ValueError):  # ValueError: not UTF-8 (anyone with root may write it)
        return "unknown"


def write_phase(state_dir: str | Path, phase: str) -> None:
    atomic_write(Path(state_dir) / PHASE_FILE, (phase + "\n").encode())
