"""A timeline of one VM's serial output: our events, per-boot accounting, what was lost.

The timeline is fed bytes (a whole dump, or the pieces an incremental reader fetches) and keeps:

- the decoded events in stream order (bounded: old routine lines are compacted away, the events
  a verdict depends on are kept, see :meth:`Timeline.compact`);
- per boot: first/last sequence number, lines seen, first/last timestamp; the number of lines
  lost between the agent and the reader is the holes in the seen sequence range;
- sequence gaps (a jump in ``seq`` within a boot) and byte gaps (output the API no longer held);
- rejected lines (the marker without an intact checksum) with a bounded sample.

Decoding is :class:`wire.protocol.StreamDecoder`; this module only does the bookkeeping. The
whole state round-trips through JSON (:meth:`to_json` / :meth:`from_json`) so a restarted poller
resumes with the same accounting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from gce_watchdog.poller.boots import (
    ALARM_BOOT_REGRESSED,
    Order,
    Record,
    Seen,
    parse_counter,
)
from gce_watchdog.poller.boots import order as order_boots
from gce_watchdog.poller.verdict import (
    InstanceState,
    Policy,
    Verdict,
    VerdictKind,
    decide,
    terminal_kind,
)
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import (
    MAX_RETIRED,
    Decoded,
    DecodeStats,
    Event,
    Forgery,
    Retired,
    Retirees,
    StreamDecoder,
    fingerprint,
    pk_fingerprint,
    unb64,
)
from gce_watchdog.wire.protocol import b64 as _b64

# Events a verdict can depend on; they survive compaction (see verdict.py's table).
KEY_EVENTS = vocab.VERDICT_EVENTS
MAX_EVENTS = 4096  # in-memory events before compaction (~10 days of 5-minute heartbeats)
KEEP_KEY_EVENTS = 512  # key events kept per compaction (a boot has a handful)
KEEP_RECENT = 64  # routine events (tick/heartbeat) kept: the latest show rung and liveness
MAX_GAPS = 1000  # gap records kept for the report; totals are always exact
MAX_REJECT_SAMPLES = 20  # rejected raw lines kept for the report
MAX_FORGED_SAMPLES = 20  # forged raw lines kept for the report
# Boots with lines the decoder's signature budget never reached, remembered for the flood alarm
# (docs/serial-protocol.md, "Verifying what decides"); more go to one record for any boot.
MAX_FLOOD_BOOTS = 64
# Signature checks one settle spends on the carry-over before a verdict (~30 ms at 60 us): with
# a block's own budget, the per-read budget (docs/poller.md, "Per-read budget").
SETTLE_CHECKS = 512
# A flood's lines hold a verdict at most one drain timeout from the first of them; a burst
# after this long without one is a new flood (held again).
FLOOD_EPISODE_GAP_S = 3600.0
ANY_BOOT = ""  # the flood record of lines whose boot is not known (not parsed, or past the bound)


@dataclass
class Flood:
    """Lines of one boot that were never verified (the budget ran out): no evidence, an alarm.

    ``min_decisive``: the lowest seq of a decisive one (-1: none); ``max_routine``: the highest
    seq of a routine one (-1: none); ``mark``: how many boots the timeline knew when the last
    of them was counted (a boot first seen later is not affected); ``since`` and ``last``: when
    (the reader's clock) the first and the latest of this flood were received: it holds a
    verdict for one drain timeout from ``since`` at most (a burst more than
    FLOOD_EPISODE_GAP_S after ``last`` starts a new flood)."""

    count: int = 0
    min_decisive: int = -1
    max_routine: int = -1
    mark: int = 0
    since: float | None = None
    last: float | None = None


@dataclass
class BootInfo:
    """What was seen of one boot (one incarnation of the VM)."""

    boot: str
    first_seq: int
    max_seq: int
    count: int  # distinct lines seen
    first_ts_ms: int
    last_ts_ms: int
    order: int  # position of the boot's first line among boots (0 = first seen)
    # On the reader's clock: when the boot's first line, and its newest line (highest seq so
    # far), were received. None: fed without a receive time.
    first_rx: float | None = None
    last_rx: float | None = None
    # last_rx is when the newest line was first *available* to a reader (it arrived after an
    # earlier read of this port or an earlier record in the ledger). False: a reader's first
    # read with no record found it, and it may be hours old (docs/poller.md, "Freshness").
    rx_known: bool = True
    # The boot counter of its verified lines (``bc``; None: ``bc=-`` or an older agent's lines)
    counter: int | None = None

    @property
    def lost(self) -> int:
        """Lines missing inside the seen range [first_seq, max_seq]."""
        return max(0, self.max_seq - self.first_seq + 1 - self.count)


@dataclass(frozen=True)
class SeqGap:
    boot: str
    after: int  # the highest seq seen before the jump
    next: int  # the seq that arrived

    @property
    def missing(self) -> int:
        return self.next - self.after - 1


@dataclass(frozen=True)
class ByteGap:
    requested: int  # the offset the reader asked for
    start: int  # the oldest offset the API still held

    @property
    def lost(self) -> int:
        return self.start - self.requested


class Timeline:
    """Accumulates decoded events and loss accounting for one VM's serial port."""

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
        self.events: list[Event] = []
        self.boots: dict[str, BootInfo] = {}
        self.seq_gaps: list[SeqGap] = []
        self.byte_gaps: list[ByteGap] = []
        self.lost_bytes = 0
        self.resets = 0  # times the API's buffer restarted below our offset
        self._decoder = StreamDecoder(
            key,
            pin=pin,
            pin_fp=pin_fp,
            from_start=from_start,
            instance_id=instance_id,
            retired=retired,
        )
        # What the decoder counted, added up block by block (kept across restarts but
        # ``lines``, ``events``, ``verified`` and ``covered``: this process's only).
        self.counts = DecodeStats()
        self.forged_samples: list[str] = []
        self.reject_samples: list[str] = []
        self.flood: dict[str, Flood] = {}
        # fingerprints of keys placed here and withdrawn (a contested start): their
        # announcements were taken back (:meth:`accepted` for a caller's own list of events)
        self.withdrawn: set[str] = set()
        # the ledger's record of the instance's highest boot counter (poller/boots.py)
        self.boot_record: Record | None = None

    # -- feeding ----------------------------------------------------------------------------

    def feed(self, data: bytes, rx: float | None = None) -> list[Event]:
        """Feed a chunk of the stream (any boundary) received at ``rx`` (the reader's clock);
        returns the new authenticated events in stream order."""
        return self._add(self._decoder.decode(data, rx), rx)

    def finish(self, rx: float | None = None) -> list[Event]:
        """End of a dump: decode the unterminated last line (a truncated line is rejected)."""
        return self._add(self._decoder.finish(rx), rx)

    def settle(self, rx: float | None = None, checks: int | None = SETTLE_CHECKS) -> list[Event]:
        """Verify the lines waiting in the carry-over (a flood's block could not reach them) in
        one empty block whose budget is ``checks`` signatures (None: as many as lines wait, for
        a dump: ``parse``, ``report``). Called before a verdict, so that a real line a flood
        delayed decides even when no byte follows it (a VM that powered off after its shutdown
        line serves no more output); what is left waits for the next poll's settle, first in
        line (docs/poller.md, "Per-read budget")."""
        d = self._decoder
        if not d.carry:
            return []
        own = d.__dict__.get("BUDGET_LINES")  # an instance's own budget (tests) is kept
        # None: two checks a line (the pin's, then a retired key's) reach every waiting line
        d.BUDGET_LINES = 2 * len(d.carry) if checks is None else max(1, checks)
        try:
            return self._add(d.decode(b"", rx), rx)  # a held partial line stays held
        finally:
            if own is None:
                del d.BUDGET_LINES
            else:
                d.BUDGET_LINES = own

    @property
    def waiting(self) -> int:
        """Lines waiting in the carry-over for a signature check (a flood delayed them)."""
        return len(self._decoder.carry)

    def note_byte_gap(self, requested: int, start: int) -> None:
        """The API returned ``start`` beyond ``requested``: those bytes are gone (and nothing
        after them can be pinned)."""
        self._decoder.lost_before()
        self.lost_bytes += start - requested
        if len(self.byte_gaps) < MAX_GAPS:
            self.byte_gaps.append(ByteGap(requested, start))

    def _drop_withdrawn(self, new: list[Event]) -> list[Event]:
        """A pin placed here was withdrawn (its boot's start was contested): its announcements,
        the only lines accepted under it, go, and so do the boots only they made."""
        self.withdrawn.update(self._decoder.withdrawn)
        self._decoder.withdrawn.clear()
        self.events = self.accepted(self.events)
        new = self.accepted(new)
        left = {e.boot for e in self.events}
        boots = [b for b in sorted(self.boots.values(), key=lambda b: b.order) if b.boot in left]
        self.boots = {b.boot: replace(b, order=i) for i, b in enumerate(boots)}
        return new

    def accepted(self, events: list[Event]) -> list[Event]:
        """``events`` (returned by :meth:`feed` before) less the announcements of a key placed
        here and withdrawn since: a caller that keeps its own list (``parse``) filters it."""
        if not self.withdrawn:
            return events
        gone = self.withdrawn
        return [e for e in events if not (e.event == vocab.KEY and e.get("kid") in gone)]

    def _add(self, found: Decoded, rx: float | None) -> list[Event]:
        if self._decoder.withdrawn:
            found.events = self._drop_withdrawn(found.events)
        # Only verified lines create a boot (and its place in the stream order), move its
        # liveness or its signed times. A covered line (below a verified line of its boot in the
        # same block, so it never raises the boot's max_seq past what that line does) counts in
        # its boot's seq range and gaps, in stream order; one whose boot is not there yet waits
        # for the end of the block, and is dropped from the accounting when it is still not.
        new, later = found.events, []
        for ev in new:
            if not ev.covered:  # a carried-over line: the receive time of its own block
                self._account(ev, ev.rx if ev.rx is not None else rx)
            elif ev.boot in self.boots:
                self._account(ev, None, covered=True)
            else:
                later.append(ev)
        for ev in later:
            if ev.boot in self.boots:
                self._account(ev, None, covered=True)
        self.events.extend(new)
        self.counts.add(found.stats)
        self._note_unchecked(found.unchecked, rx)
        for r in found.rejects[: max(0, MAX_REJECT_SAMPLES - len(self.reject_samples))]:
            self.reject_samples.append(r.raw[:240].decode("latin-1"))
        for f in found.forgeries[: max(0, MAX_FORGED_SAMPLES - len(self.forged_samples))]:
            self.forged_samples.append(f"{f.reason}: " + f.raw[:240].decode("latin-1"))
        if len(self.events) > MAX_EVENTS:
            self.compact()
        return new

    def _note_unchecked(self, unchecked: list[tuple[str, int, bool]], rx: float | None) -> None:
        """Take a block's never-verified lines (received at ``rx``) into the flood records."""
        for boot, seq, decisive in unchecked:
            if boot not in self.flood and len(self.flood) >= MAX_FLOOD_BOOTS:
                boot = ANY_BOOT
            f = self.flood.setdefault(boot, Flood())
            if rx is not None:
                if f.since is None or f.last is None or rx - f.last > FLOOD_EPISODE_GAP_S:
                    f.since = rx  # a new flood
                f.last = rx
            f.count += 1
            f.mark = len(self.boots)
            if decisive:
                f.min_decisive = seq if f.min_decisive < 0 else min(f.min_decisive, seq)
            else:
                f.max_routine = max(f.max_routine, seq)

    @property
    def unchecked(self) -> int:
        """Lines the signature budget never reached (a forgery flood): never evidence."""
        return self.counts.unchecked

    @property
    def flood_alarm(self) -> str:
        """:meth:`flood_hold` at any time: what the flood left unverified, shown as an alarm."""
        return self.flood_hold()

    def flood_hold(self, now: float | None = None, drain_s: float | None = None) -> str:
        """Why the verdict cannot be trusted to act on ("" when nothing stops it): lines of ours
        may be among those the signature budget did not reach (a flood of forged lines) and
        could change it: decisive lines waiting to be verified, or never verified, of the
        current boot (below its first terminal line) or of a boot not known (from before the
        current boot was first seen), or routine lines above the current boot's newest
        verified line (its liveness). With ``now`` and ``drain_s``: only lines received within
        one drain timeout (a flood's first line, the oldest waiting line) hold it, so a flood
        never holds a verdict at ``unknown`` longer than that (docs/poller.md, "Floods")."""
        cur = self.latest_boot
        info = self.boots.get(cur) if cur is not None else None
        parts = []

        def fresh(t: float | None) -> bool:
            return now is None or drain_s is None or t is None or now - t <= drain_s

        carry = self._decoder.carry
        if carry and fresh(min((t for _, t in carry if t is not None), default=None)):
            parts.append(f"{len(carry)} lines waiting for a signature check")
        first_terminal = -1
        if info is not None:
            terms = [
                e.seq
                for e in self.events
                if e.boot == cur and not e.covered and terminal_kind(e) is not None
            ]
            first_terminal = min(terms) if terms else -1
        stops = 0
        for boot, f in self.flood.items():
            if not fresh(f.since):
                continue  # counted (and shown by flood_alarm), but it holds nothing any more
            if info is not None and boot == cur:
                before_end = f.min_decisive >= 0 and (
                    first_terminal < 0 or f.min_decisive < first_terminal
                )
                newer = f.max_routine >= 0 and info.max_seq <= f.max_routine and first_terminal < 0
                if before_end or newer:
                    stops += f.count
            elif boot not in self.boots and (info is None or info.order < f.mark):
                stops += f.count
        if stops:
            parts.append(f"{stops} lines never verified (signature budget)")
        if not parts:
            return ""
        return f"unverified_flood ({'; '.join(parts)}: a flood of forged lines?)"

    def _account(self, ev: Event, rx: float | None, covered: bool = False) -> None:
        b = self.boots.get(ev.boot)
        if b is None:
            if covered:  # never: a covered line does not create a boot
                return
            self.boots[ev.boot] = BootInfo(
                ev.boot,
                ev.seq,
                ev.seq,
                1,
                ev.ts_ms,
                ev.ts_ms,
                len(self.boots),
                rx,
                rx,
                counter=parse_counter(ev.get("bc")),
            )
            return
        if b.counter is None and not covered:
            b.counter = parse_counter(ev.get("bc"))
        if ev.seq > b.max_seq + 1 and len(self.seq_gaps) < MAX_GAPS:
            self.seq_gaps.append(SeqGap(ev.boot, b.max_seq, ev.seq))
        if ev.seq > b.max_seq and rx is not None:
            # Liveness is a line newer than any seen: a late copy or a replay of an older line
            # of this boot says nothing about the VM now.
            b.last_rx = rx
        b.first_seq = min(b.first_seq, ev.seq)
        b.max_seq = max(b.max_seq, ev.seq)
        b.count += 1
        if covered:  # its time is not signed-checked: the poller reads last_ts_ms (zone ops)
            return
        b.first_ts_ms = min(b.first_ts_ms, ev.ts_ms)
        b.last_ts_ms = max(b.last_ts_ms, ev.ts_ms)

    # -- views ------------------------------------------------------------------------------

    @property
    def lines(self) -> int:
        """Console lines decoded by this process (not persisted across restarts)."""
        return self.counts.lines

    @property
    def rejected(self) -> int:
        return self.counts.rejected

    @property
    def duplicates(self) -> int:
        return self.counts.duplicates

    @property
    def reject_reasons(self) -> dict[str, int]:
        return dict(self.counts.reject_reasons)

    @property
    def forged(self) -> int:
        """Intact lines that did not authenticate: an alarm, never evidence."""
        return self.counts.forged

    @property
    def forged_reasons(self) -> dict[str, int]:
        return dict(self.counts.forged_reasons)

    @property
    def conflicts(self) -> int:
        """Authenticated lines whose (boot, seq) came with other content before."""
        return self.counts.conflicts

    @property
    def key(self) -> bytes | None:
        """The pinned line key (the first one announced, or the one given)."""
        return self._decoder.key

    @property
    def key_conflict(self) -> bool:
        """Another key than the pinned one was announced: no line can be trusted to decide."""
        return self._decoder.key_conflict

    @property
    def pin(self) -> bytes | None:
        """The pinned v3 public key (the ledger's, a hand pin's key, or placed here)."""
        return self._decoder.pin

    def set_pin(
        self, pin: bytes | None, pin_fp: str | None = None, retired: Retirees | None = None
    ) -> None:
        """The ledger's pin (every reader shares it); from now on lines verify under it.
        ``retired``: the keys rotations replaced (the ledger's, oldest first), if any."""
        d = self._decoder
        if pin is not None and retired:
            d.retired = tuple(retired)
        if pin is not None:
            d.start_open = False  # the ledger's pin is settled
        if pin is not None and d.pin != pin:
            d.pin, d.pinned_here, d.placeable = pin, False, False
        elif pin is None and pin_fp is not None:  # pinned by hand, its key not seen yet
            if d.pin is None or pk_fingerprint(d.pin) != pin_fp:
                d.pin, d.pinned_here = None, False
            d.pin_fp, d.placeable = pin_fp, False

    @property
    def retired(self) -> Retired | None:
        """The key the pin replaced by the latest rotation (``rekey``), and where."""
        return self._decoder.retired[-1] if self._decoder.retired else None

    @property
    def retired_chain(self) -> Retirees:
        """Every key rotations replaced (bounded), oldest first."""
        return self._decoder.retired

    @property
    def rekeys(self) -> list[tuple[bytes, bytes, str, int]]:
        """Rotations decoded from this stream and not stored yet: (old, new, boot, seq)."""
        return list(self._decoder.rekeys)

    def rekeys_stored(self) -> None:
        """The caller stored :attr:`rekeys` (in the ledger)."""
        self._decoder.rekeys.clear()

    @property
    def retired_lines(self) -> int:
        """Lines of the rotated-away key after its rotation (counted, not forged)."""
        return self.counts.retired

    def set_instance(self, instance_id: str) -> None:
        """The instance id the stream is read for (not kept in :meth:`to_json`: the reader's
        cursor knows it): announcements and rotation lines naming another are refused."""
        if instance_id:
            self._decoder.instance_id = instance_id

    def pin_stored(self) -> None:
        """The caller stored the pin placed here (in the ledger)."""
        self._decoder.pinned_here = False

    @property
    def pinned_here(self) -> bool:
        """The pin was placed from this timeline's stream and its boot's start is settled (a
        line other than an announcement verified under it): the caller stores it in the
        ledger. An unsettled one is never stored: another key announced at seq 0 or 1 before
        it settles withdraws it (``no_pin``)."""
        return self._decoder.pinned_here and not self._decoder.start_open

    @property
    def unplaced(self) -> list[str]:
        """Fingerprints of announced keys that are not the pin: their lines never decide."""
        return list(self._decoder.unplaced)

    @property
    def ephemeral(self) -> bool:
        """The pinned key was announced ``eph=1``: the VM could not keep it across boots."""
        return self._decoder.ephemeral

    @property
    def key_alarm(self) -> str:
        """Why an operator must look at this instance's keys ("" when nothing is wrong)."""
        parts = []
        reasons = self.forged_reasons
        unverified = reasons.get(Forgery.NO_KEY) or reasons.get(Forgery.V2)
        if self.pin is None and self.key is None and (self.unplaced or unverified):
            fps = ",".join(self.unplaced) or "-"
            parts.append(f"no_pin (announced {fps}; `gce-watchdog pin` after checking the VM)")
        elif self.unplaced:
            parts.append(f"unplaced_key {','.join(self.unplaced)}")
        if self.ephemeral:
            parts.append("ephemeral_key (the VM cannot keep its line key)")
        flood = self.flood_alarm  # lines the signature budget has not reached may decide
        if flood:
            parts.append(flood)
        return "; ".join(parts)

    @property
    def key_id(self) -> str | None:
        if self.pin is not None:
            return pk_fingerprint(self.pin)
        return fingerprint(self.key) if self.key is not None else None

    @property
    def boot_order(self) -> Order:
        """The one boot order (poller/boots.py) on the boots read here and the ledger's record:
        the current boot, the regressed ones (replays, lost counters: ``boot_regressed``)."""
        seen = [Seen(b.boot, b.counter, b.order, b.first_ts_ms) for b in self.boots.values()]
        return order_boots(seen, self.boot_record)

    @property
    def latest_boot(self) -> str | None:
        """The current incarnation (:attr:`boot_order`): the highest boot counter, never the
        guest's clock; without counters, the boot whose first authenticated line appears latest
        in the stream (docs/serial-protocol.md, "Boot order"). None when no boot read here is
        current (the ledger's highest boot is not in this read: what is here is regressed)."""
        return self._current(self.boot_order)

    def _current(self, order: Order) -> str | None:
        """``order``'s current boot when it is one read here, else None."""
        return order.current if order.current in self.boots else None

    @property
    def regressed(self) -> tuple[str, ...]:
        """Boots whose counter is at or below the highest and that were not seen before it: a
        replay or a lost counter. They never decide (alarm ``boot_regressed``)."""
        return self.boot_order.regressed

    def note_boot_record(self, record: Record | None) -> None:
        """The ledger's record for the instance (it only rises: a lower one is ignored)."""
        if record is None:
            return
        if self.boot_record is None or record.counter > self.boot_record.counter:
            self.boot_record = record

    def judge(self, instance: InstanceState, now: float, policy: Policy) -> Verdict:
        """The verdict: the one function ``poll``, ``parse`` and ``report`` use.

        ``now`` is on the reader's clock, like the receive times given to :meth:`feed`.
        """
        order = self.boot_order
        boot = self._current(order)
        rx = self.boots[boot].last_rx if boot is not None else None
        gone = set(order.regressed)
        if boot is None:  # the ledger's highest boot is not in this read: nothing here decides
            gone |= set(self.boots)
        # covered lines never decide, nor do a regressed boot's (a replay, a lost counter)
        verified = [e for e in self.events if not e.covered and e.boot not in gone]
        known = self.boots[boot].rx_known if boot is not None else True
        v = decide(verified, instance, now, policy, received_s=rx, boot=boot, received_known=known)
        if order.regressed:
            v = boot_regressed(v, order.regressed)
        if self.key_conflict:
            # The pinned key still decides: one printed key line must not silence the poller
            # (a wedged VM would bill on). Operators must look: either a local process forges,
            # or the pin was taken late from a forger and the real lines show as forged.
            note = (
                f"ALARM: a second line key was announced ({self.forged} forged lines), "
                f"verdict by the pinned key {self.key_id}"
            )
            v = replace(v, reason=f"{note}; {v.reason}")
        alarm = self.key_alarm
        if alarm and v.kind is VerdictKind.SUSPECTED_WEDGE and self.ephemeral and self.unplaced:
            # The pinned key was announced ephemeral (signed: no forger can say so) and another
            # key appeared since: most likely the VM's next boot, whose lines this reader cannot
            # verify. Their silence is not the VM's: an alarm, never a failover.
            v = replace(
                v,
                kind=VerdictKind.UNKNOWN,
                reason=f"ALARM: {alarm}; silence not judged: {v.reason}",
            )
        elif alarm and v.failover and self.pin is None:
            # Lines of ours are there but no key can be placed (a late reader, an instance that
            # ran before its poller): not acting is the one safe answer, whatever the status
            # says (a finished job's VM is TERMINATED too). Pin by hand to decide again.
            v = replace(
                v,
                kind=VerdictKind.UNKNOWN,
                reason=f"ALARM: {alarm}; not acted on without a pin: {v.reason}",
            )
        elif alarm:
            v = replace(v, reason=f"ALARM: {alarm}; {v.reason}")
        flood = self.flood_hold(now, policy.drain_timeout_s)
        if flood and (v.failover or v.kind is VerdictKind.HEALTHY):
            # Lines the budget did not reach could change this verdict: not acted on (and not
            # called healthy) until they are verified or a later line settles it.
            v = replace(
                v,
                kind=VerdictKind.UNKNOWN,
                policy_failover=False,
                reason=f"ALARM: {flood}; not acted on: {v.reason}",
            )
        elif flood:
            v = replace(v, reason=f"ALARM: {flood}; {v.reason}")
        return v

    @property
    def lost_lines(self) -> int:
        return sum(b.lost for b in self.boots.values())

    def compact(self) -> None:
        """Bound memory: keep key events (verdict inputs) and the most recent routine lines.

        Each boot's first terminal event (by seq) is always kept: the verdict is decided by it,
        and a long tail of later key events (a finished job's VM flapping for days) must not
        push it out, or a later ladder ``shutdown`` would become "first" and fail over a job
        that had finished.
        """
        keys = [e for e in self.events if e.event in KEY_EVENTS][-KEEP_KEY_EVENTS:]
        recent = self.events[-KEEP_RECENT:]
        first_terminal: dict[str, Event] = {}
        for e in self.events:
            if terminal_kind(e) is not None:
                cur = first_terminal.get(e.boot)
                if cur is None or e.seq < cur.seq:
                    first_terminal[e.boot] = e
        keep = {id(e) for e in keys} | {id(e) for e in recent}
        keep |= {id(e) for e in first_terminal.values()}
        self.events = [e for e in self.events if id(e) in keep]

    # -- persistence ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        self.compact()
        return {
            "events": [e.to_json() for e in self.events],
            "covered": [i for i, e in enumerate(self.events) if e.covered],
            "carry": [[ln.decode("latin-1"), crx] for ln, crx in self._decoder.carry],
            "flood": {b: asdict(f) for b, f in self.flood.items()},
            "unchecked": self.unchecked,
            "key": self.key.hex() if self.key is not None else None,
            "pin": _b64(self.pin) if self.pin is not None else None,
            "pin_fp": self._decoder.pin_fp,
            "retired": [
                {"pk": _b64(r.public), "boot": r.boot, "seq": r.seq} for r in self.retired_chain
            ],
            "retired_lines": self.retired_lines,
            "inst_seen": self._decoder.inst_seen,
            "rekeys": [[_b64(o), _b64(n), b, q] for o, n, b, q in self._decoder.rekeys],
            "placeable": self._decoder.placeable,
            "start_open": self._decoder.start_open,
            "unplaced": self.unplaced,
            "ephemeral": self.ephemeral,
            "key_conflict": self.key_conflict,
            "forged": self.forged,
            "forged_reasons": self.forged_reasons,
            "forged_samples": self.forged_samples,
            "conflicts": self.conflicts,
            "boots": [asdict(b) for b in self.boots.values()],
            "seq_gaps": [asdict(g) for g in self.seq_gaps],
            "byte_gaps": [asdict(g) for g in self.byte_gaps],
            "lost_bytes": self.lost_bytes,
            "resets": self.resets,
            "rejected": self.rejected,
            "duplicates": self.duplicates,
            "reject_reasons": self.reject_reasons,
            "reject_samples": self.reject_samples,
            "boot_record": None
            if self.boot_record is None
            else [self.boot_record.counter, self.boot_record.boot, self.boot_record.began],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Timeline:
        """Rebuild from :meth:`to_json`; raises ValueError/KeyError/TypeError on a bad document."""
        key, pin, pin_fp = obj.get("key"), obj.get("pin"), obj.get("pin_fp")
        t = cls(
            bytes.fromhex(str(key)) if key else None,
            pin=unb64(str(pin)) if pin else None,
            pin_fp=str(pin_fp) if pin_fp else None,
        )
        d = t._decoder
        d.key_conflict = bool(obj.get("key_conflict", False))
        d.placeable = bool(obj.get("placeable", False)) and d.pin is None
        # a pin placed from the stream, not settled (never stored): still open to a contest
        d.start_open = d.pinned_here = bool(obj.get("start_open", False)) and d.pin is not None
        d.unplaced = [str(x) for x in obj.get("unplaced") or []][: d.MAX_UNPLACED]
        d.ephemeral = bool(obj.get("ephemeral", False))
        d.retired = tuple(
            Retired(unb64(str(r["pk"])), str(r["boot"]), int(r["seq"]))
            for r in (obj.get("retired") or [])[-MAX_RETIRED:]
        )
        d.inst_seen = str(obj.get("inst_seen") or "")
        d.rekeys = [
            (unb64(str(o)), unb64(str(n)), str(b), int(q))
            for o, n, b, q in (obj.get("rekeys") or [])[: d.MAX_REKEYS]
        ]
        c = t.counts
        c.retired = int(obj.get("retired_lines", 0))
        t.events = [Event.from_json(e) for e in obj["events"]]
        for i in obj.get("covered") or []:
            if 0 <= int(i) < len(t.events):
                t.events[int(i)] = replace(t.events[int(i)], covered=True)
        d.carry = [
            (str(ln).encode("latin-1"), None if crx is None else float(crx))
            for ln, crx in (obj.get("carry") or [])[: d.MAX_CARRY]
        ]
        t.flood = {
            str(b): Flood(**f)
            for b, f in list(dict(obj.get("flood") or {}).items())[:MAX_FLOOD_BOOTS]
        }
        c.unchecked = int(obj.get("unchecked", 0))
        c.forged = int(obj.get("forged", 0))
        c.conflicts = int(obj.get("conflicts", 0))
        c.forged_reasons = {
            str(k): int(v) for k, v in dict(obj.get("forged_reasons") or {}).items()
        }
        t.forged_samples = [str(x) for x in obj.get("forged_samples") or []][:MAX_FORGED_SAMPLES]
        for b in obj["boots"]:
            t.boots[str(b["boot"])] = BootInfo(**b)
        # a flood record from before its times were kept: counted at about the last read
        rxs = [b.last_rx for b in t.boots.values() if b.last_rx is not None]
        for f in t.flood.values():
            if f.since is None and rxs:
                f.since = f.last = max(rxs)
        t.seq_gaps = [SeqGap(**g) for g in obj["seq_gaps"]]
        t.byte_gaps = [ByteGap(**g) for g in obj["byte_gaps"]]
        t.lost_bytes = int(obj["lost_bytes"])
        t.resets = int(obj["resets"])
        c.rejected = int(obj["rejected"])
        c.duplicates = int(obj["duplicates"])
        c.reject_reasons = {str(k): int(v) for k, v in obj["reject_reasons"].items()}
        t.reject_samples = [str(s) for s in obj["reject_samples"]][:MAX_REJECT_SAMPLES]
        rec = obj.get("boot_record")
        if rec:
            t.boot_record = Record(int(rec[0]), str(rec[1]), float(rec[2]))
        return t


def boot_regressed(v: Verdict, regressed: tuple[str, ...]) -> Verdict:
    """``v`` with the ``boot_regressed`` alarm beside it (it changes neither the verdict nor its
    failover: the regressed boots' lines were not among its evidence)."""
    note = f"alarm={ALARM_BOOT_REGRESSED}"
    if note in v.evidence:
        return v
    what = ",".join(regressed)
    return replace(
        v,
        reason=(
            f"ALARM: boot_regressed (boot {what}: a boot counter at or below the highest, not "
            f"seen before it: a replay or a lost counter, ignored); {v.reason}"
        ),
        evidence=(*v.evidence, note),
    )


def parse_bytes(
    data: bytes | Iterable[bytes],
    rx: float | None = None,
    key: bytes | None = None,
    *,
    pin: bytes | None = None,
    pin_fp: str | None = None,
    from_start: bool = True,
) -> Timeline:
    """Decode a whole saved dump (bytes, or an iterable of chunks), received at ``rx``, into a
    finished timeline. ``pin``/``pin_fp``: a pinned v3 key or fingerprint; default: the dump is
    the port's output from byte 0 and its first line, an announcement, is pinned. ``key``: a
    v2 key held from before the upgrade."""
    t = Timeline(key, pin=pin, pin_fp=pin_fp, from_start=from_start)
    if isinstance(data, bytes | bytearray):
        t.feed(bytes(data), rx)
    else:
        for chunk in data:
            t.feed(chunk, rx)
    t.finish(rx)
    t.settle(rx, checks=None)  # a dump: every waiting line is checked (no later read)
    return t
