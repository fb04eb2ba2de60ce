"""Sizes as operators write them: ``"512MiB"``, ``"1GiB"``, ``"1.5GiB"``, ``"2GB"``, ``"4096B"``.

One parser for every flag and config key that takes a size. A unit is required: a bare ``1.5``
could mean bytes or GiB, and reading it as either silently is how a pass band of 1.5 bytes
happens. Binary units (``KiB``, ``MiB``, ``GiB``, ``TiB``, and the short ``K``/``M``/``G``/``T``)
are powers of 1024; decimal ones (``kB``/``KB``, ``MB``, ``GB``, ``TB``) powers of 1000.
"""

from __future__ import annotations

import math
import re

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*\Z")
_UNITS = {
    "B": 1,
    "K": 1 << 10,
    "KIB": 1 << 10,
    "KB": 10**3,
    "M": 1 << 20,
    "MIB": 1 << 20,
    "MB": 10**6,
    "G": 1 << 30,
    "GIB": 1 << 30,
    "GB": 10**9,
    "T": 1 << 40,
    "TIB": 1 << 40,
    "TB": 10**12,
}
GIB = 1 << 30


def parse_size(value: object) -> int:
    """Bytes from a string with a unit. Raises ValueError (with the accepted forms) otherwise;
    for a bare number the message suggests the GiB it most likely meant."""
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).upper() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).upper()]
            if math.isfinite(n):
                return int(n)
        if re.fullmatch(r"\s*\d+(?:\.\d+)?\s*", value):
            raise ValueError(f"a size needs a unit: {value.strip()!r} (e.g. {value.strip()}GiB)")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(f"a size needs a unit: {value!r} (e.g. '{value}GiB')")
    raise ValueError(f"expected a size like '512MiB', '1GiB' or '2GB', got {value!r}")


def format_size(n: int) -> str:
    """The shortest exact binary form: ``"1GiB"``, ``"1536MiB"``, ``"4097B"``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
