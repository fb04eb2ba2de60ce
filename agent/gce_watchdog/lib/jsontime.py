"""Times in every ``--json`` output: RFC 3339, UTC, with ``Z`` (docs/json.md).

One shape, ``2026-12-04T14:05:00Z``, with a fraction only where the value has one: milliseconds
for what the agent signed on the wire (``2026-12-04T14:05:00.123Z``, as ``wire.protocol``
writes it), microseconds for a poller's clock (a decision's ``decided_at``), none for the time
a poll line was printed. Never epoch numbers.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

# The pattern every JSON Schema under gce_watchdog/schemas/ gives its times.
PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z$"


def from_epoch(t: float, fraction: bool = True) -> str:
    """Seconds since the epoch (``time.time()``) as RFC 3339 UTC; microseconds if ``fraction``."""
    dt = datetime.fromtimestamp(t, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if fraction else "%Y-%m-%dT%H:%M:%SZ")


def from_ms(ms: int) -> str:
    """Milliseconds since the epoch (a line's signed time) as RFC 3339 UTC with milliseconds."""
    dt = datetime.fromtimestamp(ms // 1000, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"


# Time fields of the dataclasses the reports print (BootInfo, the report's series and windows):
# the field, its name in JSON, and whether it holds milliseconds (else seconds, or None).
_TIME_FIELDS: dict[str, tuple[str, bool]] = {
    "ts_ms": ("ts", True),
    "first_ts_ms": ("first_ts", True),
    "last_ts_ms": ("last_ts", True),
    "start_ms": ("start_ts", True),
    "end_ms": ("end_ts", True),
    "planned_end_ms": ("planned_end_ts", True),
    "first_rx": ("first_received", False),
    "last_rx": ("last_received", False),
}


def times(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a dataclass's ``asdict``) with its epoch time fields as RFC 3339 strings under
    their JSON names (``first_ts_ms`` -> ``first_ts``); None stays None."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        name, ms = _TIME_FIELDS.get(k, (k, False))
        if k not in _TIME_FIELDS or v is None:
            out[name] = v
        else:
            out[name] = from_ms(int(v)) if ms else from_epoch(float(v))
    return out
