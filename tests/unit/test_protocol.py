"""Protocol v3: round trip, damage, authentication, the real serial corpus as background noise."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
from gce_watchdog.testing.synth import SYNTH_KEY as K
from gce_watchdog.wire import line as wire_line
from gce_watchdog.wire import protocol
from gce_watchdog.wire.protocol import (
    Event,
    ProtocolError,
    Rejected,
    decode_all,
    decode_line,
    encode,
)
from hypothesis import given
from hypothesis import strategies as st
from kit.paths import CORPUS

pytestmark = pytest.mark.pure

P = K.public

keys = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)
values = st.from_regex(r"[A-Za-z0-9._:/@,+%~()<>\[\]-]{1,20}", fullmatch=True)
texts = st.one_of(
    st.just(""),
    st.from_regex(r"[A-Za-z0-9][\x20-\x22\x24-\x7e]{0,30}[A-Za-z0-9)]", fullmatch=True),
)
events = st.builds(
    Event,
    event=st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True),
    boot=st.from_regex(r"[0-9a-f]{8}", fullmatch=True),
    seq=st.integers(0, 10**9),
    ts_ms=st.integers(0, 4_102_444_800_000),  # up to 2100-01-01
    fields=st.lists(st.tuples(keys, values), max_size=4, unique_by=lambda kv: kv[0]).map(tuple),
    text=texts,
)


def ev(**kw: object) -> Event:
    base = dict(
        event="tick",
        boot="3f2a9c1e",
        seq=42,
        ts_ms=1_796_000_000_123,
        fields=(("rung", "3/10"), ("md", "fail/timeout/5001")),
        text="BOTH reachability probes FAILED (3/10)",
    )
    base.update(kw)
    return Event(**base)  # type: ignore[arg-type]


@given(events)
def test_round_trip(e: Event) -> None:
    try:
        line = encode(e, K)
    except ProtocolError:
        return  # too long for 200 bytes: refused loudly, which is the contract
    assert len(line) <= protocol.MAX_LINE and line.isascii()
    assert decode_line(line, pin=P) == e
    assert decode_line(line.encode() + b"\r\n\x00", pin=P) == e


def test_example_line_is_readable_and_checksummed() -> None:
    line = encode(ev(), K)
    assert line.startswith("GCEWD3 3f2a9c1e 42 2026-")
    assert "| BOTH reachability probes FAILED (3/10) #" in line
    body, trailer = line.rsplit(" #", 1)
    assert len(trailer) == protocol.SIG_CHARS + 8
    signed = f"{body} #{trailer[:-8]}".encode()
    assert trailer[-8:] == f"{zlib.crc32(signed):08x}"  # the CRC covers the signature too
    sig = protocol.unb64(trailer[:-8])
    assert protocol.verify(K.public, body.encode(), sig)
    assert not protocol.verify(K.public, body.encode()[:-1] + b"X", sig)


@pytest.mark.parametrize(
    "bad",
    [
        ev(event="Tick"),
        ev(boot="XYZ"),
        ev(fields=(("k", "has space"),)),
        ev(fields=(("k", "a"), ("k", "b"))),
        ev(text="hash # inside"),
        ev(seq=-1),
        ev(fields=tuple((f"k{i}", "v" * 30) for i in range(8))),
    ],
)
def test_encode_refuses_bad_events(bad: Event) -> None:
    with pytest.raises(ProtocolError):
        encode(bad, K)


def test_make_event_sanitizes_and_shortens_or_drops_text_when_too_long() -> None:
    # v3 lines leave fields and text 184 bytes (v2: 174): a field more makes the text too long
    fields = {"reason": "Errno 111 refused\n", "host": "h" * 20}
    e = protocol.make_event("tick", "3f2a9c1e", 1, 0, fields, "x" * 150)
    assert e.get("reason") == "Errno_111_refused_" and e.text.endswith("...")
    assert decode_line(encode(e, K), pin=P) == e
    long_fields = {f"f{i}": "v" * 20 for i in range(4)}
    e2 = protocol.make_event("tick", "3f2a9c1e", 1, 0, long_fields, "some text " * 8)
    assert e2.text.endswith("...") and "some text some" in e2.text
    assert len(encode(e2, K)) <= protocol.MAX_LINE and decode_line(encode(e2, K), pin=P) == e2
    long_fields = {f"f{i}": "v" * 24 for i in range(5)}
    e3 = protocol.make_event("tick", "3f2a9c1e", 1, 0, long_fields, "some text " * 8)
    assert e3.text == "" and decode_line(encode(e3, K), pin=P) == e3  # under MIN_TEXT: dropped


def test_damage_is_rejected_never_misread() -> None:
    line = encode(ev(), K).encode()
    spliced = line[:30] + b"[   12.345678] eth0: link down" + line[30:]
    assert isinstance(decode_line(spliced, pin=P), Rejected)
    for cut in range(len(line) - 1):
        assert isinstance(decode_line(line[:cut] or b"GCEWD2", pin=P), Rejected | type(None))
    flipped = bytearray(line)
    flipped[40] ^= 0x01
    assert isinstance(decode_line(bytes(flipped), pin=P), Rejected)
    # ANSI colour, CR, NUL around an intact line: found
    assert decode_line(b"\x1b[0;32m\x00" + line + b"\r", pin=P) == ev()
    # a kernel message glued after our checksum (before our newline): the line still counts
    assert decode_line(line + b"[ 3.1] audit: type=1400", pin=P) == ev()
    assert decode_line(b"plain console output", pin=P) is None


def test_stream_decoder_joins_splits_and_dedupes() -> None:
    a = encode(ev(seq=1), K).encode() + b"\r\n"
    b = encode(ev(seq=2), K).encode() + b"\n"
    journal_copy = b"Nov 17 04:03:47 vm gce-watchdog[5]: " + a
    data = b"boot noise\n" + a + journal_copy + b + b"GCEWD3 3f2a9c1e 3 trunc"
    for cut in range(0, len(data), 7):
        d = protocol.StreamDecoder(pin=P)
        got = d.feed(data[:cut]) + d.feed(data[cut:]) + d.flush()
        assert [e.seq for e in got] == [1, 2]
        assert d.stats.duplicates == 1 and d.stats.rejected == 1


def test_garbage_never_raises_never_yields_false_events() -> None:
    rnd = random.Random(1234)
    good = encode(ev(), K).encode()
    for _ in range(20_000):
        n = rnd.randrange(0, 260)
        blob = bytes(rnd.randrange(256) for _ in range(n))
        if rnd.random() < 0.5:  # mutate a good line instead of pure noise
            b = bytearray(good)
            for _ in range(rnd.randrange(1, 4)):
                b[rnd.randrange(len(b))] = rnd.randrange(256)
            blob = bytes(b)
        res = decode_line(blob, pin=P)
        if isinstance(res, Event):
            assert encode(res, K).encode() in blob  # only an intact encoded line is accepted


def _corpus_files() -> list[Path]:
    assert CORPUS.is_dir(), f"serial corpus not found at {CORPUS}"
    files = sorted(CORPUS.glob("*.log"))
    assert files
    return files


def test_corpus_holds_nothing_of_ours_and_our_lines_are_found_in_it() -> None:
    for f in _corpus_files():
        data = f.read_bytes()
        events, stats = decode_all(data)
        assert events == [] and stats.rejected == 0 and stats.forged == 0, f.name
        # interleave our lines into the real noise, including mid-line after a printk
        lines = data.split(b"\n")
        ours = [encode(ev(seq=i), K) for i in range(25)]
        out = []
        step = max(1, len(lines) // 25)
        for i, ln in enumerate(lines):
            out.append(ln)
            if i % step == 0 and i // step < 25:
                out.append(ours[i // step].encode() + b"\r")
        got, stats = decode_all(b"\n".join(out), pin=P)
        assert [e.seq for e in got] == list(range(min(25, len(range(0, len(lines), step)))))
        assert stats.rejected == 0


def test_dedup_memory_is_bounded_over_a_long_run() -> None:
    d = protocol.StreamDecoder(pin=P)
    n = 3 * protocol.StreamDecoder.DEDUP_WINDOW
    data = b"".join(encode(ev(seq=i, text=""), K).encode() + b"\n" for i in range(n))
    assert len(d.feed(data)) == n
    assert len(d._seen) <= protocol.StreamDecoder.DEDUP_WINDOW
    recent_copy = encode(ev(seq=n - 3, text=""), K).encode() + b"\n"
    assert d.feed(recent_copy) == [] and d.stats.duplicates == 1
    # A copy older than the window (by arrival) is reported again: shown twice, never lost.
    late_copy = encode(ev(seq=5, text=""), K).encode() + b"\n"
    assert [e.seq for e in d.feed(late_copy)] == [5]


def test_make_event_shortens_the_longest_values_when_the_fields_alone_do_not_fit() -> None:
    fields = {"rung": "3/10", "md": "m" * 64, "eg": "e" * 64, "ph": "p" * 64}
    e = protocol.make_event("tick", "3f2a9c1e", 10**9, 0, fields, "text")
    line = encode(e, K)
    assert len(line) == protocol.MAX_LINE and e.text == ""
    assert e.get("rung") == "3/10"  # the short, structured value is kept whole
    assert decode_line(line, pin=P) == e
    with pytest.raises(ProtocolError):  # a bad key is a bug: still loud
        protocol.make_event("tick", "3f2a9c1e", 1, 0, {"Bad": "v" * 64, "md": "m" * 200})
    with pytest.raises(ProtocolError):  # far too many fields even at one byte each
        protocol.make_event("tick", "3f2a9c1e", 1, 0, {f"key{i}": "v" for i in range(40)})


def _parse_ts_reference(s: str) -> int | None:
    """The timestamp rule as first written (a regex, then datetime): parse_ts's oracle."""
    import re
    from datetime import UTC, datetime

    m = re.match(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)\.(\d{3})Z\Z", s)
    if not m:
        return None
    try:
        y, mo, d, h, mi, sec, ms = (int(g) for g in m.groups())
        dt = datetime(y, mo, d, h, mi, sec, tzinfo=UTC)
    except ValueError:
        return None
    return int(dt.timestamp()) * 1000 + ms


_TS_CHARS = st.sampled_from("0123456789-T:.Z 9\u0663x")  # \u0663: a non-ASCII decimal digit


@given(
    st.one_of(
        st.datetimes(min_value=__import__("datetime").datetime(1970, 1, 2)).map(
            lambda d: d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"
        ),
        st.text(_TS_CHARS, min_size=22, max_size=26),
        st.builds(
            lambda *v: "{:04d}-{:02d}-{:02d}T{:02d}:{:02d}:{:02d}.{:03d}Z".format(*v),
            st.integers(1970, 9999),
            st.integers(0, 13),
            st.integers(0, 32),
            st.integers(0, 25),
            st.integers(0, 61),
            st.integers(0, 61),
            st.integers(0, 999),
        ),
        st.text(max_size=30),
    )
)
def test_parse_ts_is_the_reference_rule(s: str) -> None:
    assert protocol.parse_ts(s) == _parse_ts_reference(s)


def test_the_decoders_event_constructor_is_the_dataclass_constructor() -> None:
    """wire_line._new_event skips the frozen dataclass's setattr calls: the same object, field
    for field (a field added to Event and not to _new_event fails here)."""
    import dataclasses

    args = ("tick", "3f2a9c1e", 5, 1_000, (("rung", "3/10"),), "a text")
    for extra in ((), (True, 2.5)):
        fast = wire_line._new_event(*args, *extra)  # type: ignore[arg-type]
        slow = Event(*args, *extra)  # type: ignore[arg-type]
        assert vars(fast) == vars(slow)
        assert set(vars(fast)) == {f.name for f in dataclasses.fields(Event)}
        assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.seq = 6  # type: ignore[misc]


def _parse_body_reference(body: str) -> Event | None:
    """The body rule token by token (the decoder's _parse_body before its caches)."""
    import re

    head, text = body, ""
    if " | " in body:
        head, text = body.split(" | ", 1)
    elif body.endswith(" |"):
        return None
    tokens = head.split(" ")
    if len(tokens) < 5 or not re.fullmatch(r"GCEWD[123]", tokens[0]):
        return None
    _marker, boot, seq_s, ts_s, name, *kvs = tokens
    if not re.fullmatch(r"[0-9a-f]{8}", boot) or not re.fullmatch(r"0|[1-9][0-9]*", seq_s):
        return None
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,23}", name):
        return None
    ts_ms = protocol.parse_ts(ts_s)
    fields = []
    for kv in kvs:
        m = re.fullmatch(r"([a-z][a-z0-9_]{0,23})=([A-Za-z0-9._:/@,+%~()<>\[\]-]{1,64})", kv)
        if m is None:
            return None
        fields.append((m.group(1), m.group(2)))
    if ts_ms is None or len({k for k, _ in fields}) != len(fields):
        return None
    if text and (re.search(r"[^\x20-\x22\x24-\x7e]", text) or text != text.strip()):
        return None
    return Event(name, boot, int(seq_s), ts_ms, tuple(fields), text)


_MUTANT_CHARS = st.sampled_from(" =|#-_aZ09:.\t\u0663")


@given(
    events,
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 2), _MUTANT_CHARS), max_size=3),
    st.sampled_from(["GCEWD3", "GCEWD2", "GCEWD1"]),
)
def test_parse_body_is_the_token_rule(
    e: Event, edits: list[tuple[int, int, str]], marker: str
) -> None:
    """The cached parse (fields and text checks memoized, the event built without the
    dataclass's setattr) gives what the rule token by token gives, on real bodies and on
    bodies with a few characters inserted, replaced or deleted; asked twice (cache hits)."""
    body = wire_line._body(e, marker)
    for at, op, ch in edits:
        at = at % (len(body) + 1)
        if op == 0:
            body = body[:at] + ch + body[at:]
        elif op == 1:
            body = body[:at] + ch + body[at + 1 :]
        else:
            body = body[:at] + body[at + 1 :]
    want = _parse_body_reference(body)
    for _ in range(2):
        got = wire_line._parse_body(body)
        assert got == want
        if got is not None:
            assert vars(got) == vars(want)  # type: ignore[arg-type]
