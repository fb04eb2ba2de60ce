"""The stream decoder: console bytes in arbitrary chunks in, authenticated events out.

The stream's part: line framing across chunks, the pin (placed from the stream, by hand, moved
by a rotation), announcements, one line by the whole rule set (:func:`wire.console.decode_line`)
and the counts. A block's lines are verified lazily within a budget by :class:`wire.lazy.
LazyBlocks` (docs/serial-protocol.md, "Verifying what decides").
"""

from __future__ import annotations

import hmac
import re
from collections import OrderedDict

from gce_watchdog.wire.console import (
    decode_line,
)
from gce_watchdog.wire.keys import (
    MAX_RETIRED,
    Retired,
    Retirees,
    _retirees,
    parse_rekey,
    shown_rekey,
)
from gce_watchdog.wire.lazy import (
    Decoded,
    DecodeStats,
    LazyBlocks,
    _Unchecked,
)
from gce_watchdog.wire.line import (
    _PK_RE,
    MARKER_PREFIX,
    PIN_MAX_SEQ,
    REKEY_EVENT,
    Event,
    Forged,
    Forgery,
    KeyAnnounce,
    Reject,
    Rejected,
    pk_fingerprint,
    unb64,
)

# One match per console line that carries a marker: from its first marker to the line's end.
_MARKER_LINE_RE = re.compile(rb"GCEWD[123][^\n]*")
# Of those (joined by LF), the ones with " #" after the marker: only these can be intact.
_TRAILER_LINE_RE = re.compile(rb"^GCEWD[123][^\n]* #[^\n]*", re.MULTILINE)


def split_lines(data: bytes) -> list[bytes]:
    """Split console bytes at LF, CRLF and a bare CR (a line ending some programs use alone)."""
    if b"\r" not in data:
        return data.split(b"\n")
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")


class StreamDecoder(LazyBlocks):
    """Incremental decoder: feed arbitrary byte chunks, get authenticated events in order.

    ``pin``: the instance's pinned v3 public key (the ledger's), or None. ``pin_fp``: a
    fingerprint pinned by hand (``gce-watchdog pin``): the announced key with that fingerprint
    becomes the pin. ``from_start``: the stream is the port's output from byte 0 (or the export
    from the instance's creation): only then may the stream's first intact line, an announcement
    of seq 0 or 1, be pinned (:attr:`pinned_here`; the caller stores it in the ledger once its
    boot's start is settled, :attr:`start_open` False: another key announced at seq 0 or 1
    before that withdraws it, :attr:`withdrawn`). Any other
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
    MAX_UNPLACED = 16  # fingerprints of unplaced keys kept for the alarm

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
        # A pin placed here whose boot's start is not settled yet: until a line other than an
        # announcement verifies under it, another key announced at seq 0 or 1 withdraws it
        # (the start is contested: no pin, ``no_pin``). The caller stores only a settled pin.
        self.start_open = False
        self.withdrawn: list[str] = []  # fingerprints of pins withdrawn so (the caller's news)
        self._pending = b""
        # (boot, seq) -> the hash of the content seen with it (a set of them after a conflict),
        # in arrival order, bounded.
        self._seen: OrderedDict[tuple[str, int], int | set[int]] = OrderedDict()
        self._now = Decoded()  # the block being decoded
        self._budget = 0
        self._credit = self.BUDGET_LINES
        self._credit_acc = self._share_acc = self._share = 0
        self._grant_rx: float | None = None
        self._fresh = True
        self._sampled = [0, 0]
        self._ok: set[bytes] = set()  # lines verified in this block (signed bytes)
        self._ok_bodies: set[bytes] = set()  # and their bodies
        self._names: dict[bytes, str] = {}
        # Decisive lines waiting for a budget (raw, stream order), with their block's receive time.
        self.carry: list[tuple[bytes, float | None]] = []
        self._rx: float | None = None
        self.lazy = True  # False: every line verified, no budget (a reference; tests, tools)
        # The lines feed() and flush() found never checked (decode() and finish() return them
        # instead, see Decoded.unchecked).
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
        """Decode the held partial line (end of a dump): a truncated last line is rejected.
        Lines waiting in the carry-over are left to the caller's settle (Timeline.settle, with
        its own budget), unless a partial line makes a block anyway."""
        self._rx = rx
        rest, self._pending = self._pending, b""
        if not rest:
            return Decoded()
        return self._decode_block(rest + b"\n" if rest else b"")

    def feed(self, chunk: bytes, rx: float | None = None) -> list[Event]:
        """:meth:`decode`'s events; its unchecked lines are kept on the decoder
        (:attr:`unchecked_new`)."""
        return self._keep(self.decode(chunk, rx))

    def flush(self, rx: float | None = None) -> list[Event]:
        """:meth:`finish`'s events, its unchecked lines kept as :meth:`feed` keeps them."""
        return self._keep(self.finish(rx))

    def _keep(self, found: Decoded) -> list[Event]:
        self.unchecked_new += found.unchecked
        return found.events

    def _decode_block(self, body: bytes, end: int = -1) -> Decoded:
        """:meth:`_scan_block`'s events and counts, the counts added to :attr:`stats`."""
        found = self._now = Decoded()
        self._grant(len(body) if end < 0 else end, self._rx)
        budget = self._budget
        found.events = self._scan_block(body, end)
        if self.lazy:
            self._spent(budget)
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
        # The non-empty lines, counted on the list of lines: C-level, and faster than counting
        # LFs and the overlapping LF pairs with bytes.count (1.8 against 0.7 ms per MiB of a
        # CRLF dump, docs/performance.md, issue 38)
        lines = body.split(b"\n")
        tail = 0 if end < 0 or end == len(body) else 1  # the partial line: one non-empty piece
        if end < 0:
            end = len(body)
        st.lines += len(lines) - lines.count(b"") - tail
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
            room = min(bare, self.MAX_SAMPLES - self._sampled[0])
            if room > 0:
                kept = self._now.rejects
                had = len(kept)
                samples = (x for x in full[: 2 * self.MAX_SAMPLES] if b" #" not in x)
                kept.extend(
                    Rejected(Reject.CHECKSUM, x) for _, x in zip(range(room), samples, strict=False)
                )
                self._sampled[0] += len(kept) - had
        return self._decode_lines(cands)

    def _note_unplaced(self, public: bytes) -> None:
        """An unplaced v3 key's fingerprint, kept for the alarm (at most MAX_UNPLACED)."""
        if len(self.unplaced) < self.MAX_UNPLACED:
            fp = pk_fingerprint(public)
            if fp not in self.unplaced:
                self.unplaced.append(fp)

    def _announce(self, ln: bytes, ann: KeyAnnounce) -> Event | None:
        """Pin or accept a v3 announcement; None when it was counted as forged."""
        other_vm = bool(self.instance_id) and ann.inst not in ("-", self.instance_id)
        if self._contests(ann, other_vm):
            self._withdraw(ln, ann)
            return None
        placeable, self.placeable = self.placeable, False
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
                # from the stream: open until settled; a hand pin's key is the operator's
                self.start_open = self.pin_fp is None
        if self.pin is None or not hmac.compare_digest(self.pin, ann.key):
            self._note_unplaced(ann.key)  # no signature check: it decides nothing
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

    def _contests(self, ann: KeyAnnounce, other_vm: bool) -> bool:
        """Whether ``ann`` contests the start of the boot a pin was just placed from: the pin
        is not settled (:attr:`start_open`) and another key, signed by itself, claims a boot's
        first seqs for this instance. Then neither key can be told for the agent's."""
        if not self.start_open or self.pin is None or other_vm or ann.event.seq > PIN_MAX_SEQ:
            return False
        return not hmac.compare_digest(self.pin, ann.key) and ann.valid(self._check)

    def _withdraw(self, ln: bytes, ann: KeyAnnounce) -> None:
        """The start is contested: the pin placed here is withdrawn (never stored), both keys
        are unplaced and nothing after this can be placed (``no_pin`` until pinned by hand)."""
        assert self.pin is not None
        old = self.pin
        self.withdrawn.append(pk_fingerprint(old))
        self.pin, self.pinned_here, self.start_open, self.placeable = None, False, False, False
        self.ephemeral, self.inst_seen = False, ""
        self._note_unplaced(old)
        self._note_unplaced(ann.key)
        self._forged(Forged(Forgery.UNPLACED, ln, ann.event))

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
            self.start_open = False  # a line of the pin's other than an announcement
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
            self.placeable = self.start_open = False  # the pin's start is settled
            ev = res
        elif isinstance(res, Forged):
            if self.start_open and res.reason == Forgery.UNPLACED:
                # another key's announcement while the pin's start is open: it may contest it
                again = decode_line(ln, None, None, (), self._check)
                if isinstance(again, KeyAnnounce) and again.version == 3:
                    return self._announce(ln, again)
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
                self._note_unplaced(unb64(pk))
        self._forged(res)


def decode_all(
    data: bytes, key: bytes | None = None, pin: bytes | None = None
) -> tuple[list[Event], DecodeStats]:
    """Decode a whole dump at once, read from byte 0 (its first announcement is pinned when
    ``pin`` is None)."""
    d = StreamDecoder(key, pin=pin)
    events = d.decode(data).events
    events += d.finish().events
    return events, d.stats
