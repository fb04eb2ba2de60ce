"""Small durable state in the state directory: atomic JSON files, the boot id, the line counter.

Every file is written to a temporary name, fsynced and renamed, so a crash or power loss leaves
either the old or the new content, never a torn file. Readers treat a missing or unreadable file
as "no state" and never raise.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

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


def atomic_write(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # Per thread, not only per process: a probe thread that outlived its tick may write the same
    # file as the next tick's.
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:  # a short write must not become a short file
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, sort_keys=True) + "\n").encode())


def read_json(path: str | Path) -> Any:
    """The parsed file, or None when missing or corrupt."""
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
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
        return (Path(state_dir) / PHASE_FILE).read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def write_phase(state_dir: str | Path, phase: str) -> None:
    atomic_write(Path(state_dir) / PHASE_FILE, (phase + "\n").encode())
