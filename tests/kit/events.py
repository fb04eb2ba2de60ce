"""Reading the agent's serial lines back."""

from __future__ import annotations

from pathlib import Path

from gce_watchdog.wire.protocol import KEY_EVENT, Event, decode_all


def read_events(path: Path, forged_ok: bool = True) -> list[Event]:
    """The events in a serial file (none while it does not exist yet), without the key lines.
    ``forged_ok=False``: asserts that no line failed its signature."""
    if not path.exists():
        return []
    evs, stats = decode_all(path.read_bytes())
    assert forged_ok or stats.forged == 0, f"{stats.forged} forged lines in {path}"
    return [e for e in evs if e.event != KEY_EVENT]
