"""The pins of the repository's requirement files (packaging/*.lock, constraints-dev.txt)."""

from __future__ import annotations

import re
from pathlib import Path

_HASHED = re.compile(r"([A-Za-z0-9._-]+)==(\S+)((?: --hash=sha256:[0-9a-f]{64})+)")


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def hash_pinned(lock: Path) -> dict[str, str]:
    """name -> version of a lock whose every line is ``name==version --hash=sha256:...`` (comments
    and blanks skipped); any other line fails the calling test."""
    pins = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            m = _HASHED.fullmatch(line)
            assert m, f"{lock.name}: not a hash-pinned line: {line}"
            pins[canonical(m[1])] = m[2]
    return pins
