"""Reading the agent's serial lines back: from a serial file, or from an in-memory sink."""

from __future__ import annotations

from pathlib import Path

from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm.console import MemorySink
from gce_watchdog.wire.protocol import (
    KEY_EVENT,
    Event,
    KeyAnnounce,
    LineKey,
    decode_all,
    decode_line,
)


def read_events(path: Path, *, forged_ok: bool = True, rejected_ok: bool = True) -> list[Event]:
    """The events in a serial file (none while it does not exist yet), without the key lines.
    ``forged_ok=False``: asserts that no line failed its signature; ``rejected_ok=False``: that
    no line carrying our marker was rejected (damaged)."""
    if not path.exists():
        return []
    evs, stats = decode_all(path.read_bytes())
    assert forged_ok or stats.forged == 0, f"{stats.forged} forged lines in {path}"
    assert rejected_ok or stats.rejected == 0, f"{stats.rejected} rejected lines in {path}"
    return [e for e in evs if e.event != KEY_EVENT]


def sink_events(sink: MemorySink, key: LineKey = SYNTH_KEY) -> list[Event]:
    """The events an Emitter wrote into a MemorySink, key lines left out; every other line must
    decode and verify under ``key`` (asserted)."""
    out = []
    for line in list(sink.lines):
        ev = decode_line(line, pin=key.public)
        if isinstance(ev, KeyAnnounce):
            continue
        assert isinstance(ev, Event), line
        out.append(ev)
    return out
