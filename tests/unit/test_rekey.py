"""Issue 25 item 4: the key never changes silently; a new key is announced by a ``rekey`` line
signed with the old one (docs/serial-protocol.md, "Key rotation"). The wire format and the
readers' decoder, as attacks: a forged rekey, a replayed rekey of another instance, a chain."""

from __future__ import annotations

import pytest
from gce_watchdog.poller.timeline import Timeline, parse_bytes
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind, terminal_kind
from gce_watchdog.wire import protocol
from gce_watchdog.wire.protocol import (
    REKEY_EVENT,
    Event,
    Forged,
    Forgery,
    LineKey,
    Rejected,
    Retired,
    decode_line,
    encode,
    key_line,
    parse_rekey,
    rekey_line,
)
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

BOOT = "b007b007"
INST = "4242424242424242424"
T0 = 1_800_000_000_000
OLD = LineKey(bytes([1]) * 32)
NEW = LineKey(bytes([2]) * 32)
NEWER = LineKey(bytes([3]) * 32)
EVIL = LineKey(bytes([9]) * 32)
RUN = InstanceState("RUNNING")
POL = Policy()


class Writer:
    """One VM's console as the agent writes it: one counter, the key of the moment."""

    def __init__(self, key: LineKey, boot: str = BOOT, inst: str = INST) -> None:
        self.key, self.boot, self.inst, self.seq, self.lines = key, boot, inst, 0, []
        self.ts = T0

    def _take(self) -> int:
        n, self.seq, self.ts = self.seq, self.seq + 1, self.ts + 1000
        return n

    def emit(self, event: str, **fields: object) -> None:
        n = self._take()
        while protocol.needs_announcement(n):
            self.lines.append(key_line(self.boot, n, self.ts, self.key, self.inst))
            n = self._take()
        ev = protocol.make_event(event, self.boot, n, self.ts, fields)
        self.lines.append(encode(ev, self.key))

    def rotate(self, new: LineKey, signer: LineKey | None = None, inst: str | None = None) -> int:
        """The rekey line (signed with ``signer``, default the key of the moment), then the
        switch and the new key's announcement, as ``gce-watchdog key --rotate`` writes them."""
        n = self._take()
        line = rekey_line(self.boot, n, self.ts, signer or self.key, new.public, inst or self.inst)
        self.lines.append(line)
        if signer is None:
            self.key = new
            self.lines.append(key_line(self.boot, self._take(), self.ts, new, self.inst))
        return n

    def data(self) -> bytes:
        return "".join(x + "\n" for x in self.lines).encode()


def _healthy_boot(w: Writer, beats: int = 3) -> None:
    w.emit("start", v="1", inst=INST, rung="0/10")
    for i in range(beats):
        w.emit("heartbeat", rung="0/10", ph="workload", ticks=i)


def _judge(tl: Timeline) -> VerdictKind:
    return tl.judge(RUN, 100.0, POL).kind


# -- the line itself -----------------------------------------------------------------------


def test_the_rekey_line_fits_the_line_budget_at_its_longest() -> None:
    inst = "1" * 20  # GCE instance ids are uint64: at most 20 digits
    seq = 10**20 - 1  # the seq record's width (and far above any CLOCK_BOOTTIME fallback)
    bc = "9" * 12  # the boot counter at its longest
    line = rekey_line("ffffffff", seq, 253402300799999, OLD, NEW.public, inst, bc)
    assert len(line) == 252 <= protocol.MAX_LINE  # docs/serial-protocol.md, "Key rotation"
    assert protocol.line_length(protocol.rekey_event("ffffffff", seq, 0, NEW.public, inst, bc)) <= (
        protocol.MAX_LINE
    )
    got = decode_line(line, pin=OLD.public)
    assert isinstance(got, Event) and parse_rekey(got) == (NEW.public, inst)
    assert got.get("bc") == bc


BID = "f" * 32


def test_the_announcement_at_seq_0_and_1_always_carries_bc_and_the_whole_boot_id() -> None:
    """Issue 35.1: the worst case (a 20-digit instance id, eph=1, a 12-digit counter) at the
    seqs readers pin from: 274 bytes, bid included; a repeated copy with an 8-digit seq or more
    leaves bid out (never shortened) and keeps every other field whole."""
    eph = LineKey(bytes([4]) * 32, ephemeral=True)
    inst, bc, ts = "1" * 20, "9" * 12, 253402300799999
    for seq in (0, 1):
        line = key_line("ffffffff", seq, ts, eph, inst, bc, BID)
        assert len(line) == 274
        ann = decode_line(line)
        assert isinstance(ann, protocol.KeyAnnounce) and ann.valid() and ann.key == eph.public
        assert ann.event.get("bc") == bc and ann.event.get("bid") == BID
    assert "bid=" in key_line("ffffffff", 10**7 - 1, ts, eph, inst, bc, BID)
    for seq in (10**7, 10**20 - 1):
        line = key_line("ffffffff", seq, ts, eph, inst, bc, BID)
        assert "bid=" not in line and f" bc={bc} " in line and len(line) <= protocol.MAX_LINE
    short = key_line("ffffffff", 0, ts, OLD, "-", "1", BID)
    assert short.split(" #")[0].endswith(f" bc=1 bid={BID}")


def test_announcements_and_rekeys_with_a_bad_bc_or_bid_are_not_read_as_such() -> None:
    for bad in ("0", "01", "1000000000000", "x"):
        with pytest.raises(protocol.ProtocolError):
            key_line("ffffffff", 0, 0, OLD, "-", bad)
        ev = Event("key", "ffffffff", 0, 0, (("pk", protocol.b64(OLD.public)), ("inst", "-"),
                                             ("bc", bad)))  # fmt: skip
        assert not isinstance(decode_line(encode(ev, OLD)), protocol.KeyAnnounce)
        rk = Event(REKEY_EVENT, BOOT, 5, 0, (("pk", protocol.b64(NEW.public)), ("inst", INST),
                                             ("bc", bad)))  # fmt: skip
        assert parse_rekey(rk) is None
    with pytest.raises(protocol.ProtocolError):
        key_line("ffffffff", 0, 0, OLD, "-", "1", "F" * 32)


def test_a_rekey_line_must_name_the_instance() -> None:
    for inst in ("-", "", "a b"):
        try:
            rekey_line(BOOT, 5, T0, OLD, NEW.public, inst)
        except protocol.ProtocolError:
            continue
        raise AssertionError(f"rekey line with inst={inst!r} was encoded")


@given(
    boot=st.from_regex(r"[0-9a-f]{8}", fullmatch=True),
    seq=st.integers(min_value=0, max_value=10**20 - 1),
    ts=st.integers(min_value=0, max_value=253402300799999),
    inst=st.from_regex(r"[0-9]{1,20}", fullmatch=True),
    old_seed=st.binary(min_size=32, max_size=32),
    new_seed=st.binary(min_size=32, max_size=32),
    flip=st.integers(min_value=0, max_value=10_000),
)
def test_decode_of_rekey_lines(
    boot: str, seq: int, ts: int, inst: str, old_seed: bytes, new_seed: bytes, flip: int
) -> None:
    old, new = LineKey(old_seed), LineKey(new_seed)
    line = rekey_line(boot, seq, ts, old, new.public, inst)
    # under the pin (the old key): an event naming the new key and the instance
    ev = decode_line(line, pin=old.public)
    assert isinstance(ev, Event) and ev.event == REKEY_EVENT and (ev.boot, ev.seq) == (boot, seq)
    assert parse_rekey(ev) == (new.public, inst)
    # under any other pin: a forgery, whatever key it names
    if new.public != old.public:
        bad = decode_line(line, pin=new.public)
        assert isinstance(bad, Forged) and bad.reason == Forgery.BAD_REKEY
        # a reader whose pin already moved: the rotation into its pin, signed by the retired key
        again = decode_line(line, pin=new.public, retired=Retired(old.public, boot, seq))
        assert isinstance(again, Event) and parse_rekey(again) == (new.public, inst)
        # the same line at another (boot, seq) than the retired key's rotation is not it
        elsewhere = decode_line(line, pin=new.public, retired=Retired(old.public, boot, seq + 1))
        assert isinstance(elsewhere, Event)  # seq below the rotation: the old key's own line
        below = Retired(old.public, boot, max(seq, 1) - 1)
        later = decode_line(line, pin=new.public, retired=below)
        if seq > 0:
            assert isinstance(later, Forged) and later.reason == Forgery.RETIRED
    # one damaged byte anywhere: never an accepted rekey
    raw = bytearray(line.encode())
    i = flip % len(raw)
    raw[i] = (raw[i] + 1 + flip % 250) % 256 or 1
    if bytes(raw) != line.encode():
        got = decode_line(bytes(raw), pin=old.public)
        assert got is None or isinstance(got, Rejected)  # the CRC covers every byte


def test_a_rekey_is_never_a_failover_signal_nor_terminal() -> None:
    ev = decode_line(rekey_line(BOOT, 7, T0, OLD, NEW.public, INST), pin=OLD.public)
    assert isinstance(ev, Event) and terminal_kind(ev) is None
    w = Writer(OLD)
    _healthy_boot(w)
    w.rotate(NEW, signer=EVIL)  # a forged one: the stream ends on it
    tl = parse_bytes(w.data(), rx=99.0)
    assert _judge(tl) is VerdictKind.HEALTHY


# -- the decoder: attacks -------------------------------------------------------------------


def test_a_forged_rekey_changes_no_verdict_and_no_pin() -> None:
    base = Writer(OLD)
    _healthy_boot(base)
    honest = parse_bytes(base.data(), rx=99.0)
    w = Writer(OLD)
    _healthy_boot(w)
    w.rotate(EVIL, signer=EVIL)  # the attacker's key, signed by the attacker
    w.lines.append(key_line(BOOT, 90, T0 + 90_000, EVIL, INST))  # and announced
    w.lines.append(encode(Event("shutdown", BOOT, 91, T0 + 91_000, (("reason", "ladder"),)), EVIL))
    tl = parse_bytes(w.data(), rx=99.0)
    assert tl.pin == OLD.public and tl.retired is None and tl.rekeys == []
    assert tl.forged_reasons.get(Forgery.BAD_REKEY) == 1 and tl.forged == 3
    assert _judge(tl) is _judge(honest) is VerdictKind.HEALTHY
    assert not any(e.event in (REKEY_EVENT, "shutdown") for e in tl.events)
    # a rekey signed by the real key but naming the attacker's instance changes nothing either
    tl2 = Timeline(instance_id=INST)
    w2 = Writer(OLD)
    _healthy_boot(w2)
    w2.rotate(EVIL, inst="999")
    tl2.feed(w2.data(), 1.0)
    assert tl2.pin == OLD.public and tl2.forged_reasons.get(Forgery.RELABELLED) == 1


def test_a_real_rotation_mid_boot_keeps_the_verdict_healthy_and_lines_after_it_verify() -> None:
    w = Writer(OLD)
    _healthy_boot(w)
    n = w.rotate(NEW)
    for i in range(40):  # past a multiple of 32: the re-announcement is the new key's
        w.emit("heartbeat", rung="0/10", ph="workload", ticks=100 + i)
    tl = Timeline(instance_id=INST)
    got = tl.feed(w.data(), 99.0)
    assert tl.forged == 0 and tl.unplaced == [] and tl.key_alarm == ""
    assert tl.pin == NEW.public
    assert tl.retired == Retired(OLD.public, BOOT, n)
    assert tl.rekeys == [(OLD.public, NEW.public, BOOT, n)]
    beats = [e for e in got if e.event == "heartbeat"]
    assert len(beats) == 43 and max(e.seq for e in beats) > n
    rk = [e for e in got if e.event == REKEY_EVENT]
    assert [e.get("kid") for e in rk] == [NEW.fingerprint] and rk[0].get("old") == OLD.fingerprint
    assert tl.judge(RUN, 100.0, POL).kind is VerdictKind.HEALTHY
    # the state survives a restart of the reader
    back = Timeline.from_json(tl.to_json())
    assert back.pin == NEW.public and back.retired == tl.retired and back.rekeys == tl.rekeys


def test_a_replayed_rekey_of_another_instance_is_refused() -> None:
    """Two VMs with one key (a restored disk): B rotates; B's real rekey line, copied into A's
    stream (or a LogEntry relabelled with A's id), must not move A's pin."""
    other = Writer(OLD, boot="0b0b0b0b", inst="777")
    _healthy_boot(other)
    other.rotate(NEW)
    stolen = other.lines[-2]
    assert " rekey " in stolen
    a = Writer(OLD)
    _healthy_boot(a)
    a.lines.append(stolen)
    a.emit("heartbeat", rung="0/10", ph="workload", ticks=9)
    for tl in (Timeline(instance_id=INST), parse_bytes(a.data(), rx=1.0)):
        if not tl.events:
            tl.feed(a.data(), 1.0)
        assert tl.pin == OLD.public and tl.rekeys == [] and tl.retired is None
        assert tl.forged_reasons.get(Forgery.RELABELLED) == 1
        assert tl.judge(RUN, 2.0, POL).kind is VerdictKind.HEALTHY


def test_a_chain_of_rotations_is_followed_and_an_old_rekey_replayed_later_moves_nothing() -> None:
    w = Writer(OLD)
    _healthy_boot(w)
    first = w.rotate(NEW)
    replay = w.lines[-2]
    w.emit("heartbeat", rung="0/10", ph="workload", ticks=5)
    second = w.rotate(NEWER)
    w.emit("heartbeat", rung="0/10", ph="workload", ticks=6)
    w.lines.append(replay)  # the first rotation again, after the second
    w.emit("heartbeat", rung="0/10", ph="workload", ticks=7)
    tl = Timeline(instance_id=INST)
    tl.feed(w.data(), 50.0)
    assert tl.pin == NEWER.public and tl.retired == Retired(NEW.public, BOOT, second)
    assert [r[:2] for r in tl.rekeys] == [(OLD.public, NEW.public), (NEW.public, NEWER.public)]
    assert tl.rekeys[0][3] == first
    # the replay: the first rotation, signed by the key of then: nothing moves back
    assert tl.forged == 0 and tl.pin == NEWER.public
    assert tl.retired_chain == (Retired(OLD.public, BOOT, first), Retired(NEW.public, BOOT, second))
    assert tl.judge(RUN, 51.0, POL).kind is VerdictKind.HEALTHY


def test_a_reader_that_takes_the_moved_pin_reads_the_boot_from_byte_0_without_alarms() -> None:
    """A fresh reader (new cursor dir, another host) gets the ledger's pin after the rotation:
    the old key's lines of the rotation boot before the rekey still verify; an earlier boot's
    are counted as retired, not as forgeries."""
    earlier = Writer(OLD, boot="0e0e0e0e")
    _healthy_boot(earlier)
    w = Writer(OLD)
    _healthy_boot(w)
    n = w.rotate(NEW)
    w.emit("heartbeat", rung="0/10", ph="workload", ticks=50)
    late_old = encode(Event("heartbeat", BOOT, n - 1, T0, (("rung", "0/10"),)), OLD)
    w.lines.append(late_old)  # a line the agent numbered before the switch, written after it
    tl = Timeline(pin=NEW.public, instance_id=INST, retired=Retired(OLD.public, BOOT, n))
    tl.feed(earlier.data() + w.data(), 60.0)
    assert tl.forged == 0 and tl.key_alarm == "" and tl.rekeys == []
    assert tl.retired_lines == len(earlier.lines)
    assert {e.boot for e in tl.events} == {BOOT}
    assert any(e.event == "start" for e in tl.events)  # the boot's first lines, old key
    assert tl.pin == NEW.public and tl.judge(RUN, 61.0, POL).kind is VerdictKind.HEALTHY


def test_the_retired_key_cannot_sign_after_its_rotation() -> None:
    """After the rotation the old key (it may have leaked: the reason to rotate) signs nothing
    that decides: not a later line of the boot, not a later boot."""
    w = Writer(OLD)
    _healthy_boot(w)
    n = w.rotate(NEW)
    w.emit("heartbeat", rung="0/10", ph="workload", ticks=50)
    w.lines.append(encode(Event("shutdown", BOOT, n + 40, T0, (("reason", "ladder"),)), OLD))
    w.lines.append(key_line("0f0f0f0f", 0, T0, OLD, INST))
    w.lines.append(encode(Event("shutdown", "0f0f0f0f", 2, T0, (("reason", "ladder"),)), OLD))
    tl = Timeline(instance_id=INST)
    tl.feed(w.data(), 70.0)
    assert not any(e.event == "shutdown" for e in tl.events)
    assert tl.retired_lines == 3 and tl.forged == 0
    assert tl.judge(RUN, 71.0, POL).kind is VerdictKind.HEALTHY


def test_a_reloaded_reader_of_a_first_boot_still_follows_its_rotation() -> None:
    """A first boot's agent announces ``inst=-`` (its identity cache came later); the poll
    path's timeline is saved and reloaded between reads (the cursor file), without the instance
    id: the reader gives it again, and the rotation naming the instance is followed."""
    w = Writer(OLD, inst="-")
    _healthy_boot(w)
    tl = Timeline(instance_id=INST)
    tl.feed(w.data(), 1.0)
    w.lines.clear()
    w.inst = INST
    w.rotate(NEW)
    w.emit("heartbeat", rung="0/10", ph="workload", ticks=9)
    lost = Timeline.from_json(tl.to_json())  # no instance id: a rotation it cannot check
    lost.feed(w.data(), 2.0)
    assert lost.pin == OLD.public and lost.forged_reasons.get(Forgery.RELABELLED) == 1
    back = Timeline.from_json(tl.to_json())
    back.set_instance(INST)
    back.feed(w.data(), 2.0)
    assert back.pin == NEW.public and back.forged == 0
