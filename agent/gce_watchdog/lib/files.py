"""Atomic files: write to a temporary name, fsync, rename, fsync the directory.

A crash or power loss leaves either the old or the new content, never a torn file. Readers treat a
missing or unreadable file as "no state" and never raise.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # Per thread, not only per process: a probe thread that outlived its tick may write the same
    # file as the next tick's.
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    # O_NOFOLLOW: a link planted at the temporary name is refused, never written through (the
    # rename itself replaces a link at the final name, it does not follow it).
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, mode)
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


# State files are a few hundred bytes; anything longer is not ours and is not read whole.
STATE_FILE_MAX = 64 * 1024


def read_json(path: str | Path) -> Any:
    """The parsed file, or None when missing, corrupt, nested too deep or too big: any content
    at all gives an answer, never an exception. A symlink is not followed (None)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(STATE_FILE_MAX + 1)
        if len(data) > STATE_FILE_MAX:
            return None
        return json.loads(data)
    except (OSError, ValueError, RecursionError):
        return None
