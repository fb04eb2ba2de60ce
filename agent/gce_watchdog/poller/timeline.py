"""A timeline of one VM's serial output: our events, per-boot accounting, what was lost.

The timeline is fed bytes (a whole dump, or the pieces an incremental reader fetches) and keeps:

- the decoded events in stream order (bounded: old routine lines are compacted away, the events
  a verdict depends on are kept, see :meth:`Timeline.compact`);
- per boot: first/last sequence number, lines seen, first/last timestamp; the number of lines
  lost between the agent and the reader is the holes in the seen sequence range;
- sequence gaps (a jump in ``seq`` within a boot) and byte gaps (output the API no longer held);
- rejected lines (the marker without an intact checksum) with a bounded sample.

Decoding is :class:`wire.protocol.StreamDecoder`; this module only does the bookkeeping. The
whole state round-trips through JSON (:meth:`to_json` / :meth:`from_json`) so a restarted poller
resumes with the same accounting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from gce_watchdog.poller.verdict import terminal_kind
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import Event, StreamDecoder, decode_line, encode

# Events a verdict can depend on; they survive compaction (see verdict.py's table).
KEY_EVENTS = vocab.VERDICT_EVENTS
MAX_EVENTS = 4096  # in-memory events before compaction (~10 days of 5-minute heartbeats)
KEEP_KEY_EVENTS = 512  # key events kept per compaction (a boot has a handful)
KEEP_RECENT = 64  # routine events (tick/heartbeat) kept: the latest show rung and liveness
MAX_GAPS = 1000  # gap records kept for the report; totals are always exact
MAX_REJECT_SAMPLES = 20  # rejected raw lines kept for the report


@dataclass
class BootInfo:
    """What was seen of one boot (one incarnation of the VM)."""

    boot: str
    first_seq: int
    max_seq: int
    count: int  # distinct lines seen
    first_ts_ms: int
    last_ts_ms: int
    order: int  # position of the boot's first line among boots (0 = first seen)

    @property
    def lost(self) -> int:
        """Lines missing inside the seen range [first_seq, max_seq]."""
        return max(0, self.max_seq - self.first_seq + 1 - self.count)


@dataclass(frozen=True)
class SeqGap:
    boot: str
    after: int  # the highest seq seen before the jump
    next: int  # the seq that arrived

    @property
    def missing(self) -> int:
        return self.next - self.after - 1


@dataclass(frozen=True)
class ByteGap:
    requested: int  # the offset the reader asked for
    start: int  # the oldest offset the API still held

    @property
    def lost(self) -> int:
        return self.start - self.requested


class Timeline:
    """Accumulates decoded events and loss accounting for one VM's serial port."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.boots: dict[str, BootInfo] = {}
        self.seq_gaps: list[SeqGap] = []
        self.byte_gaps: list[ByteGap] = []
        self.lost_bytes = 0
        self.resets = 0  # times the API's buffer restarted below our offset
        self._decoder = StreamDecoder()
        self._rejected_base = 0
        self._duplicates_base = 0
        self._reject_reasons_base: dict[str, int] = {}
        self.reject_samples: list[str] = []

    # -- feeding ----------------------------------------------------------------------------

    def feed(self, data: bytes) -> list[Event]:
        """Feed a chunk of the stream (any boundary); returns the new events in stream order."""
        return self._add(self._decoder.feed(data))

    def finish(self) -> list[Event]:
        """End of a dump: decode the unterminated last line (a truncated line is rejected)."""
        return self._add(self._decoder.flush())

    def note_byte_gap(self, requested: int, start: int) -> None:
        """The API returned ``start`` beyond ``requested``: those bytes are gone."""
        self.lost_bytes += start - requested
        if len(self.byte_gaps) < MAX_GAPS:
            self.byte_gaps.append(ByteGap(requested, start))

    def _add(self, new: list[Event]) -> list[Event]:
        for ev in new:
            self._account(ev)
        self.events.extend(new)
        for r in self._decoder.rejects:
            if len(self.reject_samples) < MAX_REJECT_SAMPLES:
                self.reject_samples.append(r.raw[:240].decode("latin-1"))
        self._decoder.rejects.clear()
        if len(self.events) > MAX_EVENTS:
            self.compact()
        return new

    def _account(self, ev: Event) -> None:
        b = self.boots.get(ev.boot)
        if b is None:
            self.boots[ev.boot] = BootInfo(
                ev.boot, ev.seq, ev.seq, 1, ev.ts_ms, ev.ts_ms, len(self.boots)
            )
            return
        if ev.seq > b.max_seq + 1 and len(self.seq_gaps) < MAX_GAPS:
            self.seq_gaps.append(SeqGap(ev.boot, b.max_seq, ev.seq))
        b.first_seq = min(b.first_seq, ev.seq)
        b.max_seq = max(b.max_seq, ev.seq)
        b.count += 1
        b.first_ts_ms = min(b.first_ts_ms, ev.ts_ms)
        b.last_ts_ms = max(b.last_ts_ms, ev.ts_ms)

    # -- views ------------------------------------------------------------------------------

    @property
    def lines(self) -> int:
        """Console lines decoded by this process (not persisted across restarts)."""
        return self._decoder.stats.lines

    @property
    def rejected(self) -> int:
        return self._rejected_base + self._decoder.stats.rejected

    @property
    def duplicates(self) -> int:
        return self._duplicates_base + self._decoder.stats.duplicates

    @property
    def reject_reasons(self) -> dict[str, int]:
        out = dict(self._reject_reasons_base)
        for k, v in self._decoder.stats.reject_reasons.items():
            out[k] = out.get(k, 0) + v
        return out

    @property
    def latest_boot(self) -> str | None:
        """The boot of the most recent line in stream order (the current incarnation)."""
        return self.events[-1].boot if self.events else None

    @property
    def lost_lines(self) -> int:
        return sum(b.lost for b in self.boots.values())

    def compact(self) -> None:
        """Bound memory: keep key events (verdict inputs) and the most recent routine lines.

        Each boot's first terminal event (by seq) is always kept: the verdict is decided by it,
        and a long tail of later key events (a finished job's VM flapping for days) must not
        push it out, or a later ladder ``shutdown`` would become "first" and fail over a job
        that had finished.
        """
        keys = [e for e in self.events if e.event in KEY_EVENTS][-KEEP_KEY_EVENTS:]
        recent = self.events[-KEEP_RECENT:]
        first_terminal: dict[str, Event] = {}
        for e in self.events:
            if terminal_kind(e) is not None:
                cur = first_terminal.get(e.boot)
                if cur is None or e.seq < cur.seq:
                    first_terminal[e.boot] = e
        keep = {id(e) for e in keys} | {id(e) for e in recent}
        keep |= {id(e) for e in first_terminal.values()}
        self.events = [e for e in self.events if id(e) in keep]

    # -- persistence ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        self.compact()
        return {
            "events": [encode(e) for e in self.events],
            "boots": [asdict(b) for b in self.boots.values()],
            "seq_gaps": [asdict(g) for g in self.seq_gaps],
            "byte_gaps": [asdict(g) for g in self.byte_gaps],
            "lost_bytes": self.lost_bytes,
            "resets": self.resets,
            "rejected": self.rejected,
            "duplicates": self.duplicates,
            "reject_reasons": self.reject_reasons,
            "reject_samples": self.reject_samples,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Timeline:
        """Rebuild from :meth:`to_json`; raises ValueError/KeyError/TypeError on a bad document."""
        t = cls()
        for line in obj["events"]:
            ev = decode_line(str(line))
            if not isinstance(ev, Event):
                raise ValueError(f"stored event does not decode: {line!r}")
            t.events.append(ev)
        for b in obj["boots"]:
            t.boots[str(b["boot"])] = BootInfo(**b)
        t.seq_gaps = [SeqGap(**g) for g in obj["seq_gaps"]]
        t.byte_gaps = [ByteGap(**g) for g in obj["byte_gaps"]]
        t.lost_bytes = int(obj["lost_bytes"])
        t.resets = int(obj["resets"])
        t._rejected_base = int(obj["rejected"])
        t._duplicates_base = int(obj["duplicates"])
        t._reject_reasons_base = {str(k): int(v) for k, v in obj["reject_reasons"].items()}
        t.reject_samples = [str(s) for s in obj["reject_samples"]][:MAX_REJECT_SAMPLES]
        return t


def parse_bytes(data: bytes | Iterable[bytes]) -> Timeline:
    """Decode a whole saved dump (bytes, or an iterable of chunks) into a finished timeline."""
    t = Timeline()
    if isinstance(data, bytes | bytearray):
        t.feed(bytes(data))
    else:
        for chunk in data:
            t.feed(chunk)
    t.finish()
    return t
