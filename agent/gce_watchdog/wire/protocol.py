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
import binascii
import functools
import gc
import hashlib
import hmac
import operator
import re
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

VERSION = 3
MARKER = "GCEWD3"
MARKER_BYTES = MARKER.encode()
V2_MARKER = "GCEWD2"  # protocol v2: HMAC lines (see "Upgrade" in docs/serial-protocol.md)
LEGACY_MARKER = "GCEWD1"  # protocol v1: CRC only, unauthenticated; read as forged, never decides
# Every marker prefix of any version: what `neutralize` defuses in output we pass through.
MARKER_PREFIX = b"GCEWD"
# A 38400-baud console carries ~3.8 KB/s; 280 bytes keeps one line under 0.1 s of port time, and
# leaves the fields and text of a v3 line the 184 bytes a v2 line had (174) and more.
MAX_LINE = 280
V2_MAX_LINE = 200
MAX_VALUE = 64  # bytes per field value; keeps one line from being eaten by a single field
MAX_TEXT = 100  # bytes of human text; truncated (never rejected) when longer
MIN_TEXT = 12  # a text shortened below this says nothing: dropped instead
MAC_BYTES = 8  # truncated HMAC-SHA256: 64 bits, one forgery in 2**64 tries
KEY_BYTES = 32  # the per-instance secret (256 bits, 64 hex: exactly one field value)
V2_TRAILER_LEN = len(" #") + 8 + 2 * MAC_BYTES  # v2: " #" + crc + mac
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
MAX_MARKERS_PER_LINE = 8

_KEY_RE = re.compile(r"[a-z][a-z0-9_]{0,23}\Z")
_VALUE_RE = re.compile(r"[A-Za-z0-9._:/@,+%~()<>\[\]-]{1,64}\Z")
_VALUE_BAD = re.compile(r"[^A-Za-z0-9._:/@,+%~()<>\[\]-]")
_TEXT_BAD = re.compile(r"[^\x20-\x22\x24-\x7e]")  # printable ASCII except '#'
_BOOT_RE = re.compile(r"[0-9a-f]{8}\Z")
_HEXKEY_RE = re.compile(r"[0-9a-f]{64}\Z")
_MARKER_RE = re.compile(rb"GCEWD([123])")
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
# A whole plain line (from its marker, one marker, nothing after the trailer, no ``#`` before it):
# its boot, seq, event name, signature and CRC without parsing the rest (_Cand.ev does that).
_PLAIN_V3 = re.compile(
    rb"GCEWD3 ([0-9a-f]{8}) (0|[1-9][0-9]{0,18}) [^ #]+ ([a-z][a-z0-9_]{0,23})(?: [^#]*)?"
    rb" #([A-Za-z0-9_-]{86})([0-9a-f]{8})\Z"
)
_FIELD_RE = re.compile(r" ([a-z][a-z0-9_]{0,23})=(" + _VALUE_CHARS + r"{1,64})")
# One match per console line that carries a marker: from its first marker to the line's end.
_MARKER_LINE_RE = re.compile(rb"GCEWD[123][^\n]*")
# Of those (joined by LF), the ones with " #" after the marker: only these can be intact.
_TRAILER_LINE_RE = re.compile(rb"^GCEWD[123][^\n]* #[^\n]*", re.MULTILINE)
# Trailer candidates: v2 " #" + 24 hex (crc + mac), v1 " #" + 8 hex. We look for every occurrence
# within MAX_LINE bytes of a marker, not only at the end of the console line, so a kernel message
# glued after an intact line does not lose it.
_TRAILER_V2 = re.compile(rb" #([0-9a-f]{8})([0-9a-f]{16})")
_TRAILER_V1 = re.compile(rb" #([0-9a-f]{8})")
# v3: " #" + 86 base64url (the Ed25519 signature of the body) + 8 hex (CRC-32 of everything from
# the marker through the signature: damage anywhere in the line, the signature included, is a
# checksum reject, never a forgery).
_TRAILER_V3 = re.compile(rb" #([A-Za-z0-9_-]{86})([0-9a-f]{8})")


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
    dt = datetime.fromtimestamp(ts_ms // 1000, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{ts_ms % 1000:03d}Z"


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


def mac(key: bytes, body: bytes) -> str:
    """v2: the truncated HMAC-SHA256 of a line body, 16 lowercase hex."""
    return hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES].hex()


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


def encode_v2(ev: Event, key: bytes) -> str:
    """A protocol v2 line (HMAC): what a v2 agent writes. Readers' upgrade path and its tests."""
    line = _encode_any_length(ev, key)
    if len(line) > V2_MAX_LINE:
        raise ProtocolError(f"line is {len(line)} bytes, limit {V2_MAX_LINE}")
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


def _encode_any_length(ev: Event, key: bytes) -> str:
    if len(key) != KEY_BYTES:
        raise ProtocolError(f"key must be {KEY_BYTES} bytes")
    raw = _body(ev, V2_MARKER).encode()
    return f"{raw.decode()} #{_crc(raw)}{mac(key, raw)}"


def key_line_v2(boot: str, seq: int, ts_ms: int, key: bytes) -> str:
    """The v2 key announcement (a boot's seq 0): signed with the key it announces."""
    return encode_v2(Event(KEY_EVENT, boot, seq, ts_ms, (("k", key.hex()),)), key)


def announce_event(boot: str, seq: int, ts_ms: int, key: LineKey, inst: str = "-") -> Event:
    """The v3 announcement: the public key, the instance id (``-``: not known yet) and, for a
    key that could not be kept, ``eph=1``; signed with the key it announces, so the key is bound
    to this boot and this instance (a line cannot be relabelled to another VM)."""
    fields: tuple[tuple[str, str], ...] = (("pk", b64(key.public)), ("inst", sanitize_value(inst)))
    if key.ephemeral:
        fields += (("eph", "1"),)
    return Event(KEY_EVENT, boot, seq, ts_ms, fields)


def key_line(boot: str, seq: int, ts_ms: int, key: LineKey, inst: str = "-") -> str:
    """The encoded v3 announcement (see :func:`announce_event`)."""
    return encode(announce_event(boot, seq, ts_ms, key, inst), key)


def rekey_event(boot: str, seq: int, ts_ms: int, new_public: bytes, inst: str) -> Event:
    """The rotation line: the new public key and the instance id it is bound to (never ``-``).
    Signed with the old key (:func:`rekey_line`), so only the holder of the pinned key can move
    the pin; the boot, seq and instance id are signed too (a copy in another VM's stream names
    that other VM)."""
    if len(new_public) != PK_BYTES:
        raise ProtocolError(f"a public key is {PK_BYTES} bytes")
    if not inst or inst == "-" or sanitize_value(inst) != inst:
        raise ProtocolError(f"a rekey line names the instance id, not {inst!r}")
    return Event(REKEY_EVENT, boot, seq, ts_ms, (("pk", b64(new_public)), ("inst", inst)))


def rekey_line(boot: str, seq: int, ts_ms: int, old: LineKey, new_public: bytes, inst: str) -> str:
    """The encoded rotation line, signed with the ``old`` key (see :func:`rekey_event`)."""
    return encode(rekey_event(boot, seq, ts_ms, new_public, inst), old)


def parse_rekey(ev: Event) -> tuple[bytes, str] | None:
    """(new public key, instance id) of a ``rekey`` event as decoded (its raw ``pk``), or None
    when its fields are not exactly ``pk`` and ``inst`` (an instance id, never ``-``)."""
    d = ev.fields_dict
    pk, inst = d.get("pk", ""), d.get("inst", "")
    if ev.event != REKEY_EVENT or set(d) != {"pk", "inst"} or not _PK_RE.match(pk):
        return None
    if not inst or inst == "-":
        return None
    return unb64(pk), inst


def shown_rekey(ev: Event, old: bytes | None = None) -> Event:
    """A ``rekey`` line as readers show it: ``rekey kid=<new fingerprint> inst=... [old=<fp>]``
    (fingerprints, like the announcement's ``kid``)."""
    parsed = parse_rekey(ev)
    if parsed is None:
        return ev
    new, inst = parsed
    shown = [("kid", pk_fingerprint(new)), ("inst", inst)]
    if old is not None:
        shown.append(("old", pk_fingerprint(old)))
    return Event(REKEY_EVENT, ev.boot, ev.seq, ev.ts_ms, tuple(shown), ev.text)


@dataclass(frozen=True)
class Retired:
    """The key an instance rotated away from, and where: its ``rekey`` line's boot and seq.

    Its lines still verify for the lines it signed before the rotation in that boot (seq below
    the rekey's: the VM's writers number them before the switch, and a line queued by another
    writer may reach the console after the rekey line), and the rekey line itself. Its other
    lines are ``retired_key``: neither evidence nor an alarm (a reader that took the pin after
    the rotation sees the instance's older lines so)."""

    public: bytes
    boot: str
    seq: int

    def covers(self, ev: Event, successor: bytes | None) -> bool:
        """Whether this key signed ``ev`` before its rotation: a line of the rotation boot
        below the rekey's seq, or the rekey line itself (naming ``successor``, the key that
        replaced this one)."""
        if ev.boot != self.boot:
            return False
        if ev.seq < self.seq:
            return True
        if ev.seq == self.seq and successor is not None:
            parsed = parse_rekey(ev)
            return parsed is not None and parsed[0] == successor
        return False


# The rotations readers remember per instance (the ledger keeps as many): oldest first.
MAX_RETIRED = 8
Retirees = tuple[Retired, ...]


def _retirees(retired: Retired | Retirees | None) -> Retirees:
    if retired is None:
        return ()
    return (retired,) if isinstance(retired, Retired) else tuple(retired)


def _signer_of(
    ev: Event, chain: Retirees, pin: bytes | None
) -> tuple[Retired, bytes | None] | None:
    """The retired key that signed ``ev`` if it is a line from before that key's rotation
    (the nearest rotation above its seq in its boot), with that key's successor."""
    best: tuple[Retired, bytes | None] | None = None
    for i, r in enumerate(chain):
        succ = chain[i + 1].public if i + 1 < len(chain) else pin
        if r.covers(ev, succ) and (best is None or r.seq < best[0].seq):
            best = (r, succ)
    return best


def needs_announcement(seq: int) -> bool:
    """Whether a writer about to use ``seq`` writes the announcement there first: seq 0 and 1
    (two copies at the start of every boot) and every multiple of ANNOUNCE_EVERY."""
    return seq <= PIN_MAX_SEQ or seq % ANNOUNCE_EVERY == 0


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


@functools.lru_cache(maxsize=256)
def _pk_text(public: bytes) -> str:
    return b64(public)


def _v3_announce(ev: Event, body: bytes, sig: bytes) -> KeyAnnounce | None:
    """A v3 ``key`` line's announcement, or None when it is not one (wrong fields)."""
    d = ev.fields_dict
    pk, inst, eph = d.get("pk", ""), d.get("inst", ""), d.get("eph")
    if not _PK_RE.match(pk) or not inst or set(d) - {"pk", "inst", "eph"} or eph not in (None, "1"):
        return None
    public = unb64(pk)
    shown = [("kid", pk_fingerprint(public)), ("inst", inst)] + ([("eph", "1")] if eph else [])
    return KeyAnnounce(
        Event(KEY_EVENT, ev.boot, ev.seq, ev.ts_ms, tuple(shown)),
        public,
        3,
        inst,
        eph == "1",
        body,
        sig,
    )


def decode_line(
    line: bytes | str,
    key: bytes | None = None,
    pin: bytes | None = None,
    retired: Retired | Retirees | None = None,
    verifier: Callable[[bytes, bytes, bytes], bool] = verify,
) -> Event | KeyAnnounce | Forged | Rejected | None:
    """Decode one console line: ``pin`` is the instance's pinned v3 public key, ``key`` its
    pinned v2 key (None: not known; a v2 line is then forged, reason ``v2``).

    Returns None when the line does not carry a marker (someone else's output); an Event for an
    intact line that verifies under the pin (v3) or the v2 key (v2, only while no v3 pin is
    held); a KeyAnnounce for an intact key announcement (v3: its signature not yet checked,
    pinning is the caller's); Forged for an intact line that does not authenticate; Rejected
    when a marker is there but no intact line. Never raises.

    ``retired``: the keys the pin replaced (rotations, :class:`Retired`, oldest first): a line
    that does not verify under the pin is an Event when the retired key in force at its boot
    and seq (``Retired.covers``) signed it; a line of the latest retired key outside that, and
    an announcement of any retired key outside it, is Forged ``retired_key``. A ``rekey`` line
    comes back as an Event with its raw ``pk`` (moving the pin is the caller's,
    :func:`parse_rekey`); one that does not verify is Forged ``bad_rekey``.

    Linear in the line's length: at most MAX_MARKERS_PER_LINE markers are tried, each against
    the trailer candidates in the MAX_LINE bytes after it; at most two signatures are verified
    (the pin's, then the retired key's), each through ``verifier`` (a reader's budget: it may
    raise to stop the line, see StreamDecoder).
    """
    raw = line.encode("latin-1", "replace") if isinstance(line, str) else line
    chain = _retirees(retired)
    forged: Forged | None = None
    syntax = False
    tried = 0
    for m in _MARKER_RE.finditer(raw):
        tried += 1
        if tried > MAX_MARKERS_PER_LINE:
            return forged or Rejected(Reject.MARKERS, raw)
        start = m.start()
        version = int(m.group(1))
        if version == 3:
            end = min(len(raw), start + MAX_LINE)
            for t in _TRAILER_V3.finditer(raw, start, end):
                signed_end = t.end(1)
                if _crc(raw[start:signed_end]) != t.group(2).decode():
                    continue
                body = raw[start : t.start()]
                try:
                    ev = _parse_body(body.decode("ascii"))
                except UnicodeDecodeError:
                    ev = None
                if ev is None or not body.startswith(MARKER_BYTES):
                    syntax = True
                    continue
                sig = unb64(t.group(1).decode())
                if ev.event == KEY_EVENT and pin is not None and ev.get("pk") != _pk_text(pin):
                    old = next((r for r in chain if ev.get("pk") == _pk_text(r.public)), None)
                    if old is not None:
                        # a key rotated away from: its announcements before its rekey only
                        if not old.covers(ev, None):
                            return Forged(Forgery.RETIRED, raw, ev)
                        ann = _v3_announce(ev, body, sig)
                        if ann is not None and ann.valid(verifier):
                            return ann.event
                        return Forged(Forgery.BAD_SIG, raw, ev)
                    # another key than the pin: unplaced, whatever its signature (not checked)
                    return Forged(Forgery.UNPLACED, raw, ev)
                if ev.event == KEY_EVENT:
                    ann = _v3_announce(ev, body, sig)
                    if ann is not None:
                        return ann
                if pin is None:
                    forged = forged or Forged(Forgery.NO_KEY, raw, ev)
                    break
                if verifier(pin, body, sig):
                    return ev
                signer = _signer_of(ev, chain, pin) if chain else None
                if signer is not None:  # a line from before a rotation: the key of then
                    if verifier(signer[0].public, body, sig):
                        return ev
                elif chain and verifier(chain[-1].public, body, sig):
                    forged = forged or Forged(Forgery.RETIRED, raw, ev)
                    break
                bad = Forgery.BAD_REKEY if ev.event == REKEY_EVENT else Forgery.BAD_SIG
                forged = forged or Forged(bad, raw, ev)
                break
            continue
        end = min(len(raw), start + V2_MAX_LINE)
        v2 = version == 2
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
            if pin is not None:  # this instance speaks v3: its v2 lines never decide again
                forged = forged or Forged(Forgery.V2, raw, ev)
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
                forged = forged or Forged(Forgery.V2, raw, ev)
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


class _Unchecked(Exception):
    """The block's verification budget is spent (StreamDecoder._check)."""


class _Cand:
    """A plain v3 line under the pin whose signature is not checked yet (StreamDecoder).

    ``boot``, ``seq`` and ``kind`` come from the line's head; the whole line is parsed
    (:attr:`ev`) only when it is accepted or shown as forged: a line the budget never reaches
    costs one regex match and a CRC. ``sig`` is the signature's base64url text."""

    NEW, OK, FORGED, FULL, COVERED, UNCHECKED, SYNTAX = range(7)
    __slots__ = (
        "_ev", "_owned", "body", "boot", "carried", "kind", "late", "ln", "pin", "rx", "seq", "sig",
        "simple", "state",
    )  # fmt: skip

    def __init__(
        self,
        ln: bytes,
        boot: str,
        seq: int,
        kind: str,
        ev: Event | None,
        body: bytes,
        sig: bytes,
        pin: bytes,
        simple: bool,
        carried: bool,
        rx: float | None,
    ) -> None:
        self.ln, self._ev, self.body, self.sig, self.pin = ln, ev, body, sig, pin
        self.boot, self.seq, self.kind = boot, seq, kind
        self.simple, self.carried, self.rx = simple, carried, rx
        self.late = not carried  # carried-over lines are checked first (the sort key)
        self.state = _Cand.NEW
        self._owned = False

    @property
    def owned(self) -> bool:
        """Whether :attr:`ev` was parsed here (no other reference to it exists yet)."""
        return self._owned

    @property
    def ev(self) -> Event | None:
        """The parsed line (None: it does not parse, a syntax reject like decode_line's)."""
        if self._ev is None:
            self._owned = True
            try:
                self._ev = _parse_body(self.body.decode("ascii"))
            except UnicodeDecodeError:
                return None
        return self._ev


# Phase B's sort keys, C-level (StreamDecoder._decode_lines): carried first, then by boot and seq.
_SORT_KEY = operator.attrgetter("late", "boot", "seq")
_SEQ = operator.attrgetter("seq")


def _text_of(cache: dict[bytes, str], raw: bytes) -> str:
    text = cache[raw] = raw.decode()
    return text


_B64_STD = bytes.maketrans(b"-_", b"+/")


def _unb64_sig(text: bytes) -> bytes:
    """A signature's base64url text (86 characters, checked by the trailer regex) as bytes."""
    return binascii.a2b_base64(text.translate(_B64_STD) + b"==")


def _digest(ev: Event) -> int:
    """A line's content apart from its (boot, seq): what tells a copy from a conflict."""
    return hash((ev.event, ev.ts_ms, ev.fields, ev.text))


@dataclass
class DecodeStats:
    lines: int = 0
    events: int = 0
    rejected: int = 0
    duplicates: int = 0
    forged: int = 0  # intact lines that did not authenticate (never events)
    retired: int = 0  # lines of a key rotated away from, after its rotation (not forged)
    conflicts: int = 0  # authenticated lines whose (boot, seq) was seen with other content
    verified: int = 0  # signatures checked (Ed25519), within the blocks' budgets
    covered: int = 0  # routine lines accepted unchecked below a verified line of their boot
    unchecked: int = 0  # lines the budget never reached (and the carry-over could not hold)
    reject_reasons: dict[str, int] = field(default_factory=dict)
    forged_reasons: dict[str, int] = field(default_factory=dict)


def split_lines(data: bytes) -> list[bytes]:
    """Split console bytes at LF, CRLF and a bare CR (a line ending some programs use alone)."""
    if b"\r" not in data:
        return data.split(b"\n")
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")


class StreamDecoder:
    """Incremental decoder: feed arbitrary byte chunks, get authenticated events in order.

    ``pin``: the instance's pinned v3 public key (the ledger's), or None. ``pin_fp``: a
    fingerprint pinned by hand (``gce-watchdog pin``): the announced key with that fingerprint
    becomes the pin. ``from_start``: the stream is the port's output from byte 0 (or the export
    from the instance's creation): only then may the stream's first intact line, an announcement
    of seq 0 or 1, be pinned (:attr:`pinned_here`; the caller stores it in the ledger). Any other
    announced key is **unplaced** (:attr:`unplaced`, an alarm): its lines never decide.
    ``key``: a v2 HMAC key held from before the upgrade (v2 lines verify under it while no v3
    pin is held). ``instance_id``: the instance the stream is read for (announcements naming
    another instance are never pinned nor accepted).

    A line split across two chunks is joined before decoding; a partial last line is held until
    its line ending arrives (or :meth:`flush`). The same line seen twice (boot, seq and content:
    our line and its journald copy) is reported once; another line with a (boot, seq) already
    seen is a **conflict**, kept and counted.
    """

    # A console line longer than this is not ours (ours are <= 280 bytes): keep only its tail so
    # a reader fed a newline-free stream cannot grow without bound.
    MAX_PENDING = 64 * 1024
    # Copies of a line (journald forwarding) arrive within seconds of it: the last 4096 distinct
    # lines (hours of agent output) are remembered, by arrival, whatever their seq.
    DEDUP_WINDOW = 4096
    MAX_SAMPLES = 1000  # rejected/forged raw lines kept for reports
    MAX_UNPLACED = 16  # fingerprints of unplaced keys kept for the alarm
    # Signatures checked per block: a fixed share plus one per BUDGET_BYTES of the block (a
    # MiB: 96 + 128 = 224 checks, ~13 ms at ~59 us each); ours need about one per 32 lines
    # (the announcements) plus the decisive lines plus one per boot.
    BUDGET_LINES = 96
    BUDGET_BYTES = 8192
    # Decisive lines the budget did not reach, carried to the next block (checked first there).
    MAX_CARRY = 256
    MAX_BOOTS = 64  # boots with a verified line, remembered to order the checks (known first)

    def __init__(
        self,
        key: bytes | None = None,
        *,
        pin: bytes | None = None,
        pin_fp: str | None = None,
        from_start: bool = True,
        instance_id: str = "",
        retired: Retired | Retirees | None = None,
    ) -> None:
        self.stats = DecodeStats()
        self.key = key
        self.pin = pin
        self.pin_fp = pin_fp
        self.instance_id = instance_id
        self.pinned_here = False  # the pin was taken from this stream (store it)
        self.ephemeral = False  # the pinned key was announced eph=1 (not kept across boots)
        self.unplaced: list[str] = []  # fingerprints of announced keys that are not the pin
        self.key_conflict = False  # v2: a second, different v2 key was announced
        self.retired: Retirees = _retirees(retired)  # keys the pin replaced, oldest first
        # Rotations decoded here, in order, not yet stored: (old key, new key, boot, seq).
        self.rekeys: list[tuple[bytes, bytes, str, int]] = []
        self.inst_seen = ""  # the instance id the pinned key's announcements name (not "-")
        # Only the stream's first intact line may be pinned, and only from byte 0.
        self.placeable = from_start and pin is None and pin_fp is None
        self._pending = b""
        # (boot, seq) -> hashes of the contents seen with it, in arrival order, bounded.
        self._seen: OrderedDict[tuple[str, int], set[int]] = OrderedDict()
        self.rejects: list[Rejected] = []
        self.forgeries: list[Forged] = []
        self._budget = 0
        self._block_bytes = 0
        self._ok: set[bytes] = set()  # lines verified in this block (signed bytes)
        self._ok_bodies: set[bytes] = set()  # and their bodies
        # Decisive lines waiting for a budget (raw, stream order), with their block's receive time.
        self.carry: list[tuple[bytes, float | None]] = []
        self._rx: float | None = None
        self.lazy = True  # False: every line verified, no budget (a reference; tests, tools)
        # Lines never checked, not yet taken by the caller: (boot, seq, decisive); boot "" when
        # the line was not parsed (an announcement, a rotation, a line off the plain path).
        self.unchecked_new: list[tuple[str, int, bool]] = []
        self._boots: OrderedDict[str, None] = OrderedDict()

    def lost_before(self) -> None:
        """Bytes were lost (the API's window moved on): nothing later can be placed."""
        self.placeable = False

    def feed(self, chunk: bytes, rx: float | None = None) -> list[Event]:
        """``rx``: when the chunk was received (the reader's clock), kept with the lines that
        wait in the carry-over (their events carry it, :attr:`Event.rx`)."""
        self._rx = rx
        data = self._pending + chunk if self._pending else chunk
        if b"\r" in data:  # CRLF and a bare CR end a line too (split_lines): each CR becomes
            # LF in one pass (a one-byte replace: memchr-fast where CRs are sparse, unlike a
            # translate); a CRLF leaves an empty line, and empty lines count for nothing
            data = data.replace(b"\r", b"\n")
        cut = data.rfind(b"\n") + 1
        self._pending = data[cut:] if cut < len(data) else b""
        if len(self._pending) > self.MAX_PENDING:
            self._pending = self._pending[-self.MAX_PENDING :]
        return self._decode_block(data, cut)  # its whole lines, data[:cut], without a copy

    def flush(self, rx: float | None = None) -> list[Event]:
        """Decode the held partial line (end of a dump): a truncated last line is rejected."""
        self._rx = rx
        rest, self._pending = self._pending, b""
        if not rest and not self.carry:
            return []
        return self._decode_block(rest + b"\n" if rest else b"")

    def _decode_block(self, body: bytes, end: int = -1) -> list[Event]:
        """Whole lines (each ended by LF): ``body[:end]`` (``end`` -1: all of it, which then
        ends with LF or is empty; else ``body[end:]`` is the held partial line, not empty and
        without LF, left out of every count and scan). The scan is C-level: the lines with a
        marker, from their first marker on (``_MARKER_LINE_RE``), and of those the ones with a
        trailer candidate after it (a substring test, or ``_TRAILER_LINE_RE`` for many short
        ones); only those are decoded one by one. A marker line without one cannot be intact:
        rejected, counted in bulk (nothing about it depends on its place in the stream). So a
        MiB of short hostile lines costs a few regex scans."""
        st = self.stats
        lines = body.split(b"\n")
        tail = 0 if end < 0 or end == len(body) else 1  # the partial line: one non-empty piece
        if end < 0:
            end = len(body)
        st.lines += len(lines) - lines.count(b"") - tail
        self._block_bytes = end
        if body.find(MARKER_PREFIX, 0, end) < 0 and not self.carry:
            return []
        full = _MARKER_LINE_RE.findall(body, 0, end)
        if len(full) < end >> 6:  # few (ours: ~200 bytes apart): a test per line is
            cands = [x for x in full if b" #" in x]  # cheaper (" #" cannot overlap "GCEWDn")
        else:  # many short ones (a flood of bare markers): one scan, C-level
            cands = _TRAILER_LINE_RE.findall(b"\n".join(full))
        bare = len(full) - len(cands)
        if bare:
            st.rejected += bare
            st.reject_reasons[Reject.CHECKSUM] = st.reject_reasons.get(Reject.CHECKSUM, 0) + bare
            room = self.MAX_SAMPLES - len(self.rejects)
            if room > 0:
                samples = (x for x in full[: 2 * self.MAX_SAMPLES] if b" #" not in x)
                self.rejects.extend(
                    Rejected(Reject.CHECKSUM, x) for _, x in zip(range(room), samples, strict=False)
                )
        # The block allocates a few small objects per line and no reference cycles: the cyclic
        # collector is paused meanwhile (in a process holding many objects, its passes over
        # them cost a flood's MiB some 20-30 ms), and resumed as it was.
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            return list(self._decode_lines(cands))
        finally:
            if paused:
                gc.enable()

    def _note_unplaced(self, ann: KeyAnnounce) -> None:
        if len(self.unplaced) < self.MAX_UNPLACED:
            fp = ann.fingerprint
            if fp not in self.unplaced:
                self.unplaced.append(fp)

    def _announce(self, ln: bytes, ann: KeyAnnounce) -> Event | None:
        """Pin or accept a v3 announcement; None when it was counted as forged."""
        placeable, self.placeable = self.placeable, False
        other_vm = bool(self.instance_id) and ann.inst not in ("-", self.instance_id)
        checked = False
        if self.pin is None and not other_vm:
            if self.pin_fp is not None:  # pinned by hand: the key of that fingerprint, anywhere
                candidate = hmac.compare_digest(ann.fingerprint, self.pin_fp)
            else:  # the stream's first intact line, from byte 0, among a boot's first lines
                candidate = placeable and ann.event.seq <= PIN_MAX_SEQ
            try:
                # the stream's first line is checked whatever the budget (once per stream);
                # a hand pin's announcements spend it (a flood may repeat its public key)
                candidate = candidate and ann.valid(None if placeable else self._check)
            except _Unchecked:
                self.placeable = placeable
                raise
            if candidate:
                checked = True
                self.pin = ann.key
                self.pinned_here = True
        if self.pin is None or not hmac.compare_digest(self.pin, ann.key):
            self._note_unplaced(ann)  # no signature check: it decides nothing
            self._forged(Forged(Forgery.UNPLACED, ln, ann.event))
            return None
        if other_vm:
            self._forged(Forged(Forgery.RELABELLED, ln, ann.event))
            return None
        if not checked and not ann.valid(self._check):
            self._forged(Forged(Forgery.BAD_SIG, ln, ann.event))
            return None
        self.ephemeral = self.ephemeral or ann.ephemeral
        if ann.inst != "-":
            self.inst_seen = ann.inst
        return ann.event

    MAX_REKEYS = 16  # rotations queued for the caller between two stores (one is the rule)

    def _rekey(self, ln: bytes, ev: Event) -> Event | None:
        """A ``rekey`` line decode_line accepted (under the pin, or the retired key's own rekey
        into the pin); None when it was counted as forged."""
        parsed = parse_rekey(ev)
        if parsed is None or self.pin is None:
            self._forged(Forged(Forgery.BAD_REKEY, ln, ev))
            return None
        new, inst = parsed
        if new == self.pin or any(new == r.public for r in self.retired):
            # a rotation already followed (a copy, a replay): signed by the key of then
            prior = self.retired[-1].public if self.retired else None
            return shown_rekey(ev, prior)
        expected = self.instance_id or self.inst_seen
        if not expected or inst != expected:
            # a real rekey line of another VM (the same key: a restored disk) replayed here
            self._forged(Forged(Forgery.RELABELLED, ln, ev))
            return None
        if len(self.rekeys) >= self.MAX_REKEYS:  # the caller never stores: refuse, loudly
            self._forged(Forged(Forgery.BAD_REKEY, ln, ev))
            return None
        old = self.pin
        self.retired = (*self.retired, Retired(old, ev.boot, ev.seq))[-MAX_RETIRED:]
        self.pin, self.pin_fp, self.ephemeral = new, None, False
        self.rekeys.append((old, new, ev.boot, ev.seq))
        return shown_rekey(ev, old)

    def _decode_lines(self, lines: list[bytes]) -> Iterator[Event]:
        """Lines that start with a marker and carry a trailer candidate after it, in order.

        Verification is lazy and bounded (docs/serial-protocol.md, "Verifying what decides"):
        phase A decodes every line in stream order, running announcements, rotations and any
        line off the plain path through :meth:`_full` at once (they spend the budget first)
        and keeping the plain v3 lines under the pin as candidates; phase B verifies the
        decisive candidates by (known boot first, boot, seq), then walks each boot's routine
        candidates down from the highest seq until one verifies: the routine candidates below
        the highest verified seq of their boot are **covered** (accepted unchecked, flagged);
        phase C yields in stream order. A candidate the budget does not reach is no event:
        decisive ones wait in :attr:`carry` for the next block, and so do routine ones (they
        are above their boot's newest verified line: its liveness), in at most half of it; the
        rest are counted (:attr:`DecodeStats.unchecked`, :attr:`unchecked_boots`)."""
        self._budget = self.BUDGET_LINES + self._block_bytes // self.BUDGET_BYTES
        if not self.lazy:
            self._budget = 1 << 62
        self._ok = set()
        self._ok_bodies = set()
        carried, self.carry = self.carry, []
        out: list[Event | _Cand | None] = []
        top: dict[str, int] = {}  # boot -> the highest seq verified in this block
        ncarried, block_rx = len(carried), self._rx
        plain, crc32, prefix = _PLAIN_V3.match, zlib.crc32, MARKER_PREFIX
        boots_s: dict[bytes, str] = {}  # a block's boot ids, decoded once each
        kinds_s: dict[bytes, str] = {}  # and its event names
        # The candidates, in stream order: decisive ones, and routine ones by boot.
        decisive: list[_Cand] = []
        routine: dict[str, list[_Cand]] = {}
        other_path = False  # a candidate from _lazy (its boot is not in ``boots_s``)
        pin = self.pin
        fast = pin is not None and self.lazy and not self.retired
        for i, ln in enumerate([x for x, _ in carried] + lines if carried else lines):
            was_carried = i < ncarried
            rx = carried[i][1] if was_carried else block_rx
            # _lazy's plain path, inline (the flood's per-line cost): one line, one marker
            n = len(ln)
            m = plain(ln) if fast and n <= MAX_LINE else None
            if m is not None:  # anchored at the end: crc = ln[n-8:], sig = ln[n-94:n-8]
                boot, seq, kind_b, sig, crc = m.groups()
                if kind_b != b"key" and kind_b != b"rekey" and ln.count(prefix) == 1:
                    if (crc32(ln[: n - 8]) & 0xFFFFFFFF) != int(crc, 16):
                        self._reject(Rejected(Reject.CHECKSUM, ln))  # decode_line's answer
                        continue
                    boot_s = boots_s.get(boot) or _text_of(boots_s, boot)
                    kind = kinds_s.get(kind_b) or _text_of(kinds_s, kind_b)
                    c = _Cand(
                        ln, boot_s, int(seq), kind, None, ln[: n - 96], sig, pin, True,  # type: ignore[arg-type]
                        was_carried, rx,
                    )  # fmt: skip
                    out.append(c)
                    if kind in ROUTINE_EVENTS:
                        group = routine.get(boot_s)
                        if group is None:
                            routine[boot_s] = [c]
                        else:
                            group.append(c)
                    else:
                        decisive.append(c)
                    continue
                if kind_b == b"key" and ln.count(prefix) == 1:  # another key's announcement?
                    if (crc32(ln[: n - 8]) & 0xFFFFFFFF) != int(crc, 16):
                        self._reject(Rejected(Reject.CHECKSUM, ln))
                        continue
                    try:
                        ev = _parse_body(ln[: n - 96].decode("ascii"))
                    except UnicodeDecodeError:
                        ev = None
                    if ev is not None and ev.get("pk") != _pk_text(pin):
                        self._unplaced_line(Forged(Forgery.UNPLACED, ln, ev))  # never checked
                        continue
            cand = self._lazy(ln, was_carried, rx)
            if cand is True:
                continue
            if isinstance(cand, _Cand):
                out.append(cand)
                other_path = True
                if cand.kind in ROUTINE_EVENTS:
                    routine.setdefault(cand.boot, []).append(cand)
                else:
                    decisive.append(cand)
                continue
            try:
                ev = self._full(ln)
            except _Unchecked:
                self._defer(ln, None, rx)
                continue
            finally:  # a pin placed or moved by this line
                pin = self.pin
                fast = pin is not None and self.lazy and not self.retired
            if ev is not None and was_carried:
                ev = replace(ev, rx=rx)
            if ev is not None and ev.event != REKEY_EVENT:
                top[ev.boot] = max(top.get(ev.boot, -1), ev.seq)
            out.append(ev)
        if decisive or routine:  # intact lines: the stream's first line is behind us
            self.placeable = False
        known = self._boots
        # (known first, boot, seq) is (boot, seq) when the boots are all known or all not (of
        # the block's plain lines: a superset of the decisive lines' boots)
        boots = {c.boot for c in decisive} if other_path else boots_s.values()
        if len({b in known for b in boots}) <= 1:
            decisive.sort(key=_SORT_KEY)
        else:
            decisive.sort(key=lambda c: (c.late, c.boot not in known, c.boot, c.seq))
        unchecked = _Cand.UNCHECKED
        ok_bodies = self._ok_bodies
        for c in decisive:
            if self._budget <= 0 and c.body not in ok_bodies:  # spent (a flood): fast
                c.state = unchecked
                continue
            self._resolve(c)
            if c.state == _Cand.OK:
                top[c.boot] = max(top.get(c.boot, -1), c.seq)
        for boot, group in routine.items():
            group.sort(key=_SEQ, reverse=True)  # highest seq first (stable, like -seq)
            for c in group:
                if c.seq < top.get(boot, -1):
                    break
                self._resolve(c)
                if c.state == _Cand.OK:
                    top[boot] = max(top.get(boot, -1), c.seq)
                    break
                if c.state == _Cand.UNCHECKED:
                    break
        # The routine lines left at or below their boot's highest verified seq would be covered:
        # a (boot, seq) among them claimed with two contents in this block has each claimant
        # verified (or unchecked), never covered (seqs claimed in advance must not pass).
        keys = {
            (c.boot, c.seq)
            for group in routine.values()
            for c in group
            if c.state == _Cand.NEW and c.seq <= top.get(c.boot, -1)
        }
        claims: dict[tuple[str, int], set[int]] = {}
        if keys:
            for item in out:
                if isinstance(item, _Cand):
                    k, h = (item.boot, item.seq), hash(item.body)
                elif item is not None:
                    k, h = (item.boot, item.seq), _digest(item)
                else:
                    continue
                if k in keys:
                    claims.setdefault(k, set()).add(h)
        for boot, group in routine.items():
            high = top.get(boot, -1)
            for c in group:
                if c.state != _Cand.NEW:
                    continue
                if c.seq > high:
                    c.state = unchecked
                    continue
                if c.seq == high or len(claims[(boot, c.seq)]) > 1:
                    self._resolve(c)  # a copy of a verified line (free) or a conflict
                if c.state == _Cand.NEW:
                    c.state = _Cand.COVERED if c.seq < high else unchecked
        st = self.stats
        last_boot = ""
        carry, max_carry, unchecked_new = self.carry, self.MAX_CARRY, self.unchecked_new
        seen_map, window, covered = self._seen, self.DEDUP_WINDOW, _Cand.COVERED
        for item in out:
            if item is None:
                continue
            if isinstance(item, _Cand):
                state = item.state
                if state == unchecked:  # _defer, inline (a flood's per-line cost)
                    decisive_line = item.kind not in ROUTINE_EVENTS
                    # routine lines (above their boot's newest verified one: its liveness)
                    # take at most half the carry-over: decisive lines keep the rest
                    if len(carry) < (max_carry if decisive_line else max_carry // 2):
                        carry.append((item.ln, item.rx))
                    else:
                        st.unchecked += 1
                        unchecked_new.append((item.boot, item.seq, decisive_line))
                    continue
                if state == covered and item._ev is None:  # _settle + _is_duplicate, inline
                    try:  # (the common case: a routine line parsed once, flagged as it is made)
                        p = _parse_parts(item.body.decode("ascii"))
                    except UnicodeDecodeError:
                        p = None
                    if p is not None:
                        k = (item.boot, item.seq)
                        digest = hash((p[0], p[3], p[4], p[5]))  # _digest's
                        seen = seen_map.get(k)
                        if seen is None:
                            st.covered += 1
                            seen_map[k] = {digest}
                            while len(seen_map) > window:
                                seen_map.popitem(last=False)
                            st.events += 1
                            yield _new_event(*p, True, item.rx if item.carried else None)
                            continue
                        if digest in seen:  # a copy of a line seen (journald's)
                            st.covered += 1
                            st.duplicates += 1
                            continue
                        item._ev, item._owned = _new_event(*p), True  # a conflict: _settle
                got = self._settle(item)
                if got is None:
                    continue
                ev = got
            else:
                ev = item
            if self._is_duplicate(ev):
                st.duplicates += 1
                continue
            st.events += 1
            if not ev.covered and ev.boot != last_boot:
                last_boot = ev.boot
                self._boots[ev.boot] = None
                self._boots.move_to_end(ev.boot)
                while len(self._boots) > self.MAX_BOOTS:
                    self._boots.popitem(last=False)
            yield ev

    def _settle(self, c: _Cand) -> Event | None:
        """A candidate's outcome after phase B: its event, or None (forged, unchecked, a
        covered line that conflicts with an earlier one and could not be verified)."""
        if c.state in (_Cand.COVERED, _Cand.OK, _Cand.FORGED) and c.ev is None:
            c.state = _Cand.SYNTAX  # intact but not a line: decode_line's syntax reject
        if c.state == _Cand.SYNTAX:
            self._reject(Rejected(Reject.SYNTAX, c.ln))
            return None
        ev = c.ev if c.state in (_Cand.COVERED, _Cand.OK, _Cand.FORGED) else None
        if c.state == _Cand.COVERED and ev is not None:
            seen = self._seen.get((c.boot, c.seq))
            if seen is not None and _digest(ev) not in seen:  # a conflict: verify or drop
                c.state = _Cand.NEW
                self._resolve(c)
            else:
                self.stats.covered += 1
                if c.owned:  # parsed for this candidate alone: flag it in place (fast)
                    object.__setattr__(ev, "covered", True)
                    object.__setattr__(ev, "rx", c.rx if c.carried else None)
                    return ev
                return replace(ev, covered=True, rx=c.rx if c.carried else None)
        if c.state == _Cand.OK and ev is not None:
            return replace(ev, rx=c.rx) if c.carried else ev
        if c.state == _Cand.FORGED:
            self._forged(Forged(Forgery.BAD_SIG, c.ln, ev))
            return None
        if c.state == _Cand.FULL:  # off the plain path after all: the whole rule set
            try:
                ev = self._full(c.ln)
            except _Unchecked:
                c.state = _Cand.UNCHECKED
            else:
                return replace(ev, rx=c.rx) if ev is not None and c.carried else ev
        self._defer(c.ln, (c.boot, c.seq, c.kind), c.rx)
        return None

    def _resolve(self, c: _Cand) -> None:
        """Verify one candidate within the budget: OK, FORGED (its Forged kept), FULL (the
        line needs the whole rule set: several markers, a retired key) or UNCHECKED."""
        if self._budget <= 0 and c.body not in self._ok_bodies:  # spent, and no copy of a
            c.state = _Cand.UNCHECKED  # verified line (a copy is free)
            return
        try:
            ok = self._check(c.pin, c.body, _unb64_sig(c.sig))
        except _Unchecked:
            c.state = _Cand.UNCHECKED
            return
        if ok:
            c.state = _Cand.OK
        elif c.simple:
            c.state = _Cand.FORGED
        else:
            c.state = _Cand.FULL

    def _check(self, public: bytes, body: bytes, sig: bytes) -> bool:
        """:func:`verify` within the block's budget: raises :class:`_Unchecked` when it is
        spent. A line identical to one verified in this block (a journald copy) is free."""
        signed = body + sig
        if signed in self._ok:
            return True
        if self._budget <= 0:
            raise _Unchecked
        self._budget -= 1
        self.stats.verified += 1
        if verify(public, body, sig):
            self._ok.add(signed)
            self._ok_bodies.add(body)
            return True
        return False

    def _lazy(self, ln: bytes, carried: bool, rx: float | None) -> _Cand | bool | None:
        """The plain path: the line's first marker is v3 and its first intact trailer holds a
        line of an event other than ``key``/``rekey``, under a pin, signed by the pin (not a
        line from before a rotation). True: the line was an announcement of a key that is not
        the pin (counted as :meth:`_full` counts it). Anything else is None (:meth:`_full`
        decides it)."""
        pin = self.pin
        if pin is None or not self.lazy:
            return None
        chain = self.retired
        if not chain and len(ln) <= MAX_LINE:
            m = _PLAIN_V3.match(ln)
            if m is not None:  # one line, nothing around it: parsed only if it is accepted
                boot, seq, kind_b, sig, crc = m.groups()
                kind = kind_b.decode()
                if kind == REKEY_EVENT or ln.count(MARKER_PREFIX) != 1:
                    return None
                if (zlib.crc32(ln[: m.end(4)]) & 0xFFFFFFFF) != int(crc, 16):
                    return None  # decode_line: a checksum reject
                if kind == KEY_EVENT:  # another key's announcement: unplaced, never checked
                    try:
                        ev = _parse_body(ln[: m.start(4) - 2].decode("ascii"))
                    except UnicodeDecodeError:
                        return None
                    if ev is None or ev.get("pk") == _pk_text(pin):
                        return None
                    self._unplaced_line(Forged(Forgery.UNPLACED, ln, ev))
                    return True
                body = ln[: m.start(4) - 2]
                return _Cand(
                    ln, boot.decode(), int(seq), kind, None, body, sig, pin, True, carried, rx
                )
        m = _MARKER_RE.search(ln)
        if m is None or m.group(1) != b"3":
            return None
        start = m.start()
        intact = False
        for t in _TRAILER_V3.finditer(ln, start, min(len(ln), start + MAX_LINE)):
            if (zlib.crc32(ln[start : t.end(1)]) & 0xFFFFFFFF) != int(t.group(2), 16):
                continue
            intact = True
            body = ln[start : t.start()]
            try:
                ev = _parse_body(body.decode("ascii"))
            except UnicodeDecodeError:
                return None
            if ev is None or ev.event in (KEY_EVENT, REKEY_EVENT):
                return None
            if chain and _signer_of(ev, chain, pin) is not None:
                return None
            simple = not chain and ln.count(MARKER_PREFIX) == 1
            return _Cand(
                ln, ev.boot, ev.seq, ev.event, ev, body, t.group(1), pin, simple, carried, rx
            )
        if not intact and ln.count(MARKER_PREFIX) == 1:  # decode_line's answer, without it
            self._reject(Rejected(Reject.CHECKSUM, ln))
            return True
        return None

    def _defer(self, ln: bytes, ev: tuple[str, int, str] | None, rx: float | None) -> None:
        """A line the budget did not reach: a decisive one (or one not parsed yet) waits in
        the carry-over for the next block (bounded), a routine one too in at most half of it;
        one past the bound is counted as unchecked, by boot (an alarm: Timeline.flood_alarm)."""
        routine = ev is not None and ev[2] in ROUTINE_EVENTS
        if len(self.carry) < (self.MAX_CARRY // 2 if routine else self.MAX_CARRY):
            self.carry.append((ln, rx))
            return
        self.stats.unchecked += 1
        if ev is not None:
            self.unchecked_new.append((ev[0], ev[1], not routine))
        else:
            self.unchecked_new.append(("", 0, True))

    def _full(self, ln: bytes) -> Event | None:
        """One line by the whole of :func:`decode_line` (announcements, rotations, v2, lines of
        a retired key, anything the lazy path does not take), in stream order; its signature
        checks go through the block's budget (:meth:`_check` may raise :class:`_Unchecked`)."""
        res = decode_line(ln, self.key, self.pin, self.retired, self._check)
        if isinstance(res, Event) and res.event == REKEY_EVENT:
            self.placeable = False
            got = self._rekey(ln, res)
            if got is None:
                return None
            ev = got
        elif isinstance(res, KeyAnnounce) and res.version == 3:
            got = self._announce(ln, res)
            if got is None:
                return None
            ev = got
        elif isinstance(res, KeyAnnounce):
            self.placeable = False
            if self.key is None or not hmac.compare_digest(self.key, res.key):
                # v2 keys are never pinned from the console any more (anyone can read them
                # back): only a v2 key held from before the upgrade verifies v2 lines.
                self.key_conflict = self.key is not None
                reason = Forgery.KEY_CONFLICT if self.key is not None else Forgery.V2
                self._forged(Forged(reason, ln, res.event))
                return None
            ev = res.event
        elif isinstance(res, Event):
            self.placeable = False
            ev = res
        elif isinstance(res, Forged):
            self._unplaced_line(res)
            return None
        elif isinstance(res, Rejected):
            self._reject(res)
            return None
        else:
            return None
        return ev

    def _unplaced_line(self, res: Forged) -> None:
        """A forged line (decode_line's answer); an unplaced key's fingerprint is noted."""
        self.placeable = False
        if res.reason == Forgery.UNPLACED and res.event is not None:
            pk = res.event.get("pk") or ""
            if len(self.unplaced) < self.MAX_UNPLACED and _PK_RE.match(pk):
                fp = pk_fingerprint(unb64(pk))
                if fp not in self.unplaced:
                    self.unplaced.append(fp)
        self._forged(res)

    def _reject(self, res: Rejected) -> None:
        st = self.stats
        st.rejected += 1
        st.reject_reasons[res.reason] = st.reject_reasons.get(res.reason, 0) + 1
        if len(self.rejects) < self.MAX_SAMPLES:
            self.rejects.append(res)

    def _forged(self, f: Forged) -> None:
        st = self.stats
        if f.reason == Forgery.RETIRED:  # the rotated-away key's older lines: not an alarm
            st.retired += 1
            return
        st.forged += 1
        st.forged_reasons[f.reason] = st.forged_reasons.get(f.reason, 0) + 1
        if len(self.forgeries) < self.MAX_SAMPLES:
            self.forgeries.append(f)

    def _is_duplicate(self, ev: Event) -> bool:
        digest = _digest(ev)  # the content (boot, seq: k)
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


def decode_all(
    data: bytes, key: bytes | None = None, pin: bytes | None = None
) -> tuple[list[Event], DecodeStats]:
    """Decode a whole dump at once, read from byte 0 (its first announcement is pinned when
    ``pin`` is None)."""
    d = StreamDecoder(key, pin=pin)
    events = d.feed(data)
    events += d.flush()
    return events, d.stats
