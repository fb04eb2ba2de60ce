"""Serial-line protocol v1: the public contract between the agent (encode) and the poller (decode).

A line looks like::

    GCEWD1 3f2a9c1e 42 2026-11-30T04:18:14.123Z tick rung=3/10 md=fail eg=fail \
        | BOTH reachability probes FAILED (3/10) #1a2b3c4d

(one line on the wire; wrapped here).

- ``GCEWD1``: marker and protocol version; a substring scan finds it anywhere in a console line.
- boot: the first 8 hex digits of the kernel boot id (a new boot is a new incarnation of the VM).
- seq: per-boot sequence number, +1 per line across every writer on the VM.
- ts: UTC, millisecond precision.
- event: ``[a-z][a-z0-9_]*``.
- fields: ``key=value``; keys ``[a-z][a-z0-9_]*``, values from a safe token alphabet (no spaces).
- text: optional human-readable trailer after `` | `` (printable ASCII, no ``#``).
- ``#crc``: CRC32 (8 lowercase hex) of every byte from the marker up to the space before ``#``.

The whole line is ASCII and at most :data:`MAX_LINE` bytes. A line whose checksum does not match
(spliced with kernel output, truncated, bit-flipped) is rejected and counted, never misread.
``docs/serial-protocol.md`` is the specification; changing this module means changing that document
and the version.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

VERSION = 1
MARKER = "GCEWD1"
MARKER_BYTES = MARKER.encode()
# A 38400-baud console carries ~3.8 KB/s; 200 bytes keeps one line well under 0.1 s of port time.
MAX_LINE = 200
MAX_VALUE = 64  # bytes per field value; keeps one line from being eaten by a single field
MAX_TEXT = 100  # bytes of human text; truncated (never rejected) when longer

_KEY_RE = re.compile(r"[a-z][a-z0-9_]{0,23}\Z")
_VALUE_RE = re.compile(r"[A-Za-z0-9._:/@,+%~()<>\[\]-]{1,64}\Z")
_VALUE_BAD = re.compile(r"[^A-Za-z0-9._:/@,+%~()<>\[\]-]")
_TEXT_BAD = re.compile(r"[^\x20-\x22\x24-\x7e]")  # printable ASCII except '#'
_BOOT_RE = re.compile(r"[0-9a-f]{8}\Z")
_TS_RE = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)\.(\d{3})Z\Z")
# The checksum suffix: one space, '#', 8 lowercase hex. We look for every occurrence, not only at
# the end of the line, so a kernel message glued after an intact line does not lose it.
_CRC_RE = re.compile(rb" #([0-9a-f]{8})")


class ProtocolError(ValueError):
    """An event that cannot be encoded (bad key, value or size). Raised, never silently fixed."""


@dataclass(frozen=True)
class Event:
    """One decoded (or to-be-encoded) protocol line."""

    event: str
    boot: str
    seq: int
    ts_ms: int  # milliseconds since the Unix epoch, UTC
    fields: tuple[tuple[str, str], ...] = ()
    text: str = ""

    def get(self, key: str, default: str | None = None) -> str | None:
        for k, v in self.fields:
            if k == key:
                return v
        return default

    @property
    def fields_dict(self) -> dict[str, str]:
        return dict(self.fields)

    @property
    def time(self) -> datetime:
        return datetime.fromtimestamp(self.ts_ms / 1000, tz=UTC)

    def to_json(self) -> dict[str, object]:
        """The event as the poller's and the report's JSON output show it."""
        return {
            "ts": format_ts(self.ts_ms),
            "boot": self.boot,
            "seq": self.seq,
            "event": self.event,
            "fields": dict(self.fields),
            "text": self.text,
        }


def sanitize_value(value: object, limit: int = MAX_VALUE) -> str:
    """Map an arbitrary value (an exception text, a hostname) into the value alphabet."""
    s = _VALUE_BAD.sub("_", str(value))[:limit]
    return s or "-"


def sanitize_text(text: str) -> str:
    return _TEXT_BAD.sub("_", text)[:MAX_TEXT].strip()


def format_ts(ts_ms: int) -> str:
    dt = datetime.fromtimestamp(ts_ms // 1000, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{ts_ms % 1000:03d}Z"


def parse_ts(s: str) -> int | None:
    m = _TS_RE.match(s)
    if not m:
        return None
    try:
        y, mo, d, h, mi, sec, ms = (int(g) for g in m.groups())
        dt = datetime(y, mo, d, h, mi, sec, tzinfo=UTC)
    except ValueError:
        return None
    return int(dt.timestamp()) * 1000 + ms


def _crc(body: bytes) -> str:
    return f"{zlib.crc32(body) & 0xFFFFFFFF:08x}"


def encode(ev: Event) -> str:
    """Encode one event as a line (without the newline). Raises ProtocolError on bad input."""
    line = _encode_any_length(ev)
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line is {len(line)} bytes, limit {MAX_LINE}")
    return line


def _encode_any_length(ev: Event) -> str:
    if not _KEY_RE.match(ev.event):
        raise ProtocolError(f"bad event name {ev.event!r}")
    if not _BOOT_RE.match(ev.boot):
        raise ProtocolError(f"bad boot id {ev.boot!r}: want 8 lowercase hex digits")
    if ev.seq < 0 or ev.ts_ms < 0:
        raise ProtocolError("seq and ts_ms must be >= 0")
    parts = [MARKER, ev.boot, str(ev.seq), format_ts(ev.ts_ms), ev.event]
    seen: set[str] = set()
    for k, v in ev.fields:
        if not _KEY_RE.match(k) or k in seen:
            raise ProtocolError(f"bad or duplicate field key {k!r}")
        if not _VALUE_RE.match(v):
            raise ProtocolError(f"bad value for {k!r}: {v!r} (use sanitize_value)")
        seen.add(k)
        parts.append(f"{k}={v}")
    if ev.text:
        if _TEXT_BAD.search(ev.text) or ev.text != ev.text.strip() or len(ev.text) > MAX_TEXT:
            raise ProtocolError(f"bad text {ev.text!r} (use sanitize_text)")
        parts.append("|")
        parts.append(ev.text)
    body = " ".join(parts)
    return f"{body} #{_crc(body.encode())}"


def make_event(
    event: str,
    boot: str,
    seq: int,
    ts_ms: int,
    fields: Mapping[str, object] | Iterable[tuple[str, object]] = (),
    text: str = "",
) -> Event:
    """Build an event, sanitizing values and text.

    If the line would be too long, the text is dropped; if the fields alone are still too long,
    the longest values are cut short until it fits. Values often come from files or exception
    names the writer does not control, and a shortened value beats a lost line (or a writer
    killed by the raise). Bad names and keys still raise: those are bugs.
    """
    items = fields.items() if isinstance(fields, Mapping) else fields
    clean = [(k, sanitize_value(v)) for k, v in items]
    ev = Event(event, boot, seq, ts_ms, tuple(clean), sanitize_text(text))
    over = len(_encode_any_length(ev)) - MAX_LINE
    if over > 0 and ev.text:
        ev = Event(event, boot, seq, ts_ms, ev.fields, "")
        over = len(_encode_any_length(ev)) - MAX_LINE
    if over > 0:
        for _ in range(over):  # one byte off the longest value per pass (short ones stay whole)
            i = max(range(len(clean)), key=lambda j: len(clean[j][1]), default=-1)
            if i < 0 or len(clean[i][1]) <= 1:
                break
            clean[i] = (clean[i][0], clean[i][1][:-1])
        ev = Event(event, boot, seq, ts_ms, tuple(clean), "")
        encode(ev)  # still too long (far too many fields): a bug in the caller, raise
    return ev


class Reject:
    """Why a line carrying the marker was not accepted."""

    CHECKSUM = "checksum"  # no intact checksum suffix: spliced, truncated or corrupted
    SYNTAX = "syntax"  # checksum fine but the body does not parse (should never happen)


@dataclass(frozen=True)
class Rejected:
    reason: str
    raw: bytes


def _parse_body(body: str) -> Event | None:
    text = ""
    head = body
    idx = body.find(" | ")
    if idx >= 0:
        head, text = body[:idx], body[idx + 3 :]
    elif body.endswith(" |"):
        return None
    parts = head.split(" ")
    if len(parts) < 5 or parts[0] != MARKER:
        return None
    _, boot, seq_s, ts_s, name, *kvs = parts
    if not _BOOT_RE.match(boot) or not seq_s.isdigit() or not _KEY_RE.match(name):
        return None
    if len(seq_s) > 1 and seq_s[0] == "0":
        return None
    ts_ms = parse_ts(ts_s)
    if ts_ms is None:
        return None
    fields: list[tuple[str, str]] = []
    keys: set[str] = set()
    for kv in kvs:
        k, sep, v = kv.partition("=")
        if not sep or not _KEY_RE.match(k) or not _VALUE_RE.match(v) or k in keys:
            return None
        keys.add(k)
        fields.append((k, v))
    if text and (_TEXT_BAD.search(text) or text != text.strip()):
        return None
    return Event(name, boot, int(seq_s), ts_ms, tuple(fields), text)


def decode_line(line: bytes | str) -> Event | Rejected | None:
    """Decode one console line.

    Returns None when the line does not carry the marker (someone else's output), an Event when an
    intact protocol line is found in it, and Rejected when the marker is there but no intact line.
    Never raises.
    """
    raw = line.encode("latin-1", "replace") if isinstance(line, str) else line
    start = raw.find(MARKER_BYTES)
    if start < 0:
        return None
    # A line may hold more than one marker (a truncated line followed by a good one on the same
    # console line). Try each marker, each checksum candidate after it; first intact one wins.
    while start >= 0:
        for m in _CRC_RE.finditer(raw, start):
            body = raw[start : m.start()]
            if len(body) + 10 > MAX_LINE:
                break
            if _crc(body) != m.group(1).decode():
                continue
            try:
                text = body.decode("ascii")
            except UnicodeDecodeError:
                continue
            ev = _parse_body(text)
            if ev is not None:
                return ev
            return Rejected(Reject.SYNTAX, raw)
        start = raw.find(MARKER_BYTES, start + 1)
    return Rejected(Reject.CHECKSUM, raw)


@dataclass
class DecodeStats:
    lines: int = 0
    events: int = 0
    rejected: int = 0
    duplicates: int = 0
    reject_reasons: dict[str, int] = field(default_factory=dict)


class StreamDecoder:
    """Incremental decoder: feed arbitrary byte chunks, get events in order.

    A line split across two chunks is joined before decoding; a partial last line is held until
    its newline arrives (or :meth:`flush`). Lines seen twice (the same boot and seq, e.g. our line
    and its copy forwarded by journald) are reported once.
    """

    # A console line longer than this is not ours (ours are <= 200 bytes): keep only its tail so a
    # reader fed a newline-free stream cannot grow without bound.
    MAX_PENDING = 64 * 1024
    # Copies of a line (journald forwarding) arrive within seconds of it: a window of 4096 lines
    # (hours of agent output) is ample.
    DEDUP_WINDOW = 4096

    def __init__(self) -> None:
        self.stats = DecodeStats()
        self._pending = b""
        # Per boot: the highest seq seen and the seqs seen within DEDUP_WINDOW below it. Bounded
        # memory for a reader that runs for weeks; a line older than the window is a late copy.
        self._seen: dict[str, tuple[int, set[int]]] = {}
        self.rejects: list[Rejected] = []

    def feed(self, chunk: bytes) -> list[Event]:
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > self.MAX_PENDING:
            self._pending = self._pending[-self.MAX_PENDING :]
        return list(self._decode_lines(lines))

    def flush(self) -> list[Event]:
        """Decode the held partial line (end of a dump): a truncated last line is rejected."""
        rest, self._pending = self._pending, b""
        return list(self._decode_lines([rest] if rest else []))

    def _decode_lines(self, lines: list[bytes]) -> Iterator[Event]:
        st = self.stats
        for ln in lines:
            st.lines += 1
            if MARKER_BYTES not in ln:
                continue
            res = decode_line(ln)
            if isinstance(res, Event):
                if self._is_duplicate(res.boot, res.seq):
                    st.duplicates += 1
                    continue
                st.events += 1
                yield res
            elif isinstance(res, Rejected):
                st.rejected += 1
                st.reject_reasons[res.reason] = st.reject_reasons.get(res.reason, 0) + 1
                if len(self.rejects) < 1000:  # bounded sample for reports
                    self.rejects.append(res)

    def _is_duplicate(self, boot: str, seq: int) -> bool:
        top, seen = self._seen.get(boot, (-1, set()))
        if seq in seen or seq < top - self.DEDUP_WINDOW:
            return True
        seen.add(seq)
        if seq > top:
            top = seq
            if len(seen) > 2 * self.DEDUP_WINDOW:
                seen = {s for s in seen if s >= top - self.DEDUP_WINDOW}
        self._seen[boot] = (top, seen)
        return False


def decode_all(data: bytes) -> tuple[list[Event], DecodeStats]:
    """Decode a whole dump at once."""
    d = StreamDecoder()
    events = d.feed(data)
    events += d.flush()
    return events, d.stats
