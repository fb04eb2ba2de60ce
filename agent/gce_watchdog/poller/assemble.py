"""Putting a boot's lines back in order when they arrive out of order, twice, or not at all.

The pure core of the Pub/Sub path (no clock, no I/O: ``now`` is passed in). Log entries reach a
worker in any order and possibly more than once. Per (instance, boot) the assembler keeps the
**gap-free prefix**: the lines with seq 0, 1, 2, ... up to the first one not seen yet. A line past
a gap is held; the verdict is only ever taken over the prefix, so a ``shutdown`` that arrives
before the ``exit rc=0`` written just ahead of it cannot fail a finished job over.

A gap is waited for ``settle_s`` from the moment the first held line arrived. If it has not filled
by then, the missing seqs are declared lost (counted) and the prefix moves on to the held lines.
Seqs start at 0 for every boot (``SeqAllocator``), so a first line with seq 5 waits for 0-4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gce_watchdog.wire.protocol import Event

# A healthy boot writes a heartbeat every 5 min for as long as it runs. Past MAX_PREFIX lines the
# prefix keeps what a verdict can depend on (lifecycle and terminal events, as the cursor's
# compaction does) plus the KEEP_RECENT latest lines.
MAX_PREFIX = 1024
KEEP_RECENT = 64
_KEEP = frozenset(
    {"start", "stop", "phase", "setup_failed", "exit", "shutdown", "preempted", "recovered"}
)


@dataclass
class BootStream:
    """One boot's lines: the prefix (in seq order) and what is held beyond a gap."""

    boot: str
    first_seen: int  # arrival order of the boot's first line (the latest boot is the current one)
    next_seq: int = 0
    prefix: list[Event] = field(default_factory=list)
    held: dict[int, Event] = field(default_factory=dict)
    gap_since: float | None = None  # when the oldest held line arrived
    lost: int = 0
    duplicates: int = 0

    def _advance(self) -> int:
        n = 0
        while self.next_seq in self.held:
            self.prefix.append(self.held.pop(self.next_seq))
            self.next_seq += 1
            n += 1
        if len(self.prefix) > MAX_PREFIX:
            old, recent = self.prefix[:-KEEP_RECENT], self.prefix[-KEEP_RECENT:]
            self.prefix = [e for e in old if e.event in _KEEP][-MAX_PREFIX // 2 :] + recent
        return n


@dataclass
class Assembler:
    """Per (instance key, boot) streams. ``add`` and ``settle`` return whether a prefix grew."""

    settle_s: float
    streams: dict[tuple[str, str], BootStream] = field(default_factory=dict)
    _arrivals: int = 0

    def add(self, key: str, ev: Event, now: float) -> bool:
        """Take one line; True if the prefix of its boot grew (a verdict may have changed)."""
        s = self.streams.get((key, ev.boot))
        if s is None:
            self._arrivals += 1
            s = self.streams[(key, ev.boot)] = BootStream(ev.boot, self._arrivals)
        if ev.seq < s.next_seq or ev.seq in s.held:
            s.duplicates += 1  # a redelivery, or a copy (journald): already counted
            return False
        s.held[ev.seq] = ev
        grew = s._advance() > 0
        s.gap_since = (s.gap_since if s.gap_since is not None else now) if s.held else None
        return grew

    def settle(self, now: float) -> list[tuple[str, str]]:
        """Give up on gaps older than ``settle_s``: their seqs are lost, the prefix moves on.
        Returns the (key, boot) whose prefix grew."""
        grown = []
        for k, s in self.streams.items():
            while s.held and s.gap_since is not None and now - s.gap_since >= self.settle_s:
                first = min(s.held)
                s.lost += first - s.next_seq
                s.next_seq = first
                s._advance()
                s.gap_since = now if s.held else None  # what is still held waits afresh
                grown.append(k)
        return grown

    def next_deadline(self) -> float | None:
        """When the next held gap times out (a worker wakes up then), or None."""
        due = [
            s.gap_since + self.settle_s for s in self.streams.values() if s.gap_since is not None
        ]
        return min(due, default=None)

    def events(self, key: str, boot: str) -> list[Event]:
        s = self.streams.get((key, boot))
        return list(s.prefix) if s else []

    def forget(self, key: str, boot: str) -> None:
        """Drop a decided boot's lines (its decision is in the ledger)."""
        self.streams.pop((key, boot), None)
