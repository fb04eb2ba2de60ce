"""Serial-line protocol v3: the public contract between the agent (encode) and the poller (decode).

A line looks like::

    GCEWD3 3f2a9c1e 42 2026-11-30T04:18:14.123Z tick rung=3/10 md=fail eg=fail \
        | BOTH reachability probes FAILED (3/10) #<86 base64url: Ed25519 signature><8 hex: CRC>

(one line on the wire; wrapped here).

- ``GCEWD3``: marker and protocol version; a substring scan finds it anywhere in a console line.
- boot: the first 8 hex digits of the kernel boot id (a new boot is a new incarnation of the VM).
- seq: per-boot sequence number, +1 per line across every writer on the VM.
- ts: UTC, millisecond precision (the guest's clock: shown, never used to measure silence).
- event: ``[a-z][a-z0-9_]*``.
- fields: ``key=value``; keys ``[a-z][a-z0-9_]*``, values from a safe token alphabet (no spaces).
- text: optional human-readable trailer after `` | `` (printable ASCII, no ``#``).
- ``#<sig><crc>``: the Ed25519 signature (PyNaCl/libsodium) of every byte from the marker up to
  the space before ``#``, under the instance's private key (only root on the VM holds it), then
  the CRC-32 of everything from the marker through the signature (damage, which anyone can
  compute).

The announcement (``key pk=<public key> inst=<instance id> [eph=1]``, self-signed) takes seq 0 and
1 of every boot and every multiple of ANNOUNCE_EVERY. Readers pin a key only from the first line of
the instance's first boot read from byte 0, or by hand (the ledger keeps pins); a line that does
not verify under the pin is **forged**: counted, shown, never decides. v2 (HMAC) and v1 (CRC)
lines never decide once a v3 pin exists (docs/serial-protocol.md, "Upgrade from v2").

The whole line is ASCII and at most :data:`MAX_LINE` bytes. A line whose CRC does not match
(spliced with kernel output, truncated, bit-flipped) is rejected and counted, never misread.
``docs/serial-protocol.md`` is the specification; changing this module means changing that document
and the version.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

VERSION = 3
MARKER = "GCEWD3"
MARKER_BYTES = MARKER.encode()
# Every marker prefix of any version: what `neutralize` defuses in output we pass through.
MARKER_PREFIX = b"GCEWD"
# A 38400-baud console carries ~3.8 KB/s; 280 bytes keeps one line under 0.1 s of port time, and
# leaves the fields and text of a v3 line the 184 bytes a v2 line had (174) and more.
MAX_LINE = 280
MAX_VALUE = 64  # bytes per field value; keeps one line from being eaten by a single field
MAX_TEXT = 100  # bytes of human text; truncated (never rejected) when longer
MIN_TEXT = 12  # a text shortened below this says nothing: dropped instead
SIG_BYTES = 64  # Ed25519 signature
SIG_CHARS = 86  # its base64url form, no padding
PK_BYTES = 32  # Ed25519 public key (and the private seed)
PK_CHARS = 43  # its base64url form, no padding
TRAILER_LEN = len(" #") + SIG_CHARS + 8  # v3: " #" + signature + crc = 96 bytes
KEY_EVENT = "key"  # the announcement; the event readers see carries only the fingerprint
# A key rotation (``gce-watchdog key --rotate``): ``rekey pk=<new public key> inst=<instance id>``
# signed with the OLD key. Readers move their pin only through one that verifies under the pin.
REKEY_EVENT = "rekey"
# The announcement is the first two lines of every boot (seq 0 and 1: a kernel message spliced
# into one copy leaves the other) and then the line before every seq that is a multiple of this.
ANNOUNCE_EVERY = 32
# A reader pins only an announcement among a boot's first lines (seq 0 or 1, see above).
PIN_MAX_SEQ = 1
# Routine events: no decision reads them (poller/verdict.py reads a tick's or heartbeat's phase
# and rung for its text only, and a boot's liveness, which covered lines never move). A reader
# may accept one unchecked when a later line of its boot verified (docs/serial-protocol.md,
# "Verifying what decides"); every other event is decisive and verified before it is an event.
ROUTINE_EVENTS = frozenset({"tick", "heartbeat", "mem"})
# Markers tried per console line. Ours carry one (two when a journald copy is glued on); more is
# someone else's output, and stopping here keeps a hostile line of markers linear to decode.
_KEY_RE = re.compile(r"[a-z][a-z0-9_]{0,23}\Z")
_VALUE_RE = re.compile(r"[A-Za-z0-9._:/@,+%~()<>\[\]-]{1,64}\Z")
_VALUE_BAD = re.compile(r"[^A-Za-z0-9._:/@,+%~()<>\[\]-]")
_TEXT_BAD = re.compile(r"[^\x20-\x22\x24-\x7e]")  # printable ASCII except '#'
_BOOT_RE = re.compile(r"[0-9a-f]{8}\Z")
_PK_RE = re.compile(r"[A-Za-z0-9_-]{43}\Z")
_VALUE_CHARS = r"[A-Za-z0-9._:/@,+%~()<>\[\]-]"
# A whole body in one C-level match (_parse_parts), instead of a regex per token: marker, boot,
# seq (no leading zero), the timestamp split as parse_ts takes it (minute, second, millisecond;
# ``\d`` is what its isdecimal takes), event name and ``key=value`` fields, each exactly as
# _KEY_RE/_VALUE_RE/_BOOT_RE say, then the text after the first `` | `` (the head holds no
# ``|``). What those rules or parse_ts refuse, it refuses: no match.
_BODY_RE = re.compile(
    r"GCEWD[123] ([0-9a-f]{8}) (0|[1-9][0-9]*) (\d{4}-\d\d-\d\dT\d\d:\d\d):(\d\d)\.(\d\d\d)Z"
    r" ([a-z][a-z0-9_]{0,23})((?: [a-z][a-z0-9_]{0,23}=" + _VALUE_CHARS + r"{1,64})*)"
    r"(?: \| (.*))?\Z",
    re.DOTALL,
)
_FIELD_RE = re.compile(r" ([a-z][a-z0-9_]{0,23})=(" + _VALUE_CHARS + r"{1,64})")


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
    # A routine line accepted without its own signature check: a later line of its boot with a
    # higher seq verified in the same block (docs/serial-protocol.md, decoding rule "covered").
    # Not part of equality nor of the JSON form; it never decides (poller/timeline.py).
    covered: bool = field(default=False, compare=False, repr=False)
    # A line carried over (the budget reached it in a later block): when its first block was
    # received (the reader's clock), not part of equality nor of the JSON form.
    rx: float | None = field(default=None, compare=False, repr=False)

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
        """A human form for evidence and reports: no marker, no signature (never a valid line)."""
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


def neutralize_after(before: bytes, data: bytes) -> bytes:
    """``data`` defused as it follows ``before`` in one output stream: every marker wholly in
    ``data`` and every marker that ``before`` (what was written last, to any stream sharing the
    destination) begins and ``data`` ends. Only bytes of ``data`` change (the marker's ``D``
    always lies in it), so nothing is held back: a workload that ends stdout with ``GCEW``,
    closes it and writes ``D3 ...`` on stderr gets ``GCEWd3``."""
    tail = before[-(len(MARKER_PREFIX) - 1) :] if before else b""
    return neutralize(tail + data)[len(tail) :]


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
    """``YYYY-MM-DDTHH:MM:SS.mmmZ`` (UTC). The minute's text is cached (a stream's lines share
    their minutes): the same text as ``strftime`` of the whole second gives."""
    sec = ts_ms // 1000
    return f"{_minute_text(sec // 60)}:{sec % 60:02d}.{ts_ms % 1000:03d}Z"


@functools.lru_cache(maxsize=4096)
def _minute_text(minute: int) -> str:
    return datetime.fromtimestamp(minute * 60, tz=UTC).strftime("%Y-%m-%dT%H:%M")


def parse_ts(s: str) -> int | None:
    """``YYYY-MM-DDTHH:MM:SS.mmmZ`` as milliseconds since the epoch (UTC); None when it is not
    one: exactly what a regex of that shape and ``datetime()`` accept (the reference is in
    tests/unit/test_protocol.py). The minute is cached: a stream's lines share their minutes."""
    if len(s) != 24 or s[16] != ":" or s[19] != "." or s[23] != "Z":
        return None
    sec, ms = s[17:19], s[20:23]
    if not (sec.isdecimal() and ms.isdecimal()):  # what the pattern's \d takes
        return None
    base = _minute_s(s[:16])
    sec_i = int(sec)
    if base is None or sec_i > 59:
        return None
    return (base + sec_i) * 1000 + int(ms)


_MINUTE_RE = re.compile(r"\d{4}-\d\d-\d\dT(\d\d):(\d\d)\Z")


@functools.lru_cache(maxsize=4096)
def _minute_s(prefix: str) -> int | None:
    """Seconds since the epoch of a ``YYYY-MM-DDTHH:MM`` minute (UTC); None for no such one."""
    m = _MINUTE_RE.match(prefix)
    if m is None:
        return None
    day = _day_s(prefix[:10])
    h, mi = int(m.group(1)), int(m.group(2))
    if day is None or h > 23 or mi > 59:  # what datetime() accepts
        return None
    return day + (h * 60 + mi) * 60


@functools.lru_cache(maxsize=1024)
def _day_s(date: str) -> int | None:
    """Seconds since the epoch of a ``YYYY-MM-DD`` day at 00:00 UTC; None for no such day."""
    try:
        dt = datetime(int(date[:4]), int(date[5:7]), int(date[8:10]), tzinfo=UTC)
    except ValueError:
        return None
    return int(dt.timestamp())


def _crc(body: bytes) -> str:
    return f"{zlib.crc32(body) & 0xFFFFFFFF:08x}"


def fingerprint(key: bytes) -> str:
    """A v2 key's public name (8 hex of its SHA-256)."""
    return hashlib.sha256(key).hexdigest()[:8]


def pk_fingerprint(public: bytes) -> str:
    """A v3 public key's name: 32 hex (128 bits) of its SHA-256. Safe to show; long enough that
    nobody can make a key of their own with the same fingerprint (an operator pins by it)."""
    return hashlib.sha256(public).hexdigest()[:32]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LineKey:
    """The instance's private line key (an Ed25519 seed) and its public half.

    Its repr and str never show the seed; nothing in this package prints it. ``ephemeral``: the
    key could not be kept in the state dir (lines announce ``eph=1``: readers raise an alarm)."""

    __slots__ = ("_sk", "ephemeral", "public")

    def __init__(self, seed: bytes, ephemeral: bool = False) -> None:
        from nacl.signing import SigningKey

        if len(seed) != PK_BYTES:
            raise ProtocolError(f"a line key seed is {PK_BYTES} bytes")
        self._sk = SigningKey(seed)
        self.public = bytes(self._sk.verify_key)
        self.ephemeral = ephemeral

    def sign(self, body: bytes) -> bytes:
        return bytes(self._sk.sign(body).signature)

    @property
    def fingerprint(self) -> str:
        return pk_fingerprint(self.public)

    def __repr__(self) -> str:
        return f"LineKey(fingerprint={self.fingerprint}, ephemeral={self.ephemeral})"

    __str__ = __repr__


@functools.lru_cache(maxsize=256)
def _verifier(public: bytes) -> Callable[[bytes, bytes], object]:
    from nacl.signing import VerifyKey

    return VerifyKey(public).verify


def verify(public: bytes, body: bytes, sig: bytes) -> bool:
    """Whether ``sig`` is an Ed25519 signature of ``body`` under ``public``. Never raises."""
    from nacl.exceptions import BadSignatureError, CryptoError

    try:
        _verifier(public)(body, sig)
    except (BadSignatureError, CryptoError, ValueError, TypeError):
        return False
    return True


def encode(ev: Event, key: LineKey) -> str:
    """Encode and sign one v3 event (without the newline). Raises ProtocolError on bad input."""
    raw = _body(ev).encode()
    signed = raw + b" #" + b64(key.sign(raw)).encode()
    line = f"{signed.decode()}{_crc(signed)}"
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line is {len(line)} bytes, limit {MAX_LINE}")
    return line


def _body(ev: Event, marker: str = MARKER) -> str:
    if not _KEY_RE.match(ev.event):
        raise ProtocolError(f"bad event name {ev.event!r}")
    if not _BOOT_RE.match(ev.boot):
        raise ProtocolError(f"bad boot id {ev.boot!r}: want 8 lowercase hex digits")
    if ev.seq < 0 or ev.ts_ms < 0:
        raise ProtocolError("seq and ts_ms must be >= 0")
    parts = [marker, ev.boot, str(ev.seq), format_ts(ev.ts_ms), ev.event]
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


def make_event(
    event: str,
    boot: str,
    seq: int,
    ts_ms: int,
    fields: Mapping[str, object] | Iterable[tuple[str, object]] = (),
    text: str = "",
    fixed: tuple[tuple[str, str], ...] = (),
) -> Event:
    """Build an event, sanitizing values and text.

    If the line would be too long, the text is shortened (ending in ``...``), or dropped when
    fewer than MIN_TEXT bytes of it would fit; if the fields alone are still too long,
    the longest values are cut short until it fits. Values often come from files or exception
    names the writer does not control, and a shortened value beats a lost line (or a writer
    killed by the raise). Bad names and keys still raise: those are bugs.

    ``fixed``: fields the writer adds to every line (the boot counter ``bc``), already in the
    value alphabet: put after the others and never shortened (a cut counter would be another
    counter).
    """
    items = fields.items() if isinstance(fields, Mapping) else fields
    clean = [(k, sanitize_value(v)) for k, v in items]
    ev = Event(event, boot, seq, ts_ms, (*clean, *fixed), sanitize_text(text))
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
        ev = Event(event, boot, seq, ts_ms, (*clean, *fixed), "")
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

    BAD_SIG = "bad_sig"  # v3: the signature does not verify under the pinned key
    NO_KEY = "no_key"  # no key pinned yet for this instance: nothing can verify it
    UNPLACED = "unplaced_key"  # v3: a key announced that is not the pinned one, or not placeable
    RELABELLED = "relabelled"  # v3: the pinned key's announcement names another instance
    BAD_MAC = "bad_mac"  # v2: the MAC does not verify under the pinned v2 key
    V2 = "v2"  # a protocol v2 line with no v2 key held for the instance (or after a v3 pin)
    LEGACY = "v1"  # a protocol v1 line: a CRC only, which any process can compute
    KEY_CONFLICT = "key_conflict"  # v2: a key announcement of another key than the pinned one
    BAD_REKEY = "bad_rekey"  # v3: a rekey line that does not verify under the pin (or malformed)
    # v3: a line (or announcement) of the key the instance rotated away from, outside what it
    # signed before the rotation: counted apart, not an alarm, never decides
    RETIRED = "retired_key"


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
    """An intact key announcement; the reader decides whether to pin or accept it.

    v2: self-consistent (its MAC verifies under the key it carries), ``key`` the HMAC key. v3:
    ``key`` the public key, **not yet verified** (:meth:`valid` checks the self-signature: a
    reader does that only for an announcement it could accept, see StreamDecoder)."""

    event: Event  # as readers show it: ``key kid=<fingerprint> ...``, never the key itself
    key: bytes
    version: int = 2
    inst: str = "-"
    ephemeral: bool = False
    body: bytes = b""
    sig: bytes = b""

    def valid(self, verifier: Callable[[bytes, bytes, bytes], bool] | None = None) -> bool:
        return self.version == 2 or (verifier or verify)(self.key, self.body, self.sig)

    @property
    def fingerprint(self) -> str:
        return pk_fingerprint(self.key) if self.version == 3 else fingerprint(self.key)


# What a reader makes of one marker of a console line: (the line's answer when this marker ends
# it, else None; a forgery to report when no later marker ends the line; whether a trailer was
# intact but its body not a line: a syntax reject).
MarkerRead = tuple[Event | KeyAnnounce | Forged | None, Forged | None, bool]


def _new_event(
    event: str,
    boot: str,
    seq: int,
    ts_ms: int,
    fields: tuple[tuple[str, str], ...],
    text: str,
    covered: bool = False,
    rx: float | None = None,
) -> Event:
    """``Event(...)`` without the frozen dataclass's per-field ``object.__setattr__`` (a third
    of its cost): the decoder builds one per accepted line. Equal to the constructor's result
    field for field (tests/unit/test_protocol.py checks it against :func:`dataclasses.fields`)."""
    ev = _object_new(Event)
    d = ev.__dict__
    d["event"], d["boot"], d["seq"], d["ts_ms"] = event, boot, seq, ts_ms
    d["fields"], d["text"], d["covered"], d["rx"] = fields, text, covered, rx
    return ev


_object_new = object.__new__


@functools.lru_cache(maxsize=4096)
def _fields_of(kvs: str) -> tuple[tuple[str, str], ...] | None:
    """The ``key=value`` fields of a head's tail (_BODY_RE checked its shape); None when a key
    repeats. Cached: a stream's routine lines repeat their fields."""
    fields: tuple[tuple[str, str], ...] = tuple(_FIELD_RE.findall(kvs))
    if len(fields) > 1 and len({k for k, _ in fields}) != len(fields):
        return None  # a duplicate key
    return fields


@functools.lru_cache(maxsize=4096)
def _text_ok(text: str) -> bool:
    """Whether a trailer text is one a writer produces (sanitize_text's alphabet, stripped)."""
    return not _TEXT_BAD.search(text) and text == text.strip()


def _parse_parts(body: str) -> tuple[str, str, int, int, tuple[tuple[str, str], ...], str] | None:
    """A body's (event, boot, seq, ts_ms, fields, text), or None when it is not a line: the
    head (before the first `` | ``) and its timestamp as _BODY_RE and parse_ts say, no
    duplicate key, a text as sanitize_text leaves it."""
    m = _BODY_RE.match(body)
    if m is None:
        return None
    boot, seq_s, minute, sec, ms, name, kvs, text = m.groups()
    base = _minute_s(minute)
    sec_i = int(sec)
    if base is None or sec_i > 59:
        return None
    fields = _fields_of(kvs) if kvs else ()
    if fields is None:
        return None
    if text is None:
        text = ""
    elif text and not _text_ok(text):
        return None
    return name, boot, int(seq_s), (base + sec_i) * 1000 + int(ms), fields, text


def _parse_body(body: str) -> Event | None:
    p = _parse_parts(body)
    return None if p is None else _new_event(*p)
