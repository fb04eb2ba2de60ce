"""The stream decoder: console bytes in arbitrary chunks in, authenticated events out, with
lazy, bounded signature checks (docs/serial-protocol.md, "Verifying what decides").
"""

from __future__ import annotations

import binascii
import hmac
import operator
import re
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace

from gce_watchdog.wire.console import (
    _MARKER_RE,
    _TRAILER_V3,
    decode_line,
)
from gce_watchdog.wire.keys import (
    MAX_RETIRED,
    Retired,
    Retirees,
    _pk_text,
    _retirees,
    _signer_of,
    parse_rekey,
    shown_rekey,
)
from gce_watchdog.wire.line import (
    _PK_RE,
    KEY_EVENT,
    MARKER_PREFIX,
    MAX_LINE,
    PIN_MAX_SEQ,
    REKEY_EVENT,
    ROUTINE_EVENTS,
    Event,
    Forged,
    Forgery,
    KeyAnnounce,
    Reject,
    Rejected,
    _new_event,
    _parse_body,
    _parse_parts,
    pk_fingerprint,
    unb64,
    verify,
)

# A whole plain line (from its marker, one marker, nothing after the trailer, no ``#`` before it):
# its boot, seq, event name, signature and CRC without parsing the rest (_Cand.ev does that).
_PLAIN_V3 = re.compile(
    rb"GCEWD3 ([0-9a-f]{8}) (0|[1-9][0-9]{0,18}) [^ #]+ ([a-z][a-z0-9_]{0,23})(?: [^#]*)?"
    rb" #([A-Za-z0-9_-]{86})([0-9a-f]{8})\Z"
)
# One match per console line that carries a marker: from its first marker to the line's end.
_MARKER_LINE_RE = re.compile(rb"GCEWD[123][^\n]*")
# Of those (joined by LF), the ones with " #" after the marker: only these can be intact.
_TRAILER_LINE_RE = re.compile(rb"^GCEWD[123][^\n]* #[^\n]*", re.MULTILINE)


class _Unchecked(Exception):
    """The block's verification budget is spent (StreamDecoder._check)."""


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

    def covered_event(self) -> Event | None:
        """The line as a covered event (flagged; its receive time when it was carried over),
        built from the parse in one step; None when it does not parse."""
        rx = self.rx if self.carried else None
        e = self._ev
        if e is not None:
            return _new_event(e.event, e.boot, e.seq, e.ts_ms, e.fields, e.text, True, rx)
        try:
            p = _parse_parts(self.body.decode("ascii"))
        except UnicodeDecodeError:
            return None
        return None if p is None else _new_event(*p, True, rx)


# Phase B's sort keys, C-level (StreamDecoder._decode_lines): carried first, then by boot and seq.
_SORT_KEY = operator.attrgetter("late", "boot", "seq")
_SEQ = operator.attrgetter("seq")


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

    def add(self, other: DecodeStats) -> None:
        """Add ``other``'s counts (a block's) to these."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, f.name, mine + theirs)


@dataclass
class Decoded:
    """What one block of the stream held (:meth:`StreamDecoder.decode`): its authenticated
    events in stream order, its counts, samples of its rejected and forged lines (at most
    ``StreamDecoder.MAX_SAMPLES`` each) and the lines the signature budget never reached and
    the carry-over could not hold: (boot, seq, decisive), boot "" when the line was not parsed
    (an announcement, a rotation, a line off the plain path)."""

    events: list[Event] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    rejects: list[Rejected] = field(default_factory=list)
    forgeries: list[Forged] = field(default_factory=list)
    unchecked: list[tuple[str, int, bool]] = field(default_factory=list)


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
        self.stats = DecodeStats()  # every block's counts, added up
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
        # What feed() and flush() found, kept for a caller that reads a whole stream (decode()
        # and finish() return it instead): rejected and forged samples (bounded), lines never
        # checked (see Decoded.unchecked).
        self.rejects: list[Rejected] = []
        self.forgeries: list[Forged] = []
        self._now = Decoded()  # the block being decoded
        self._budget = 0
        self._block_bytes = 0
        self._ok: set[bytes] = set()  # lines verified in this block (signed bytes)
        self._ok_bodies: set[bytes] = set()  # and their bodies
        # Decisive lines waiting for a budget (raw, stream order), with their block's receive time.
        self.carry: list[tuple[bytes, float | None]] = []
        self._rx: float | None = None
        self.lazy = True  # False: every line verified, no budget (a reference; tests, tools)
        self.unchecked_new: list[tuple[str, int, bool]] = []
        self._boots: OrderedDict[str, None] = OrderedDict()

    def lost_before(self) -> None:
        """Bytes were lost (the API's window moved on): nothing later can be placed."""
        self.placeable = False

    def decode(self, chunk: bytes, rx: float | None = None) -> Decoded:
        """Decode a chunk of the stream (any boundary): what its whole lines held (a partial
        last line is held for the next chunk). ``rx``: when the chunk was received (the
        reader's clock), kept with the lines that wait in the carry-over (their events carry
        it, :attr:`Event.rx`). The block's counts are added to :attr:`stats` too."""
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

    def finish(self, rx: float | None = None) -> Decoded:
        """Decode the held partial line (end of a dump): a truncated last line is rejected."""
        self._rx = rx
        rest, self._pending = self._pending, b""
        if not rest and not self.carry:
            return Decoded()
        return self._decode_block(rest + b"\n" if rest else b"")

    def feed(self, chunk: bytes, rx: float | None = None) -> list[Event]:
        """:meth:`decode`'s events; its samples and unchecked lines are kept on the decoder
        (:attr:`rejects`, :attr:`forgeries`, :attr:`unchecked_new`)."""
        return self._keep(self.decode(chunk, rx))

    def flush(self, rx: float | None = None) -> list[Event]:
        """:meth:`finish`'s events, what else it found kept as :meth:`feed` keeps it."""
        return self._keep(self.finish(rx))

    def _keep(self, found: Decoded) -> list[Event]:
        self.rejects += found.rejects[: max(0, self.MAX_SAMPLES - len(self.rejects))]
        self.forgeries += found.forgeries[: max(0, self.MAX_SAMPLES - len(self.forgeries))]
        self.unchecked_new += found.unchecked
        return found.events

    def _decode_block(self, body: bytes, end: int = -1) -> Decoded:
        """:meth:`_scan_block`'s events and counts, the counts added to :attr:`stats`."""
        found = self._now = Decoded()
        found.events = self._scan_block(body, end)
        self.stats.add(found.stats)
        return found

    def _scan_block(self, body: bytes, end: int = -1) -> list[Event]:
        """Whole lines (each ended by LF): ``body[:end]`` (``end`` -1: all of it, which then
        ends with LF or is empty; else ``body[end:]`` is the held partial line, not empty and
        without LF, left out of every count and scan). The scan is C-level: the lines with a
        marker, from their first marker on (``_MARKER_LINE_RE``), and of those the ones with a
        trailer candidate after it (a substring test, or ``_TRAILER_LINE_RE`` for many short
        ones); only those are decoded one by one. A marker line without one cannot be intact:
        rejected, counted in bulk (nothing about it depends on its place in the stream). So a
        MiB of short hostile lines costs a few regex scans."""
        st = self._now.stats
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
            room = self.MAX_SAMPLES - len(self._now.rejects)
            if room > 0:
                samples = (x for x in full[: 2 * self.MAX_SAMPLES] if b" #" not in x)
                self._now.rejects.extend(
                    Rejected(Reject.CHECKSUM, x) for _, x in zip(range(room), samples, strict=False)
                )
        return self._decode_lines(cands)

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
        self._budget = self.BUDGET_LINES + self._block_bytes // self.BUDGET_BYTES
        if not self.lazy:
            self._budget = 1 << 62
        self._ok = set()
        self._ok_bodies = set()
        out, decisive, routine, top = self._read_lines(lines)
        if decisive or routine:  # intact lines: the stream's first line is behind us
            self.placeable = False
        self._verify(decisive, routine, top)
        self._cover(out, routine, top)
        return self._settle_all(out)

    def _read_lines(
        self, lines: list[bytes]
    ) -> tuple[list[Event | _Cand | None], list[_Cand], dict[str, list[_Cand]], dict[str, int]]:
        """Phase A: the carried-over lines, then ``lines``: each line's event or candidate (None:
        nothing, or counted), the decisive candidates and the routine ones by boot, in stream
        order, and per boot the highest seq verified here."""
        carried, self.carry = self.carry, []
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
            if isinstance(cand, _Cand):
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
                self._defer(ln, None, rx)
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
        if len({c.boot in known for c in decisive}) <= 1:
            decisive.sort(key=_SORT_KEY)
        else:
            decisive.sort(key=lambda c: (c.late, c.boot not in known, c.boot, c.seq))
        for c in decisive:
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
                if c.seq == high or len(claims[(boot, c.seq)]) > 1:
                    self._resolve(c)  # a copy of a verified line (free) or a conflict
                if c.state == _Cand.NEW:
                    c.state = _Cand.COVERED if c.seq < high else _Cand.UNCHECKED

    def _settle_all(self, out: list[Event | _Cand | None]) -> list[Event]:
        """Phase C: the block's events in stream order, copies dropped (:meth:`_is_duplicate`;
        a covered one's in :meth:`_covered`), each verified line's boot noted as known."""
        events: list[Event] = []
        st, last_boot, covered = self._now.stats, "", _Cand.COVERED
        for item in out:
            if item is None:
                continue
            if isinstance(item, _Cand):
                got = self._covered(item) if item.state == covered else self._settle(item)
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
        ev = c.covered_event()
        if ev is None:
            self._reject(Rejected(Reject.SYNTAX, c.ln))  # intact but not a line
            return None
        k = (c.boot, c.seq)
        seen = self._seen.get(k)
        digest = _digest(ev)
        if seen is not None and digest not in seen:
            c.state = _Cand.NEW
            self._resolve(c)
            return self._settle(c)
        self._now.stats.covered += 1
        if seen is not None:  # a copy of a line seen (journald's)
            self._now.stats.duplicates += 1
            return None
        self._remember(k, digest)
        self._now.stats.events += 1
        return ev

    def _settle(self, c: _Cand) -> Event | None:
        """A candidate's outcome after phase B, but for a covered one (:meth:`_covered`): its
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
        self._now.stats.verified += 1
        if verify(public, body, sig):
            self._ok.add(signed)
            self._ok_bodies.add(body)
            return True
        return False

    def _lazy(self, ln: bytes, carried: bool, rx: float | None) -> _Cand | bool | None:
        """The plain path: the line's first marker is v3 and its first intact trailer holds a
        line of an event other than ``key``/``rekey``, under a pin, signed by the pin (not a
        line from before a rotation). True: the line was counted here, as :meth:`_full` would
        count it (a checksum reject; an announcement of a key that is not the pin). Anything
        else is None (:meth:`_full` decides it). The flood's per-line cost: one regex match
        and a CRC for a plain line (one marker, nothing around it)."""
        pin = self.pin
        if pin is None or not self.lazy:
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
                return _Cand(
                    ln, boot.decode(), int(seq), kind_b.decode(), None, ln[: n - 96], sig, pin,
                    True, carried, rx,
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

    def _defer(self, ln: bytes, ev: tuple[str, int, str] | None, rx: float | None) -> None:
        """A line the budget did not reach: a decisive one (or one not parsed yet) waits in
        the carry-over for the next block (bounded), a routine one too in at most half of it;
        one past the bound is counted as unchecked, by boot (an alarm: Timeline.flood_alarm)."""
        routine = ev is not None and ev[2] in ROUTINE_EVENTS
        if len(self.carry) < (self.MAX_CARRY // 2 if routine else self.MAX_CARRY):
            self.carry.append((ln, rx))
            return
        self._now.stats.unchecked += 1
        if ev is not None:
            self._now.unchecked.append((ev[0], ev[1], not routine))
        else:
            self._now.unchecked.append(("", 0, True))

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
        found = self._now
        found.stats.rejected += 1
        found.stats.reject_reasons[res.reason] = found.stats.reject_reasons.get(res.reason, 0) + 1
        if len(found.rejects) < self.MAX_SAMPLES:
            found.rejects.append(res)

    def _forged(self, f: Forged) -> None:
        found = self._now
        st = found.stats
        if f.reason == Forgery.RETIRED:  # the rotated-away key's older lines: not an alarm
            st.retired += 1
            return
        st.forged += 1
        st.forged_reasons[f.reason] = st.forged_reasons.get(f.reason, 0) + 1
        if len(found.forgeries) < self.MAX_SAMPLES:
            found.forgeries.append(f)

    def _is_duplicate(self, ev: Event) -> bool:
        """Whether ``ev`` is a copy of a line seen (boot, seq and content); a different line
        with a (boot, seq) already seen is kept, and counted as a conflict."""
        k, digest = (ev.boot, ev.seq), _digest(ev)
        seen = self._seen.get(k)
        if seen is None:
            self._remember(k, digest)
            return False
        if digest in seen:
            return True
        self._now.stats.conflicts += 1
        seen.add(digest)
        self._seen.move_to_end(k)
        return False

    def _remember(self, k: tuple[str, int], digest: int) -> None:
        """A (boot, seq) first seen, with its content, in the bounded window."""
        self._seen[k] = {digest}
        while len(self._seen) > self.DEDUP_WINDOW:
            self._seen.popitem(last=False)


def decode_all(
    data: bytes, key: bytes | None = None, pin: bytes | None = None
) -> tuple[list[Event], DecodeStats]:
    """Decode a whole dump at once, read from byte 0 (its first announcement is pinned when
    ``pin`` is None)."""
    d = StreamDecoder(key, pin=pin)
    events = d.decode(data).events
    events += d.finish().events
    return events, d.stats
