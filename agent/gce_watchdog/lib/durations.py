"""Durations as operators write them: ``30``, ``"500ms"``, ``"30s"``, ``"10m"``, ``"1h30m"``.

One parser for every CLI flag and config key that takes a duration. A bare number is seconds
(TOML ``interval = 30``); a string is one or more ``<number><unit>`` parts, largest unit first,
each unit at most once (``"1h30m"``, ``"2m 30s"``, ``"1.5h"``, ``"1d12h"``), like systemd's and Go's
durations. :func:`format_duration` writes the shortest such string back.
"""

from __future__ import annotations

import math
import re

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_ORDER = ("d", "h", "m", "s", "ms")
_BARE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*\Z")
# "ms" before "m" and "s": the alternation must not read "500ms" as 500 minutes + "s".
_PART_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|d|h|m|s)")
_EXAMPLES = "30, '30s', '10m', '1h30m' or '500ms'"


def parse_duration(value: object) -> float:
    """Seconds from a number or a string like ``"500ms"``, ``"30s"``, ``"1h30m"``, ``"2h"``.

    Raises ValueError (naming the accepted forms) for anything else, negative or not finite.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like {_EXAMPLES}, got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"expected a finite duration >= 0, got {value!r}")
        return float(value)
    if isinstance(value, str):
        bare = _BARE_RE.match(value)
        if bare:
            return float(bare.group(1))
        total, pos, last = 0.0, 0, -1
        while pos < len(value) and value[pos:].strip():
            m = _PART_RE.match(value, pos)
            if not m:
                break
            rank = _ORDER.index(m.group(2))
            if rank <= last:  # "30m1h" or "1h1h": a typo, never a sum
                break
            total += float(m.group(1)) * _UNITS[m.group(2)]
            pos, last = m.end(), rank
        else:
            if last >= 0:
                return total
    raise ValueError(f"expected a duration like {_EXAMPLES}, got {value!r}")


def format_duration(seconds: float) -> str:
    """The shortest string :func:`parse_duration` reads back as ``seconds``: ``"1h30m"``,
    ``"30s"``, ``"500ms"``, ``"0s"``; not whole milliseconds: exact seconds (``"0.0001s"``)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"not a duration: {seconds!r}")
    if seconds == 0:
        return "0s"
    ms = round(seconds * 1000)
    if ms == 0 or ms / 1000 != seconds:
        # decimal here, not at the top: every process that reads a config imports this module,
        # the agent included, and only this rare case needs it (docs/performance.md)
        from decimal import Decimal

        return f"{Decimal(repr(seconds)):f}s"  # not whole milliseconds: exact, no exponent
    if 1 < seconds < 60 and ms % 1000:
        return f"{ms / 1000:g}s"  # 1.5s reads better than 1s500ms
    parts: list[str] = []
    for unit in _ORDER:
        size = round(_UNITS[unit] * 1000)
        n, ms = divmod(ms, size)
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts)
