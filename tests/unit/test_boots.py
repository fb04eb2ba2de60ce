"""Boot order (poller/boots.py): the highest counter is current, replays never are."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gce_watchdog.poller.boots import (
    REPLAY_BOUND_MS,
    Record,
    Seen,
    counter_of,
    order,
    parse_counter,
    seen_of,
)
from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.wire.protocol import announce_event, encode, make_event
from hypothesis import assume, given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

DAY = 24 * 3600 * 1000


def _seen(stream: list[tuple[str, int | None]], ts: dict[str, int] | None = None) -> list[Seen]:
    """Boots of a stream of (boot, counter) lines: position by first line."""
    found: dict[str, Seen] = {}
    for boot, counter in stream:
        if boot not in found:
            found[boot] = Seen(boot, counter, len(found), (ts or {}).get(boot, 0))
    return list(found.values())


def test_counter_values() -> None:
    assert parse_counter("1") == 1 and parse_counter("999999999999") == 999_999_999_999
    for bad in (None, "-", "0", "01", "1000000000000", "x", "", " 1", "1.0"):
        assert parse_counter(bad) is None
    assert counter_of(["-", None, "7", "8"]) == 7


def test_replay_of_the_previous_boot_after_the_current_one() -> None:
    # b1 (bc=1), then b2 (bc=2), then b1's lines replayed: b2 stays, b1 is not regressed (it
    # began before b2 in this read); a fresh read of a rolled window (b1 only after b2) is
    o = order(_seen([("b1", 1), ("b2", 2), ("b1", 1)]))
    assert o.current == "b2" and o.regressed == () and o.raise_to is not None
    o = order(_seen([("b2", 2), ("b1", 1)]))
    assert o.current == "b2" and o.regressed == ("b1",)


def test_the_ledger_record_outranks_what_a_read_finds() -> None:
    rec = Record(5, "b5", 1.0)
    # only a replayed older boot in the window: it never decides, and it is regressed
    o = order(_seen([("b4", 4)]), rec)
    assert o.current == "b5" and o.regressed == ("b4",) and o.raise_to is None
    # a boot unseen before with the same counter: a lost counter or a replay
    o = order(_seen([("b5", 5), ("bx", 5)]), rec)
    assert o.current == "b5" and o.regressed == ("bx",)
    # a higher counter: the record rises
    o = order(_seen([("b5", 5), ("b6", 6)]), rec)
    assert o.current == "b6" and o.raise_to == Seen("b6", 6, 1)


def test_guest_clock_two_days_behind_is_still_current() -> None:
    o = order(_seen([("b1", 1), ("b2", 2)], {"b1": 10 * DAY, "b2": 8 * DAY}))
    assert o.current == "b2"


def test_unknown_counter_after_the_highest_is_current() -> None:
    assert order(_seen([("b1", 3), ("b2", None)])).current == "b2"
    assert order(_seen([("b2", None), ("b1", 3)])).current == "b1"
    assert order(_seen([("b2", None)]), Record(3, "b1")).current == "b2"


def test_without_counters_the_old_rule_stands() -> None:
    # stream order, but a later boot over a day older is a replay (lines of older agents)
    assert order(_seen([("a", None), ("b", None)])).current == "b"
    assert order(_seen([("a", None), ("b", None)], {"a": 3 * DAY, "b": DAY})).current == "a"
    assert order([]).current is None


def test_seen_of_events() -> None:
    evs = [
        make_event("start", "bbbb0001", 0, 5, {"bc": "1"}),
        make_event("start", "bbbb0002", 0, 9, {"bc": "-"}),
        make_event("tick", "bbbb0002", 1, 3, {"bc": "2"}),
        make_event("tick", "bbbb0001", 1, 1),
    ]
    assert seen_of(evs) == [Seen("bbbb0001", 1, 0, 1), Seen("bbbb0002", 2, 1, 3)]


# -- properties ----------------------------------------------------------------------------

# A VM's genuine history: boots b0..bn with rising counters (gaps allowed: boots nobody read),
# each a few lines, in order; a window is a suffix of it holding the newest boot's lines.
history = st.lists(st.integers(1, 3), min_size=1, max_size=6).flatmap(
    lambda gaps: st.tuples(
        st.just([sum(gaps[: i + 1]) for i in range(len(gaps))]),
        st.lists(st.integers(1, 4), min_size=len(gaps), max_size=len(gaps)),
    )
)


def _stream(counters: list[int], lengths: list[int]) -> list[tuple[str, int | None]]:
    return [(f"b{c}", c) for c, n in zip(counters, lengths, strict=True) for _ in range(n)]


@given(history, st.integers(0, 30), st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50))))
def test_replays_of_earlier_boots_never_change_the_current_boot(
    h: tuple[list[int], list[int]], cut: int, replays: list[tuple[int, int]]
) -> None:
    counters, lengths = h
    genuine = _stream(counters, lengths)
    newest = f"b{counters[-1]}"
    window = genuine[min(cut, len(genuine) - 1) :]
    if all(b != newest for b, _ in window):
        window = [(newest, counters[-1])]
    attacked = list(window)
    for pos, which in replays:  # earlier boots' lines printed anywhere (a replayer's choice)
        c = counters[which % len(counters)]
        if f"b{c}" != newest:
            attacked.insert(pos % (len(attacked) + 1), (f"b{c}", c))
    assert order(_seen(genuine)).current == newest
    assert order(_seen(attacked)).current == newest
    # and with the ledger's record of the newest boot, on any host, after any restart
    rec = Record(counters[-1], newest)
    assert order(_seen(attacked), rec).current == newest
    # replays alone (the window rolled past the newest boot's lines) never decide either
    only = [(b, c) for b, c in attacked if b != newest]
    o = order(_seen(only), rec)
    assert o.current == newest and set(o.regressed) == {b for b, _ in only}


@given(st.permutations(range(1, 7)), st.integers(1, 6))
def test_the_highest_counter_wins_in_any_order(perm: list[int], n: int) -> None:
    boots = [Seen(f"b{c}", c, i, (7 - i) * DAY) for i, c in enumerate(perm[:n])]
    top = max(perm[:n])
    o = order(boots)
    assert o.current == f"b{top}"
    assert o.raise_to is not None and o.raise_to.counter == top
    # every lower boot first seen after the highest one is regressed, none before it
    pos = next(b.order for b in boots if b.counter == top)
    assert set(o.regressed) == {b.boot for b in boots if b.order > pos}


@given(
    st.lists(st.one_of(st.none(), st.integers(1, 9)), min_size=1, max_size=8),
    st.one_of(st.none(), st.integers(1, 9)),
)
def test_unknown_counters(counters: list[int | None], record: int | None) -> None:
    boots = [Seen(f"b{i}", c, i) for i, c in enumerate(counters)]
    rec = None if record is None else Record(record, "ledger")
    o = order(boots, rec)
    known = [b for b in boots if b.counter is not None]
    if not known and rec is None:
        assert o.current == boots[-1].boot  # the old rule: the latest in the stream
        return
    top = max([b.counter or 0 for b in known] + [0 if rec is None else rec.counter])
    holder = next((b for b in boots if b.counter == top), None)
    if rec is not None and rec.counter >= top:
        holder = None  # the ledger's boot holds it (not in this read)
    later = [b for b in boots if b.counter is None and (holder is None or b.order > holder.order)]
    if later:
        assert o.current == later[-1].boot
    else:
        assert o.current == (holder.boot if holder is not None else "ledger")
    # a boot of lower counter is never current; a regressed boot never is
    assert o.current not in o.regressed
    cur = next((b for b in boots if b.boot == o.current), None)
    assert cur is None or cur.counter is None or cur.counter == top


@given(st.lists(st.integers(0, 3 * DAY), min_size=1, max_size=6))
def test_the_old_rule_without_counters(ts: list[int]) -> None:
    boots = [Seen(f"b{i}", None, i, t) for i, t in enumerate(ts)]
    cur = boots[0]
    for b in boots:
        if b.first_ts_ms >= cur.first_ts_ms - REPLAY_BOUND_MS:
            cur = b
    assert order(boots).current == cur.boot


@given(st.integers(1, 9), st.integers(1, 9))
def test_the_record_only_rises(seen: int, record: int) -> None:
    assume(seen != record)
    o = order([Seen("new", seen, 0)], Record(record, "old"))
    assert (o.raise_to is not None) == (seen > record)
    assert o.current == ("new" if seen > record else "old")


# -- the wire: announcements carry bc and bid ----------------------------------------------------


@pytest.mark.parametrize(
    ("bc", "bid", "placed"),
    [("2", "ab" * 16, True), ("-", "ab" * 16, True), ("2", "abcd", False), ("02", "ab" * 16, False),
     ("2", "XY" * 16, False)],
)  # fmt: skip
def test_an_announcement_with_the_boot_counter_is_placed_and_shows_it(
    bc: str, bid: str, placed: bool
) -> None:
    ann = announce_event("bbbb0002", 0, 1_000, SYNTH_KEY)
    ann = replace(ann, fields=(*ann.fields, ("bc", bc), ("bid", bid)))
    line = make_event("phase", "bbbb0002", 1, 2_000, {"ph": "workload", "bc": bc})
    data = (encode(ann, SYNTH_KEY) + "\n" + encode(line, SYNTH_KEY) + "\n").encode()
    tl = parse_bytes(data)
    assert (tl.pin is not None) == placed
    if placed:
        shown = tl.events[0]
        assert shown.get("bc") == bc and shown.get("bid") == bid and shown.get("kid")
        assert tl.boots["bbbb0002"].counter == parse_counter(bc)


@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=6),
)
def test_decoded_replays_of_earlier_boots_never_change_the_current_boot(
    gaps: list[int], rolled: bool, replays: list[tuple[int, int]]
) -> None:
    """The same property on real lines, decoded (the decoder, the timeline, the order): boots
    with rising counters, their lines replayed anywhere after the newest boot's first line."""
    counters = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    boots: list[list[bytes]] = []
    for i, c in enumerate(counters):
        boot = f"{c:08x}"
        ann = announce_event(boot, 0, 1_000 * i, SYNTH_KEY)
        ann = replace(ann, fields=(*ann.fields, ("bc", str(c))))
        ev = make_event("phase", boot, 1, 1_000 * i + 1, {"ph": "workload", "bc": str(c)})
        boots.append([(encode(x, SYNTH_KEY) + "\n").encode() for x in (ann, ev)])
    newest = f"{counters[-1]:08x}"
    window = boots[-1] if rolled else [ln for b in boots for ln in b]
    lines = list(window)
    first = lines.index(boots[-1][0])
    for pos, which in replays:
        if len(boots) > 1:
            copy = boots[which % (len(boots) - 1)][pos % 2]
            lines.insert(first + 1 + pos % (len(lines) - first), copy)
    tl = parse_bytes(b"".join(lines))
    assert tl.latest_boot == newest
