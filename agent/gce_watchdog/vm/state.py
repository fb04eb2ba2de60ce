"""Small durable state in the state directory: the boot id, the line counter, the job phase.

Files are written atomically (``gce_watchdog.lib.files``); readers treat a missing or unreadable
file as "no state" and never raise.
"""

from __future__ import annotations

import fcntl
import os
import stat
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
    script), kept in ``<dir>/seq`` under an exclusive flock. A new boot restarts at 0.

    If the file cannot be used (read-only disk), falls back to an in-process counter: numbering
    stays increasing within this process, which is still better than no line at all.
    """

    def __init__(self, directory: str | Path, boot: str) -> None:
        self.path = Path(directory) / "seq"
        self.boot = boot
        self._fallback: int | None = None

    def next(self) -> int:
        if self._fallback is None:
            try:
                return self._next_locked()
            except OSError:
                self._fallback = 0
        self._fallback += 1
        return self._fallback - 1

    def _next_locked(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW  # a planted link: refused
        fd = os.open(self.path, flags, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 64, 0).decode("ascii", "replace").split()
            n = 0
            if len(raw) == 2 and raw[0] == self.boot and raw[1].isdigit():
                n = int(raw[1])
            data = f"{self.boot} {n + 1}\n".encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return n
        finally:
            os.close(fd)  # releases the lock


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
