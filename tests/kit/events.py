"""Reading the agent's serial lines back."""

from __future__ import annotations

from pathlib import Path

from gce_watchdog.wire.protocol import Event, decode_all


def read_events(path: Path) -> list[Event]:
    """The events in a serial file (none while it does not exist yet), without the key lines."""
    evs = decode_all(path.read_bytes())[0] if path.exists() else []
    return [e for e in evs if e.event != "key"]
