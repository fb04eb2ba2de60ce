"""Serial-line protocol v2: the public contract between the agent (encode) and the poller (decode).

A line looks like::

    GCEWD2 3f2a9c1e 42 2026-11-30T04:18:14.123Z tick rung=3/10 md=fail eg=fail \
        | BOTH reachability probes FAILED (3/10) #1a2b3c4d0f1e2d3c4b5a6978

(one line on the wire; wrapped here).

- ``GCEWD2``: marker and protocol version; a substring scan finds it anywhere in a console line.
- boot: the first 8 hex digits of the kernel boot id (a new boot is a new incarnation of the VM).
- seq: per-boot sequence number, +1 per line across every writer on the VM.
- ts: UTC, millisecond precision (the guest's clock: shown, never used to measure silence).
- event: ``[a-z][a-z0-9_]*``.
- fields: ``key=value``; keys ``[a-z][a-z0-9_]*``, values from a safe token alphabet (no spaces).
- text: optional human-readable trailer after `` | `` (printable ASCII, no ``#``).
- ``#<crc><mac>``: CRC-32 (8 hex) of every byte from the marker up to the space before ``#``
  (damage: anyone can compute it), then HMAC-SHA256 of the same bytes under the instance's
  secret key, truncated to 8 bytes (16 hex): authenticity, which only root on the VM can produce.

The key is announced once per boot, as that boot's seq 0, by a ``key`` line whose own MAC is
made with the key it announces. Readers pin the first key they see for an instance; a line whose
MAC does not verify under the pinned key is **forged**: counted, shown, never decides.

The whole line is ASCII and at most :data:`MAX_LINE` bytes. A line whose CRC does not match
(spliced with kernel output, truncated, bit-flipped) is rejected and counted, never misread.
``docs/serial-protocol.md`` is the specification; changing this module means changing that document
and the version.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

VERSION = 2
MARKER = "GCEWD2"
MARKER_BYTES = MARKER.encode()
LEGACY_MARKER = "GCEWD1"  # protocol v1: CRC only, unauthenticated; read as forged, never decides
# Every marker prefix of any version: what `neutralize` defuses in output we pass through.
MARKER_PREFIX = b"GCEWD"
# A 38400-baud console carries ~3.8 KB/s; 200 bytes keeps one line well under 0.1 s of port time.
MAX_LINE = 200
MAX_VALUE = 64  # bytes per field value; keeps one line from being eaten by a single field
MAX_TEXT = 100  # bytes of human text; truncated (never rejected) when longer
MIN_TEXT = 12  # a text shortened below this says nothing: dropped instead
MAC_BYTES = 8  # truncated HMAC-SHA256: 64 bits, one forgery in 2**64 tries
KEY_BYTES = 32  # the per-instance secret (256 bits, 64 hex: exactly one field value)
TRAILER_LEN = len(" #") + 8 + 2 * MAC_BYTES  # " #" + crc + mac
KEY_EVENT = "key"  # the announcement; the event readers see carries only the fingerprint
# Markers tried per console line. Ours carry one (two when a journald copy is glued on); more is
# someone else's output, and stopping here keeps a hostile line of markers linear to decode.
MAX_MARKERS_PER_LINE = 8

_KEY_RE = re.compile(r"[a-z][a-z0-9_]{0,23}\Z")
_VALUE_RE = re.compile(r"[A-Za-z0-9._:/@,+%~()<>\[\]-]{1,64}\Z")
_VALUE_BAD = re.compile(r"[^A-Za-z0-9._:/@,+%~()<>\[\]-]")
_TEXT_BAD = re.compile(r"[^\x20-\x22\x24-\x7e]")  # printable ASCII except '#'
_BOOT_RE = re.compile(r"[0-9a-f]{8}\Z")
_HEXKEY_RE = re.compile(r"[0-9a-f]{64}\Z")
_TS_RE = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)\.(\d{3})Z\Z")
_MARKER_RE = re.compile(rb"GCEWD([12])")
# Trailer candidates: v2 " #" + 24 hex (crc + mac), v1 " #" + 8 hex. We look for every occurrence
# within MAX_LINE bytes of a marker, not only at the end of the console line, so a kernel message
# glued after an intact line does not lose it.
_TRAILER_V2 = re.compile(rb" #([0-9a-f]{8})([0-9a-f]{16})")
_TRAILER_V1 = re.compile(rb" #([0-9a-f]{8})")


class ProtocolError(ValueError):
    """An event that cannot be encoded (bad key, value or size). Raised, never silently fixed."""


@dataclass(frozen=True)
class Event:
    """One decoded (or to-be-encoded) protocol line."""

    event: str
    boot: str
    seq: int
    ts_ms: int  # milliseconds since the Unix epoch, UTC (the guest's clock)
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

    @classmethod
    def from_json(cls, obj: Mapping[str, object]) -> Event:
        """Inverse of :meth:`to_json`; raises ValueError/KeyError/TypeError on a bad document."""
        ts = parse_ts(str(obj["ts"]))
        fields = obj["fields"]
        if ts is None or not isinstance(fields, dict):
            raise ValueError(f"not an event: {obj!r}")
        seq = obj["seq"]
        if not isinstance(seq, int):
            raise TypeError("seq")
        return cls(
            str(obj["event"]),
            str(obj["boot"]),
            seq,
            ts,
            tuple((str(k), str(v)) for k, v in fields.items()),
            str(obj.get("text", "")),
        )

    def render(self) -> str:
        """A human form for evidence and reports: no marker, no MAC (never a valid line)."""
        kv = "".join(f" {k}={v}" for k, v in self.fields)
        text = f" | {self.text}" if self.text else ""
        return f"{self.boot} #{self.seq} {format_ts(self.ts_ms)} {self.event}{kv}{text}"


def sanitize_value(value: object, limit: int = MAX_VALUE) -> str:
    """Map an arbitrary value (an exception text, a hostname) into the value alphabet."""
    s = _VALUE_BAD.sub("_", str(value))[:limit]
    return s or "-"


def sanitize_text(text: str) -> str:
    return _TEXT_BAD.sub("_", text)[:MAX_TEXT].strip()


def neutralize(data: bytes) -> bytes:
    """Defuse every protocol marker in output we pass through (a workload's stdout): ``GCEWD``
    becomes ``GCEWd``, which no reader takes for a line of ours. Lengths are unchanged."""
    return data.replace(MARKER_PREFIX, b"GCEWd")


class Neutralizer:
    """:func:`neutralize` for a stream cut into arbitrary chunks: a marker split between two
    chunks is held back (at most len(MARKER_PREFIX) - 1 bytes) until the next one decides it."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        data = neutralize(self._tail + chunk)
        keep = 0
        for n in range(min(len(MARKER_PREFIX) - 1, len(data)), 0, -1):
            if data.endswith(MARKER_PREFIX[:n]):
                keep = n
                break
        self._tail = data[len(data) - keep :] if keep else b""
        return data[: len(data) - keep]

    def flush(self) -> bytes:
        rest, self._tail = self._tail, b""
        return rest


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


def mac(key: bytes, body: bytes) -> str:
    """The truncated HMAC-SHA256 of a line body, 16 lowercase hex."""
    return hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES].hex()


def fingerprint(key: bytes) -> str:
    """A key's public name (8 hex of its SHA-256): safe to show, useless to a forger."""
    return hashlib.sha256(key).hexdigest()[:8]


def encode(ev: Event, key: bytes) -> str:
    """Encode and sign one event (without the newline). Raises ProtocolError on bad input."""
    line = _encode_any_length(ev, key)
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line is {len(line)} bytes, limit {MAX_LINE}")
    return line


def _body(ev: Event) -> str:
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
    return " ".join(parts)


def _encode_any_length(ev: Event, key: bytes) -> str:
    if len(key) != KEY_BYTES:
        raise ProtocolError(f"key must be {KEY_BYTES} bytes")
    raw = _body(ev).encode()
    return f"{raw.decode()} #{_crc(raw)}{mac(key, raw)}"


def key_line(boot: str, seq: int, ts_ms: int, key: bytes) -> str:
    """The key announcement (a boot's seq 0): signed with the key it announces."""
    return encode(Event(KEY_EVENT, boot, seq, ts_ms, (("k", key.hex()),)), key)


def make_event(
    event: str,
    boot: str,
    seq: int,
    ts_ms: int,
    fields: Mapping[str, object] | Iterable[tuple[str, object]] = (),
    text: str = "",
) -> Event:
    """Build an event, sanitizing values and text.

    If the line would be too long, the text is shortened (ending in ``...``), or dropped when
    fewer than MIN_TEXT bytes of it would fit; if the fields alone are still too long,
    the longest values are cut short until it fits. Values often come from files or exception
    names the writer does not control, and a shortened value beats a lost line (or a writer
    killed by the raise). Bad names and keys still raise: those are bugs.
    """
    items = fields.items() if isinstance(fields, Mapping) else fields
    clean = [(k, sanitize_value(v)) for k, v in items]
    ev = Event(event, boot, seq, ts_ms, tuple(clean), sanitize_text(text))
    over = line_length(ev) - MAX_LINE
    if over > 0 and ev.text:
        bare = Event(event, boot, seq, ts_ms, ev.fields, "")
        room = MAX_LINE - line_length(bare) - len(" | ")
        # A shortened text ("...") when a useful part fits (the signed trailer takes 26 bytes,
        # so near-full lines would otherwise lose their text altogether); else none.
        cut = ev.text[: room - 3].rstrip() + "..." if room >= MIN_TEXT else ""
        ev = Event(event, boot, seq, ts_ms, ev.fields, cut)
        over = line_length(ev) - MAX_LINE
    if over > 0:
        for _ in range(over):  # one byte off the longest value per pass (short ones stay whole)
            i = max(range(len(clean)), key=lambda j: len(clean[j][1]), default=-1)
            if i < 0 or len(clean[i][1]) <= 1:
                break
            clean[i] = (clean[i][0], clean[i][1][:-1])
        ev = Event(event, boot, seq, ts_ms, tuple(clean), "")
        if line_length(ev) > MAX_LINE:  # far too many fields: a bug in the caller, raise
            raise ProtocolError(f"line is {line_length(ev)} bytes, limit {MAX_LINE}")
    return ev


def line_length(ev: Event) -> int:
    """Bytes the encoded line takes (without the newline), whatever the key."""
    return len(_body(ev)) + TRAILER_LEN


class Reject:
    """Why a line carrying the marker was not accepted."""

    CHECKSUM = "checksum"  # no intact checksum suffix: spliced, truncated or corrupted
    SYNTAX = "syntax"  # checksum fine but the body does not parse (should never happen)
    MARKERS = "markers"  # more markers on one console line than any writer of ours produces


class Forgery:
    """Why an intact line (its CRC matches) was not authenticated."""

    BAD_MAC = "bad_mac"  # the MAC does not verify under the pinned key
    NO_KEY = "no_key"  # no key pinned yet for this instance: nothing can verify it
    LEGACY = "v1"  # a protocol v1 line: a CRC only, which any process can compute
    KEY_CONFLICT = "key_conflict"  # a key announcement of another key than the pinned one


@dataclass(frozen=True)
class Rejected:
    reason: str
    raw: bytes


@dataclass(frozen=True)
class Forged:
    """An intact line that does not authenticate: shown and counted, never decides."""

    reason: str
    raw: bytes
    event: Event | None = None  # what it claimed (None for a v1 line that does not parse)


@dataclass(frozen=True)
class KeyAnnounce:
    """A self-consistent key announcement: the reader decides whether it matches its pin."""

    event: Event  # as readers show it: ``key kid=<fingerprint>``, never the key itself
    key: bytes


def _parse_body(body: str) -> Event | None:
    text = ""
    head = body
    idx = body.find(" | ")
    if idx >= 0:
        head, text = body[:idx], body[idx + 3 :]
    elif body.endswith(" |"):
        return None
    parts = head.split(" ")
    if len(parts) < 5 or parts[0] not in (MARKER, LEGACY_MARKER):
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


def decode_line(
    line: bytes | str, key: bytes | None = None
) -> Event | KeyAnnounce | Forged | Rejected | None:
    """Decode one console line against ``key`` (the instance's pinned key, None: not known).

    Returns None when the line does not carry a marker (someone else's output); an Event for an
    intact line whose MAC verifies under ``key``; a KeyAnnounce for an intact, self-consistent
    key announcement (whatever ``key`` is: pinning is the caller's); Forged for an intact line
    that does not authenticate; Rejected when a marker is there but no intact line. Never raises.

    Linear in the line's length: at most MAX_MARKERS_PER_LINE markers are tried, each against
    the trailer candidates in the MAX_LINE bytes after it.
    """
    raw = line.encode("latin-1", "replace") if isinstance(line, str) else line
    forged: Forged | None = None
    syntax = False
    tried = 0
    for m in _MARKER_RE.finditer(raw):
        tried += 1
        if tried > MAX_MARKERS_PER_LINE:
            return forged or Rejected(Reject.MARKERS, raw)
        start = m.start()
        end = min(len(raw), start + MAX_LINE)
        v2 = m.group(1) == b"2"
        for t in (_TRAILER_V2 if v2 else _TRAILER_V1).finditer(raw, start, end):
            body = raw[start : t.start()]
            if _crc(body) != t.group(1).decode():
                continue
            try:
                ev = _parse_body(body.decode("ascii"))
            except UnicodeDecodeError:
                ev = None
            if ev is None:
                syntax = True
                continue
            if not v2:
                forged = forged or Forged(Forgery.LEGACY, raw, ev)
                break
            got = t.group(2).decode()
            if ev.event == KEY_EVENT:
                announced = ev.get("k") or ""
                if _HEXKEY_RE.match(announced) and len(ev.fields) == 1:
                    k = bytes.fromhex(announced)
                    if hmac.compare_digest(mac(k, body), got):
                        shown = Event(
                            KEY_EVENT, ev.boot, ev.seq, ev.ts_ms, (("kid", fingerprint(k)),)
                        )
                        return KeyAnnounce(shown, k)
            if key is None:
                forged = forged or Forged(Forgery.NO_KEY, raw, ev)
                break
            if hmac.compare_digest(mac(key, body), got):
                return ev
            forged = forged or Forged(Forgery.BAD_MAC, raw, ev)
            break
    if forged is not None:
        return forged
    if tried == 0:
        return None
    return Rejected(Reject.SYNTAX if syntax else Reject.CHECKSUM, raw)


def _reject_fast(raw: bytes) -> Rejected | None:
    """decode_line's answer for a line with no `` #`` in it: no marker of any version, or one
    that cannot be intact."""
    return Rejected(Reject.CHECKSUM, raw) if _MARKER_RE.search(raw) else None


@dataclass
class DecodeStats:
    lines: int = 0
    events: int = 0
    rejected: int = 0
    duplicates: int = 0
    forged: int = 0  # intact lines that did not authenticate (never events)
    conflicts: int = 0  # authenticated lines whose (boot, seq) was seen with other content
    reject_reasons: dict[str, int] = field(default_factory=dict)
    forged_reasons: dict[str, int] = field(default_factory=dict)


def split_lines(data: bytes) -> list[bytes]:
    """Split console bytes at LF, CRLF and a bare CR (a line ending some programs use alone)."""
    if b"\r" not in data:
        return data.split(b"\n")
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")


class StreamDecoder:
    """Incremental decoder: feed arbitrary byte chunks, get authenticated events in order.

    ``key``: the instance's pinned key, or None to pin the first key announcement seen. A line
    split across two chunks is joined before decoding; a partial last line is held until its
    line ending arrives (or :meth:`flush`). The same line seen twice (boot, seq and content: our
    line and its journald copy) is reported once; another line with a (boot, seq) already seen
    is a **conflict**, kept and counted.
    """

    # A console line longer than this is not ours (ours are <= 200 bytes): keep only its tail so a
    # reader fed a newline-free stream cannot grow without bound.
    MAX_PENDING = 64 * 1024
    # Copies of a line (journald forwarding) arrive within seconds of it: the last 4096 distinct
    # lines (hours of agent output) are remembered, by arrival, whatever their seq.
    DEDUP_WINDOW = 4096
    MAX_SAMPLES = 1000  # rejected/forged raw lines kept for reports

    def __init__(self, key: bytes | None = None) -> None:
        self.stats = DecodeStats()
        self.key = key
        self.key_conflict = False  # a second, different key was announced for this instance
        self._pending = b""
        # (boot, seq) -> hashes of the contents seen with it, in arrival order, bounded.
        self._seen: OrderedDict[tuple[str, int], set[int]] = OrderedDict()
        self.rejects: list[Rejected] = []
        self.forgeries: list[Forged] = []

    def feed(self, chunk: bytes) -> list[Event]:
        data = self._pending + chunk
        lines = split_lines(data)
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
            if not ln:
                continue
            st.lines += 1
            if MARKER_PREFIX not in ln:
                continue
            # No trailer anywhere: nothing to verify, rejected without the full decode (a
            # stream of short hostile lines costs a substring test each, not a regex scan).
            res = decode_line(ln, self.key) if b" #" in ln else _reject_fast(ln)
            if isinstance(res, KeyAnnounce):
                if self.key is None:
                    self.key = res.key
                elif not hmac.compare_digest(self.key, res.key):
                    self.key_conflict = True
                    self._forged(Forged(Forgery.KEY_CONFLICT, ln, res.event))
                    continue
                ev = res.event
            elif isinstance(res, Event):
                ev = res
            elif isinstance(res, Forged):
                self._forged(res)
                continue
            elif isinstance(res, Rejected):
                st.rejected += 1
                st.reject_reasons[res.reason] = st.reject_reasons.get(res.reason, 0) + 1
                if len(self.rejects) < self.MAX_SAMPLES:
                    self.rejects.append(res)
                continue
            else:
                continue
            if self._is_duplicate(ev):
                st.duplicates += 1
                continue
            st.events += 1
            yield ev

    def _forged(self, f: Forged) -> None:
        st = self.stats
        st.forged += 1
        st.forged_reasons[f.reason] = st.forged_reasons.get(f.reason, 0) + 1
        if len(self.forgeries) < self.MAX_SAMPLES:
            self.forgeries.append(f)

    def _is_duplicate(self, ev: Event) -> bool:
        digest = hash((ev.event, ev.ts_ms, ev.fields, ev.text))  # the content (boot, seq: k)
        k = (ev.boot, ev.seq)
        seen = self._seen.get(k)
        if seen is not None and digest in seen:
            return True
        if seen is None:
            self._seen[k] = {digest}
        else:  # a different line with a seq already seen: kept, and reported as a conflict
            self.stats.conflicts += 1
            seen.add(digest)
            self._seen.move_to_end(k)
        while len(self._seen) > self.DEDUP_WINDOW:
            self._seen.popitem(last=False)
        return False


def decode_all(data: bytes, key: bytes | None = None) -> tuple[list[Event], DecodeStats]:
    """Decode a whole dump at once (pinning the first key announced when ``key`` is None)."""
    d = StreamDecoder(key)
    events = d.feed(data)
    events += d.flush()
    return events, d.stats
