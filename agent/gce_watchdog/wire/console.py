"""One console line read: which protocol line it carries (any version) and whether it
authenticates (:func:`decode_line`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gce_watchdog.wire.keys import (
    Retired,
    Retirees,
    _pk_text,
    _retirees,
    _signer_of,
    _v3_announce,
)
from gce_watchdog.wire.legacy import (
    read_legacy,
)
from gce_watchdog.wire.line import (
    KEY_EVENT,
    MARKER_BYTES,
    MAX_LINE,
    REKEY_EVENT,
    Event,
    Forged,
    Forgery,
    KeyAnnounce,
    MarkerRead,
    Reject,
    Rejected,
    _crc,
    _parse_body,
    unb64,
    verify,
)

MAX_MARKERS_PER_LINE = 8
_MARKER_RE = re.compile(rb"GCEWD([123])")
# v3: " #" + 86 base64url (the Ed25519 signature of the body) + 8 hex (CRC-32 of everything from
# the marker through the signature: damage anywhere in the line, the signature included, is a
# checksum reject, never a forgery).
_TRAILER_V3 = re.compile(rb" #([A-Za-z0-9_-]{86})([0-9a-f]{8})")


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
        version = int(m.group(1))
        if version == 3:
            done, bad, unparsed = _read_v3(raw, m.start(), pin, chain, verifier)
        else:
            done, bad, unparsed = read_legacy(raw, m.start(), version == 2, key, pin)
        if done is not None:
            return done
        forged = forged or bad
        syntax = syntax or unparsed
    if forged is not None:
        return forged
    if tried == 0:
        return None
    return Rejected(Reject.SYNTAX if syntax else Reject.CHECKSUM, raw)


def _read_v3(
    raw: bytes,
    start: int,
    pin: bytes | None,
    chain: Retirees,
    verifier: Callable[[bytes, bytes, bytes], bool],
) -> MarkerRead:
    """The v3 line at the marker at ``start`` (:data:`MarkerRead`): its first intact trailer
    within MAX_LINE bytes decides, a trailer whose body does not parse is a syntax reject."""
    syntax = False
    for t in _TRAILER_V3.finditer(raw, start, min(len(raw), start + MAX_LINE)):
        if _crc(raw[start : t.end(1)]) != t.group(2).decode():
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
                    return Forged(Forgery.RETIRED, raw, ev), None, syntax
                ann = _v3_announce(ev, body, sig)
                if ann is not None and ann.valid(verifier):
                    return ann.event, None, syntax
                return Forged(Forgery.BAD_SIG, raw, ev), None, syntax
            # another key than the pin: unplaced, whatever its signature (not checked)
            return Forged(Forgery.UNPLACED, raw, ev), None, syntax
        if ev.event == KEY_EVENT:
            ann = _v3_announce(ev, body, sig)
            if ann is not None:
                return ann, None, syntax
        if pin is None:
            return None, Forged(Forgery.NO_KEY, raw, ev), syntax
        if verifier(pin, body, sig):
            return ev, None, syntax
        signer = _signer_of(ev, chain, pin) if chain else None
        if signer is not None:  # a line from before a rotation: the key of then
            if verifier(signer[0].public, body, sig):
                return ev, None, syntax
        elif chain and verifier(chain[-1].public, body, sig):
            return None, Forged(Forgery.RETIRED, raw, ev), syntax
        bad = Forgery.BAD_REKEY if ev.event == REKEY_EVENT else Forgery.BAD_SIG
        return None, Forged(bad, raw, ev), syntax
    return None, None, syntax
