"""Protocol v2 (HMAC) and v1 (CRC only): what readers still recognise from before v3.

v2 lines verify under a v2 key held from before the upgrade, only while no v3 pin is held; v1
lines never decide (docs/serial-protocol.md, "Upgrade from v2"). The v2 encoder is kept for the
readers' upgrade path and its tests.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from gce_watchdog.wire.line import (
    KEY_EVENT,
    Event,
    Forged,
    Forgery,
    KeyAnnounce,
    MarkerRead,
    ProtocolError,
    _body,
    _crc,
    _parse_body,
    fingerprint,
)

V2_MARKER = "GCEWD2"  # protocol v2: HMAC lines (see "Upgrade" in docs/serial-protocol.md)
LEGACY_MARKER = "GCEWD1"  # protocol v1: CRC only, unauthenticated; read as forged, never decides
V2_MAX_LINE = 200
MAC_BYTES = 8  # truncated HMAC-SHA256: 64 bits, one forgery in 2**64 tries
KEY_BYTES = 32  # the per-instance secret (256 bits, 64 hex: exactly one field value)
V2_TRAILER_LEN = len(" #") + 8 + 2 * MAC_BYTES  # v2: " #" + crc + mac
_HEXKEY_RE = re.compile(r"[0-9a-f]{64}\Z")
# Trailer candidates: v2 " #" + 24 hex (crc + mac), v1 " #" + 8 hex. We look for every occurrence
# within MAX_LINE bytes of a marker, not only at the end of the console line, so a kernel message
# glued after an intact line does not lose it.
_TRAILER_V2 = re.compile(rb" #([0-9a-f]{8})([0-9a-f]{16})")
_TRAILER_V1 = re.compile(rb" #([0-9a-f]{8})")


def mac(key: bytes, body: bytes) -> str:
    """v2: the truncated HMAC-SHA256 of a line body, 16 lowercase hex."""
    return hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES].hex()


def encode_v2(ev: Event, key: bytes) -> str:
    """A protocol v2 line (HMAC): what a v2 agent writes. Readers' upgrade path and its tests."""
    line = _encode_any_length(ev, key)
    if len(line) > V2_MAX_LINE:
        raise ProtocolError(f"line is {len(line)} bytes, limit {V2_MAX_LINE}")
    return line


def _encode_any_length(ev: Event, key: bytes) -> str:
    if len(key) != KEY_BYTES:
        raise ProtocolError(f"key must be {KEY_BYTES} bytes")
    raw = _body(ev, V2_MARKER).encode()
    return f"{raw.decode()} #{_crc(raw)}{mac(key, raw)}"


def key_line_v2(boot: str, seq: int, ts_ms: int, key: bytes) -> str:
    """The v2 key announcement (a boot's seq 0): signed with the key it announces."""
    return encode_v2(Event(KEY_EVENT, boot, seq, ts_ms, (("k", key.hex()),)), key)


def read_legacy(
    raw: bytes, start: int, v2: bool, key: bytes | None, pin: bytes | None
) -> MarkerRead:
    """The v2 (``v2``) or v1 line at the marker at ``start`` (:data:`MarkerRead`): ``key`` the
    instance's v2 key held from before the upgrade, ``pin`` its v3 pin (v2 lines never decide
    once one is held); a v1 line is always forged."""
    syntax = False
    for t in (_TRAILER_V2 if v2 else _TRAILER_V1).finditer(
        raw, start, min(len(raw), start + V2_MAX_LINE)
    ):
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
            return None, Forged(Forgery.LEGACY, raw, ev), syntax
        if pin is not None:  # this instance speaks v3: its v2 lines never decide again
            return None, Forged(Forgery.V2, raw, ev), syntax
        got = t.group(2).decode()
        if ev.event == KEY_EVENT:
            announced = ev.get("k") or ""
            if _HEXKEY_RE.match(announced) and len(ev.fields) == 1:
                k = bytes.fromhex(announced)
                if hmac.compare_digest(mac(k, body), got):
                    shown = Event(KEY_EVENT, ev.boot, ev.seq, ev.ts_ms, (("kid", fingerprint(k)),))
                    return KeyAnnounce(shown, k), None, syntax
        if key is None:
            return None, Forged(Forgery.V2, raw, ev), syntax
        if hmac.compare_digest(mac(key, body), got):
            return ev, None, syntax
        return None, Forged(Forgery.BAD_MAC, raw, ev), syntax
    return None, None, syntax
