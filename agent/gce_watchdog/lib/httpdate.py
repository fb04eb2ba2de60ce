"""HTTP dates: the ``Retry-After`` header (RFC 9110 section 10.2.3)."""

from __future__ import annotations


def parse_retry_after(value: str | None, now_wall: float) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    v = value.strip()
    if v.isdigit():
        return float(v)
    # email.utils (~2 ms, a dozen modules) only for the rare HTTP-date form: every command's
    # parser loads fetch, and through it this module.
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(v)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now_wall)
