"""Verifying what decides: one block of a stream's lines, signatures checked lazily within a
budget (docs/serial-protocol.md, "Verifying what decides").

:class:`LazyBlocks` is the part of :class:`wire.stream.StreamDecoder` that decodes a block: the
plain lines under the pin become candidates, the decisive ones are verified first, a boot's
newest routine line covers the older ones, what the budget does not reach waits in the
carry-over. The stream (chunks, pins, rotations, the whole rule set of one line) is the rest.
"""

from __future__ import annotations

import binascii
import operator
import re
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from gce_watchdog.wire.console import _MARKER_RE, _TRAILER_V3
from gce_watchdog.wire.keys import Retirees, _pk_text, _signer_of
from gce_watchdog.wire.line import (
    KEY_EVENT,
    MARKER_PREFIX,
    MAX_LINE,
    REKEY_EVENT,
    ROUTINE_EVENTS,
    Event,
    Forged,
    Forgery,
    Reject,
    Rejected,
    _new_event,
    _parse_body,
    _parse_parts,
    verify,
)

# A whole plain line (from its marker, one marker, nothing after the trailer, no ``#`` before it):
# its boot, seq, event name, signature and CRC without parsing the rest (_Cand.ev does that).
_PLAIN_V3 = re.compile(
    rb"GCEWD3 ([0-9a-f]{8}) (0|[1-9][0-9]{0,18}) [^ #]+ ([a-z][a-z0-9_]{0,23})(?: [^#]*)?"
    rb" #([A-Za-z0-9_-]{86})([0-9a-f]{8})\Z"
)


class _Unchecked(Exception):
    """The block's verification budget is spent (LazyBlocks._check)."""


class _Cand:
    """A plain v3 line under the pin whose signature is not checked yet (StreamDecoder).

    ``boot``, ``seq`` and ``kind`` come from the line's head; the whole line is parsed
    (:attr:`ev`) only when it is accepted or shown as forged: a line the budget never reaches
    costs one regex match and a CRC. ``sig`` is the signature's base64url text."""

    NEW, OK, FORGED, FULL, COVERED, UNCHECKED, SYNTAX = range(7)
    __slots__ = (
        "_ev", "body", "boot", "carried", "kind", "late", "ln", "pin", "rx", "seq", "sig", "simple",
        "state",
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

    @property
    def ev(self) -> Event | None:
        """The parsed line (None: it does not parse, a syntax reject like decode_line's)."""
        if self._ev is None:
            try:
                self._ev = _parse_body(self.body.decode("ascii"))
            except UnicodeDecodeError:
                return None
        return self._ev

    def parts(self) -> tuple[str, str, int, int, tuple[tuple[str, str], ...], str] | None:
        """The line's (event, boot, seq, ts_ms, fields, text), from the parse when it was made;
        None when it does not parse (a covered line's event is built from them in one step,
        once it is known not to be a copy: :meth:`LazyBlocks._covered`)."""
        e = self._ev
        if e is not None:
            return e.event, e.boot, e.seq, e.ts_ms, e.fields, e.text
        try:
            return _parse_parts(self.body.decode("ascii"))
        except UnicodeDecodeError:
            return None


# Phase B's sort keys, C-level (LazyBlocks._verify): carried first, then by boot and seq.
_SORT_KEY = operator.attrgetter("late", "boot", "seq")

_SEQ = operator.attrgetter("seq")

_B64_STD = bytes.maketrans(b"-_", b"+/")


def _name(names: dict[bytes, str], raw: bytes) -> str:
    text = names[raw] = raw.decode()
    return text


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

    def add(self, other: DecodeStats) -> None:
        """Add ``other``'s counts (a block's) to these: twice per block read (the decoder's
        and the timeline's sums), so without :func:`dataclasses.fields` each time (it was 4 %
        of a 64 MiB ``parse`` read in 64 KiB blocks)."""
        mine, theirs = self.__dict__, other.__dict__
        for name in _COUNTS:
            mine[name] += theirs[name]
        for name in _REASONS:
            if add := theirs[name]:
                into = mine[name]
                for k, v in add.items():
                    into[k] = into.get(k, 0) + v


# DecodeStats' fields: the counts and the counts by reason (add() sums them, in this order)
_COUNTS = tuple(f.name for f in fields(DecodeStats) if f.type == "int")
_REASONS = tuple(f.name for f in fields(DecodeStats) if f.name not in _COUNTS)


@dataclass
class Decoded:
    """What one block of the stream held (:meth:`StreamDecoder.decode`): its authenticated
    events in stream order, its counts, samples of its rejected and forged lines (the
    stream's first ``StreamDecoder.MAX_SAMPLES`` of each, in all blocks together) and the
    lines the signature budget never reached and the carry-over could not hold: (boot, seq,
    decisive), boot "" when the line was not parsed (an announcement, a rotation, a line off
    the plain path)."""

    events: list[Event] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    rejects: list[Rejected] = field(default_factory=list)
    forgeries: list[Forged] = field(default_factory=list)
    unchecked: list[tuple[str, int, bool]] = field(default_factory=list)


class LazyBlocks:
    """A block's lines decoded lazily (:meth:`_decode_lines`); the state it reads and the two
    rules it takes from the stream (:meth:`_full`, :meth:`_unplaced_line`) are
    :class:`wire.stream.StreamDecoder`'s."""

    # Copies of a line (journald forwarding) arrive within seconds of it: the last 4096 distinct
    # lines (hours of agent output) are remembered, by arrival, whatever their seq.
    DEDUP_WINDOW = 4096
    MAX_SAMPLES = 1000  # rejected/forged raw lines kept for reports (per stream, each)
    # Signatures checked per block: a fixed share plus one per BUDGET_BYTES of the block (a
    # MiB: 96 + 128 = 224 checks, ~13 ms at ~59 us each); ours need about one per 32 lines
    # (the announcements) plus the decisive lines plus one per boot.
    BUDGET_LINES = 96
    BUDGET_BYTES = 8192
    # The fixed share is a credit, not a gift per call (issue 38): spent, it refills whole on a
    # new read (a block with another receive time, or an empty block: settle's) and otherwise
    # by one check per CREDIT_BYTES of input (BUDGET_LINES per MiB), so a MiB fed in 4 KiB
    # pieces under one receive time gets what it gets read at once.
    CREDIT_BYTES = (1 << 20) // 96
    # Decisive lines the budget did not reach, carried to the next block (checked first there).
    # Room for every intact line the API's 1 MiB window can hold (~125 bytes each at the least),
    # so a flood delays the lines behind it, never drops them (issue 35; the poller settles a
    # bounded number per read: docs/poller.md, "Per-read budget").
    MAX_CARRY = 16384
    MAX_BOOTS = 64  # boots with a verified line, remembered to order the checks (known first)

    pin: bytes | None
    retired: Retirees
    lazy: bool  # False: every line verified, no budget (a reference; tests, tools)
    placeable: bool
    start_open: bool  # the pin's boot start is not settled: every line by the whole rule set
    carry: list[tuple[bytes, float | None]]
    _now: Decoded  # the block being decoded
    _rx: float | None  # its receive time
    _budget: int  # signature checks left in this block
    _credit: int  # the fixed share left (_grant)
    _credit_acc: int  # bytes toward the next credit
    _share_acc: int  # bytes toward the next byte share
    _share: int  # this block's byte share
    _grant_rx: float | None  # the receive time of the last whole refill
    _fresh: bool  # no block yet: the first one gets the whole credit
    # Samples handed out (rejected, forged), for the whole stream: MAX_SAMPLES each in all, so
    # a flood fed in small pieces does not build a thousand samples per piece.
    _sampled: list[int]
    _ok: set[bytes]  # lines verified in this block (signed bytes)
    _ok_bodies: set[bytes]  # and their bodies
    _names: dict[bytes, str]  # the block's boot ids and event names, decoded once each
    # (boot, seq) -> the content's hash, or the hashes (a set) once a conflict added one: a set
    # per line was a container per line for the garbage collector to walk (issue 38)
    _seen: OrderedDict[tuple[str, int], int | set[int]]
    _boots: OrderedDict[str, None]

    def _full(self, ln: bytes) -> Event | None:
        """One line by the whole rule set (the stream's)."""
        raise NotImplementedError

    def _unplaced_line(self, res: Forged) -> None:
        """A forged line; an unplaced key's fingerprint is noted (the stream's)."""
        raise NotImplementedError

    def _decode_lines(self, lines: list[bytes]) -> list[Event]:
        """Lines that start with a marker and carry a trailer candidate after it, in order.

        Verification is lazy and bounded (docs/serial-protocol.md, "Verifying what decides"):
        phase A (:meth:`_read_lines`) decodes every line in stream order, running
        announcements, rotations and any line off the plain path through :meth:`_full` at once
        (they spend the budget first) and keeping the plain v3 lines under the pin as
        candidates; phase B (:meth:`_verify`) verifies the decisive candidates by (known boot
        first, boot, seq), then walks each boot's routine candidates down from the highest seq
        until one verifies: the routine candidates below the highest verified seq of their boot
        are **covered** (:meth:`_cover`: accepted unchecked, flagged); phase C
        (:meth:`_settle_all`) gives the events in stream order. A candidate the budget does not
        reach is no event: decisive ones wait in :attr:`carry` for the next block, and so do
        routine ones (they are above their boot's newest verified line: its liveness), in at
        most half of it; the rest are counted (:attr:`DecodeStats.unchecked`,
        :attr:`Decoded.unchecked`)."""
        if not self.lazy:
            self._budget = 1 << 62
        self._ok = set()
        self._ok_bodies = set()
        self._names = {}
        out, decisive, routine, top = self._read_lines(lines)
        if decisive or routine:  # intact lines: the stream's first line is behind us
            self.placeable = False
        self._verify(decisive, routine, top)
        self._cover(out, routine, top)
        return self._settle_all(out)

    def _grant(self, nbytes: int, rx: float | None) -> None:
        """A block's budget (:attr:`_budget`): the byte share (one check per ``BUDGET_BYTES``,
        the remainder kept for the next block) plus the fixed share's credit, refilled whole on
        a new read (another receive time than the last refill's, or an empty block) and else
        by one check per ``CREDIT_BYTES``, never above ``BUDGET_LINES``."""
        if nbytes == 0 or self._fresh or (rx is not None and rx != self._grant_rx):
            self._credit, self._fresh = self.BUDGET_LINES, False
            self._grant_rx = rx if rx is not None else self._grant_rx
            if nbytes:  # the whole credit is the first MiB's refill (issue 38): the read's
                # bytes from here, this block's included, refill nothing until a MiB of them
                # has come, so a MiB in pieces gets what it gets read at once (it got 96 more:
                # 320 checks against 224); settle's empty blocks leave the count as it is
                self._credit_acc = nbytes - self.CREDIT_BYTES * self.BUDGET_LINES
        else:
            self._credit_acc += nbytes
            if self._credit_acc > 0:
                more, self._credit_acc = divmod(self._credit_acc, self.CREDIT_BYTES)
                self._credit = min(self.BUDGET_LINES, self._credit + more)
        share, self._share_acc = divmod(self._share_acc + nbytes, self.BUDGET_BYTES)
        self._share = share
        self._budget = self._credit + share

    def _spent(self, budget: int) -> None:
        """After a block: the checks beyond its byte share come out of the credit."""
        used = budget - self._budget
        self._credit = max(0, self._credit - max(0, used - self._share))

    def _read_lines(
        self, lines: list[bytes]
    ) -> tuple[list[Event | _Cand | None], list[_Cand], dict[str, list[_Cand]], dict[str, int]]:
        """Phase A: the carried-over lines, then ``lines``: each line's event or candidate (None:
        nothing, or counted), the decisive candidates and the routine ones by boot, in stream
        order, and per boot the highest seq verified here."""
        carried, self.carry = self.carry, []
        if self._budget < min(len(carried), self.BUDGET_LINES):
            # a piece too small to reach the carry (a flood fed in small pieces): it waits,
            # unread, for a block that can (a new read, settle's empty blocks); re-reading
            # it every piece would cost its whole length per piece
            carried, self.carry = [], carried
        out: list[Event | _Cand | None] = []
        top: dict[str, int] = {}  # boot -> the highest seq verified in this block
        decisive: list[_Cand] = []
        routine: dict[str, list[_Cand]] = {}
        ncarried, block_rx = len(carried), self._rx
        for i, ln in enumerate([x for x, _ in carried] + lines if carried else lines):
            was_carried = i < ncarried
            rx = carried[i][1] if was_carried else block_rx
            cand = self._lazy(ln, was_carried, rx)
            if cand is True:
                continue
            if cand is not None:
                out.append(cand)
                if cand.kind not in ROUTINE_EVENTS:
                    decisive.append(cand)
                elif (group := routine.get(cand.boot)) is None:
                    routine[cand.boot] = [cand]
                else:
                    group.append(cand)
                continue
            try:
                ev = self._full(ln)
            except _Unchecked:
                self._defer(ln, rx)
                continue
            if ev is not None and was_carried:
                ev = replace(ev, rx=rx)
            if ev is not None and ev.event != REKEY_EVENT:
                top[ev.boot] = max(top.get(ev.boot, -1), ev.seq)
            out.append(ev)
        return out, decisive, routine, top

    def _verify(
        self, decisive: list[_Cand], routine: dict[str, list[_Cand]], top: dict[str, int]
    ) -> None:
        """Phase B: the decisive candidates by (carried first, known boot first, boot, seq),
        then each boot's routine ones down from the highest seq until one verifies (or the
        budget is spent); ``top`` gets each boot's highest verified seq."""
        known = self._boots
        # (known first, boot, seq) is (boot, seq) when the boots are all known or all not
        if len({b in known for b in {c.boot for c in decisive}}) <= 1:
            decisive.sort(key=_SORT_KEY)
        else:
            decisive.sort(key=lambda c: (c.late, c.boot not in known, c.boot, c.seq))
        ok_bodies, unchecked = self._ok_bodies, _Cand.UNCHECKED
        for c in decisive:
            if self._budget <= 0 and c.body not in ok_bodies:  # _resolve's first test, inline:
                c.state = unchecked  # a flood's lines past the budget cost no call each
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

    def _cover(
        self, out: list[Event | _Cand | None], routine: dict[str, list[_Cand]], top: dict[str, int]
    ) -> None:
        """The routine candidates left unchecked: covered at or below their boot's highest
        verified seq, unchecked above it. A (boot, seq) among them claimed with two contents in
        this block has each claimant verified (or unchecked), never covered (seqs claimed in
        advance must not pass); one at the verified seq is a copy of that line (free)."""
        keys = {
            (c.boot, c.seq)
            for group in routine.values()
            for c in group
            if c.state == _Cand.NEW and c.seq <= top.get(c.boot, -1)
        }
        claims: dict[tuple[str, int], set[int]] = {}
        if keys and not self._dup_claims(out, routine, keys):
            keys = set()  # every key claimed once: no content to compare (the common case)
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
                    c.state = _Cand.UNCHECKED
                    continue
                if c.seq == high or (keys and len(claims[(boot, c.seq)]) > 1):
                    self._resolve(c)  # a copy of a verified line (free) or a conflict
                if c.state == _Cand.NEW:
                    c.state = _Cand.COVERED if c.seq < high else _Cand.UNCHECKED

    @staticmethod
    def _dup_claims(
        out: list[Event | _Cand | None],
        routine: dict[str, list[_Cand]],
        keys: set[tuple[str, int]],
    ) -> bool:
        """Whether a (boot, seq) of ``keys`` may be claimed twice in the block: two routine
        candidates of a boot with one seq, or a decisive line or an event with one of them. A
        cheap test on seqs (no content hashed) that lets :meth:`_cover` skip the claims."""
        if any(len({c.seq for c in g}) != len(g) for g in routine.values()):
            return True
        others = {
            (x.boot, x.seq)
            for x in out
            if x is not None and (type(x) is not _Cand or x.kind not in ROUTINE_EVENTS)
        }
        return not others.isdisjoint(keys)

    def _settle_all(self, out: list[Event | _Cand | None]) -> list[Event]:
        """Phase C: the block's events in stream order, copies dropped (:meth:`_is_duplicate`;
        a covered one's in :meth:`_covered`), each verified line's boot noted as known."""
        events: list[Event] = []
        st, last_boot = self._now.stats, ""
        covered, unchecked = _Cand.COVERED, _Cand.UNCHECKED
        # _defer's bound for every line (a routine one's is half): checked inline
        carry, room = self.carry, self.MAX_CARRY // 2
        for item in out:
            if item is None:
                continue
            if isinstance(item, _Cand):
                state = item.state
                if state == unchecked:  # the budget did not reach it (a flood's many lines)
                    if len(carry) < room:  # room for any line (a routine one's bound), inline
                        carry.append((item.ln, item.rx))
                    else:
                        self._defer(item.ln, item.rx, item.boot, item.seq, item.kind)
                    continue
                got = self._covered(item) if state == covered else self._settle(item)
                if got is None:
                    continue
                if got.covered:  # counted and deduplicated by _covered
                    events.append(got)
                    continue
                ev = got
            else:
                ev = item
            if self._is_duplicate(ev):
                st.duplicates += 1
                continue
            st.events += 1
            if ev.boot != last_boot:
                last_boot = ev.boot
                self._boots[ev.boot] = None
                self._boots.move_to_end(ev.boot)
                while len(self._boots) > self.MAX_BOOTS:
                    self._boots.popitem(last=False)
            events.append(ev)
        return events

    def _covered(self, c: _Cand) -> Event | None:
        """A covered candidate's event (flagged), or None: a syntax reject, or a copy of a line
        seen (counted). One whose (boot, seq) was seen with other content is a conflict:
        verified within the budget, or dropped (:meth:`_settle`)."""
        p = c.parts()
        if p is None:
            self._reject(Rejected(Reject.SYNTAX, c.ln))  # intact but not a line
            return None
        k = (c.boot, c.seq)
        window = self._seen
        seen = window.get(k)
        digest = hash((p[0], p[3], p[4], p[5]))  # _digest of its event, before it is built
        if seen is not None and not (seen == digest if isinstance(seen, int) else digest in seen):
            c.state = _Cand.NEW
            self._resolve(c)
            return self._settle(c)
        st = self._now.stats
        st.covered += 1
        if seen is not None:  # a copy of a line seen (journald's): no event built
            st.duplicates += 1
            return None
        window[k] = digest  # _remember's, inline (one per covered line)
        if len(window) > self.DEDUP_WINDOW:
            window.popitem(last=False)
        st.events += 1
        return _new_event(*p, True, c.rx if c.carried else None)

    def _settle(self, c: _Cand) -> Event | None:
        """A candidate's outcome after phase B (a covered one's is :meth:`_covered`'s): its
        event, or None (forged, unchecked: deferred, not a line)."""
        ev = c.ev if c.state in (_Cand.OK, _Cand.FORGED) else None
        if c.state in (_Cand.OK, _Cand.FORGED) and ev is None:
            c.state = _Cand.SYNTAX  # intact but not a line: decode_line's syntax reject
        if c.state == _Cand.SYNTAX:
            self._reject(Rejected(Reject.SYNTAX, c.ln))
            return None
        if c.state == _Cand.OK and ev is not None:
            return replace(ev, rx=c.rx) if c.carried else ev
        if c.state == _Cand.FORGED:
            self._forged(Forged(Forgery.BAD_SIG, c.ln, ev))
            return None
        if c.state == _Cand.FULL:  # off the plain path after all: the whole rule set
            try:
                full = self._full(c.ln)
            except _Unchecked:
                c.state = _Cand.UNCHECKED
            else:
                return replace(full, rx=c.rx) if full is not None and c.carried else full
        self._defer(c.ln, c.rx, c.boot, c.seq, c.kind)
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
        self._now.stats.verified += 1
        if verify(public, body, sig):
            self._ok.add(signed)
            self._ok_bodies.add(body)
            return True
        return False

    def _lazy(self, ln: bytes, carried: bool, rx: float | None) -> _Cand | Literal[True] | None:
        """The plain path: the line's first marker is v3 and its first intact trailer holds a
        line of an event other than ``key``/``rekey``, under a pin, signed by the pin (not a
        line from before a rotation). True: the line was counted here, as :meth:`_full` would
        count it (a checksum reject; an announcement of a key that is not the pin). Anything
        else is None (:meth:`_full` decides it). The flood's per-line cost: one regex match
        and a CRC for a plain line (one marker, nothing around it)."""
        pin = self.pin
        if pin is None or not self.lazy or self.start_open:
            return None
        chain = self.retired
        n = len(ln)
        if not chain and n <= MAX_LINE and (m := _PLAIN_V3.match(ln)) is not None:
            boot, seq, kind_b, sig, crc = m.groups()
            if kind_b == b"rekey" or ln.count(MARKER_PREFIX) != 1:
                return None
            # anchored at the end: crc = ln[n-8:], sig = ln[n-94:n-8], body = ln[:n-96]
            if (zlib.crc32(ln[: n - 8]) & 0xFFFFFFFF) != int(crc, 16):
                self._reject(Rejected(Reject.CHECKSUM, ln))  # decode_line's answer
                return True
            if kind_b != b"key":
                names = self._names
                return _Cand(
                    ln, names.get(boot) or _name(names, boot), int(seq),
                    names.get(kind_b) or _name(names, kind_b), None, ln[: n - 96], sig, pin, True,
                    carried, rx,
                )  # fmt: skip
            try:  # another key's announcement: unplaced, never checked
                ev = _parse_body(ln[: n - 96].decode("ascii"))
            except UnicodeDecodeError:
                return None
            if ev is None or ev.get("pk") == _pk_text(pin):
                return None
            self._unplaced_line(Forged(Forgery.UNPLACED, ln, ev))
            return True
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

    def _defer(
        self, ln: bytes, rx: float | None, boot: str = "", seq: int = 0, kind: str = ""
    ) -> None:
        """A line the budget did not reach: a decisive one (or one not parsed yet: no ``kind``)
        waits in the carry-over for the next block (bounded), a routine one too in at most half
        of it; one past the bound is counted as unchecked, by boot (an alarm:
        Timeline.flood_alarm)."""
        routine = kind in ROUTINE_EVENTS
        if len(self.carry) < (self.MAX_CARRY // 2 if routine else self.MAX_CARRY):
            self.carry.append((ln, rx))
            return
        found = self._now
        found.stats.unchecked += 1
        found.unchecked.append((boot, seq, not routine))

    def _reject(self, res: Rejected) -> None:
        found = self._now
        found.stats.rejected += 1
        found.stats.reject_reasons[res.reason] = found.stats.reject_reasons.get(res.reason, 0) + 1
        if self._sampled[0] < self.MAX_SAMPLES:
            self._sampled[0] += 1
            found.rejects.append(res)

    def _forged(self, f: Forged) -> None:
        found = self._now
        st = found.stats
        if f.reason == Forgery.RETIRED:  # the rotated-away key's older lines: not an alarm
            st.retired += 1
            return
        st.forged += 1
        st.forged_reasons[f.reason] = st.forged_reasons.get(f.reason, 0) + 1
        if self._sampled[1] < self.MAX_SAMPLES:
            self._sampled[1] += 1
            found.forgeries.append(f)

    def _is_duplicate(self, ev: Event) -> bool:
        """Whether ``ev`` is a copy of a line seen (boot, seq and content); a different line
        with a (boot, seq) already seen is kept, and counted as a conflict."""
        k, digest = (ev.boot, ev.seq), _digest(ev)
        seen = self._seen.get(k)
        if seen is None:
            self._remember(k, digest)
            return False
        if seen == digest if isinstance(seen, int) else digest in seen:
            return True
        self._now.stats.conflicts += 1
        if isinstance(seen, set):
            seen.add(digest)
        else:
            self._seen[k] = {seen, digest}
        self._seen.move_to_end(k)
        return False

    def _remember(self, k: tuple[str, int], digest: int) -> None:
        """A (boot, seq) first seen, with its content, in the bounded window."""
        self._seen[k] = digest
        while len(self._seen) > self.DEDUP_WINDOW:
            self._seen.popitem(last=False)
