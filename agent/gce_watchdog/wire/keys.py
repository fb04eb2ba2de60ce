"""Key lines: announcements, rotations (``rekey``) and the keys rotations retired.

The announcement and rotation lines are v3 lines (wire/line.py) whose fields carry a public
key; this module builds them and reads them back. docs/serial-protocol.md specifies them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from gce_watchdog.wire.line import (
    _PK_RE,
    ANNOUNCE_EVERY,
    KEY_EVENT,
    MAX_LINE,
    PIN_MAX_SEQ,
    PK_BYTES,
    REKEY_EVENT,
    Event,
    KeyAnnounce,
    LineKey,
    ProtocolError,
    b64,
    encode,
    line_length,
    pk_fingerprint,
    sanitize_value,
    unb64,
)

# The boot counter ``bc`` (docs/serial-protocol.md, "Boot counter"): 1..999999999999 without
# leading zeros, or ``-`` (the writer has no counter); ``bid``: the full kernel boot id.
BC_FIELD = "bc"
BID_FIELD = "bid"
_COUNTER_RE = re.compile(r"[1-9][0-9]{0,11}\Z")
_BID_RE = re.compile(r"[0-9a-f]{32}\Z")


def bc_counter(value: str | None) -> int | None:
    """A ``bc`` value as a counter: ``1``..``999999999999``, no leading zeros; None for ``-``,
    an absent field or anything else (never trusted as a number). The one check of a counter's
    form: the writer's (:func:`valid_bc`, the boot counter's cache) and every reader's."""
    if value is None or not _COUNTER_RE.match(value):
        return None
    return int(value)


def valid_bc(value: str) -> bool:
    """Whether ``value`` is a ``bc`` field's value: a counter or ``-``."""
    return value == "-" or bc_counter(value) is not None


def valid_bid(value: str) -> bool:
    """Whether ``value`` is a ``bid`` field's value: a full kernel boot id, 32 lowercase hex
    digits (the announcement's, and the boot counter's file)."""
    return bool(_BID_RE.match(value))


def _bc_fields(bc: str | None) -> tuple[tuple[str, str], ...]:
    if bc is None:
        return ()
    if not valid_bc(bc):
        raise ProtocolError(f"bad boot counter {bc!r}")
    return ((BC_FIELD, bc),)


def announce_event(
    boot: str,
    seq: int,
    ts_ms: int,
    key: LineKey,
    inst: str = "-",
    bc: str | None = None,
    bid: str | None = None,
) -> Event:
    """The v3 announcement: the public key, the instance id (``-``: not known yet), for a key
    that could not be kept ``eph=1``, the boot counter ``bc`` and the full boot id ``bid``;
    signed with the key it announces, so the key is bound to this boot and this instance (a
    line cannot be relabelled to another VM). ``bid`` is left out when the whole of it does not
    fit the line (never shortened: a partial id names no boot); nothing else is ever cut.
    ``bc``/``bid`` None: not written (lines of writers from before the counter, test kits)."""
    fields: tuple[tuple[str, str], ...] = (("pk", b64(key.public)), ("inst", sanitize_value(inst)))
    if key.ephemeral:
        fields += (("eph", "1"),)
    fields += _bc_fields(bc)
    ev = Event(KEY_EVENT, boot, seq, ts_ms, fields)
    if bid is not None:
        if not valid_bid(bid):
            raise ProtocolError(f"bad boot id {bid!r}: want 32 lowercase hex digits")
        with_bid = Event(KEY_EVENT, boot, seq, ts_ms, (*fields, (BID_FIELD, bid)))
        if line_length(with_bid) <= MAX_LINE:
            return with_bid
    return ev


def key_line(
    boot: str,
    seq: int,
    ts_ms: int,
    key: LineKey,
    inst: str = "-",
    bc: str | None = None,
    bid: str | None = None,
) -> str:
    """The encoded v3 announcement (see :func:`announce_event`)."""
    return encode(announce_event(boot, seq, ts_ms, key, inst, bc, bid), key)


def rekey_event(
    boot: str, seq: int, ts_ms: int, new_public: bytes, inst: str, bc: str | None = None
) -> Event:
    """The rotation line: the new public key, the instance id it is bound to (never ``-``)
    and the boot counter. Signed with the old key (:func:`rekey_line`), so only the holder of
    the pinned key can move the pin; the boot, seq and instance id are signed too (a copy in
    another VM's stream names that other VM)."""
    if len(new_public) != PK_BYTES:
        raise ProtocolError(f"a public key is {PK_BYTES} bytes")
    if not inst or inst == "-" or sanitize_value(inst) != inst:
        raise ProtocolError(f"a rekey line names the instance id, not {inst!r}")
    fields = (("pk", b64(new_public)), ("inst", inst), *_bc_fields(bc))
    return Event(REKEY_EVENT, boot, seq, ts_ms, fields)


def rekey_line(
    boot: str,
    seq: int,
    ts_ms: int,
    old: LineKey,
    new_public: bytes,
    inst: str,
    bc: str | None = None,
) -> str:
    """The encoded rotation line, signed with the ``old`` key (see :func:`rekey_event`)."""
    return encode(rekey_event(boot, seq, ts_ms, new_public, inst, bc), old)


def parse_rekey(ev: Event) -> tuple[bytes, str] | None:
    """(new public key, instance id) of a ``rekey`` event as decoded (its raw ``pk``), or None
    when its fields are not ``pk`` and ``inst`` (an instance id, never ``-``) and optionally a
    valid ``bc``."""
    d = ev.fields_dict
    pk, inst = d.get("pk", ""), d.get("inst", "")
    if ev.event != REKEY_EVENT or set(d) - {BC_FIELD} != {"pk", "inst"} or not _PK_RE.match(pk):
        return None
    if BC_FIELD in d and not valid_bc(d[BC_FIELD]):
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
    bc = ev.get(BC_FIELD)
    if bc is not None:
        shown.append((BC_FIELD, bc))
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


@functools.lru_cache(maxsize=256)
def _pk_text(public: bytes) -> str:
    return b64(public)


_ANNOUNCE_FIELDS = frozenset({"pk", "inst", "eph", BC_FIELD, BID_FIELD})


def _v3_announce(ev: Event, body: bytes, sig: bytes) -> KeyAnnounce | None:
    """A v3 ``key`` line's announcement, or None when it is not one (wrong fields)."""
    d = ev.fields_dict
    pk, inst, eph = d.get("pk", ""), d.get("inst", ""), d.get("eph")
    if not _PK_RE.match(pk) or not inst or set(d) - _ANNOUNCE_FIELDS or eph not in (None, "1"):
        return None
    bc, bid = d.get(BC_FIELD), d.get(BID_FIELD)
    if (bc is not None and not valid_bc(bc)) or (bid is not None and not valid_bid(bid)):
        return None
    public = unb64(pk)
    shown = [("kid", pk_fingerprint(public)), ("inst", inst)] + ([("eph", "1")] if eph else [])
    # the boot counter and the boot id as written: readers order boots by them
    shown += [(k, v) for k, v in ((BC_FIELD, bc), (BID_FIELD, bid)) if v is not None]
    return KeyAnnounce(
        Event(KEY_EVENT, ev.boot, ev.seq, ev.ts_ms, tuple(shown)),
        public,
        3,
        inst,
        eph == "1",
        body,
        sig,
    )
