"""Small durable state in the state directory: the boot id, the line counter, the job phase.

Files are written atomically (``gce_watchdog.lib.files``); readers treat a missing or unreadable
file as "no state" and never raise.
"""

from __future__ import annotations

import fcntl
import os
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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
        with open(Path(state_dir) / PHASE_FILE, "rb") as f:
            raw = f.read(256)
        return raw.decode("utf-8").strip() or "unknown"
    except (OSError, ValueError):  # ValueError: not UTF-8 (anyone with root may write it)
        return "unknown"


def write_phase(state_dir: str | Path, phase: str) -> None:
    atomic_write(Path(state_dir) / PHASE_FILE, (phase + "\n").encode())
