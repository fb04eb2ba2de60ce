"""Issue 38: the decoder's speed may not change what it finds. The same events and counts for
any input whatever the piece size; format_ts against strftime; the signature budget per MiB,
not per ``feed()`` call (docs/serial-protocol.md, "Verifying what decides";
docs/performance.md, "Decode speed, like for like")."""

from __future__ import annotations

import itertools
import zlib
from datetime import UTC, datetime

import pytest
from gce_watchdog.testing.synth import KERNEL_MSG, SYNTH_KEY, Writer, corpus_lines
from gce_watchdog.wire import protocol
from gce_watchdog.wire.protocol import DecodeStats, Event, LineKey, StreamDecoder, decode_all
from hypothesis import given
from hypothesis import strategies as st
from kit.paths import CORPUS

pytestmark = pytest.mark.pure

EVIL = LineKey(bytes(range(1, 33)))
NOISE = [ln.rstrip(b"\r\n") for ln in corpus_lines(CORPUS)[:300]]


def _ours(n: int) -> list[bytes]:
    """A boot's real lines (announcements, ticks, heartbeats, phases, shutdowns), one each."""
    w = Writer(boot="aaaa0001", step_ms=1000)
    kinds = ("tick", "tick", "heartbeat", "phase", "tick", "shutdown")
    out = b"".join(w.line(kinds[i % 6], {"rung": f"{i % 10}/10"}) for i in range(n))
    return out.split(b"\n")[:-1]


OURS = _ours(40)


def _forged_tick(seq: int) -> bytes:
    ev = protocol.make_event("tick", "aaaa0001", seq, 1_800_000_000_000, {"rung": "1/10"})
    body = protocol.encode(ev, SYNTH_KEY).encode()[: -(protocol.SIG_CHARS + 10)]
    signed = body + b" #" + protocol.b64(EVIL.sign(body)).encode()
    return signed + b"%08x" % (zlib.crc32(signed) & 0xFFFFFFFF)


# One console line: noise, one of ours (whole, cut, spliced), a bare marker, a forged tick.
a_line = st.one_of(
    st.sampled_from(NOISE),
    st.sampled_from(OURS),
    st.sampled_from(OURS),
    st.builds(lambda s, k: s[:k], st.sampled_from(OURS), st.integers(0, 280)),
    st.builds(lambda s, k: s[:k] + KERNEL_MSG + s[k:], st.sampled_from(OURS), st.integers(0, 280)),
    st.sampled_from([b"", b"GCEWD3 x", b"GCEWD3 ", b"GCEWD2 y #abc", b"x GCEWD3 3f2a9c1e 1"]),
    st.binary(max_size=40),
)
an_ending = st.sampled_from([b"\n", b"\r\n", b"\r", b"\n\n", b"\r\r\n", b"\n\r"])
streams = st.lists(st.tuples(a_line, an_ending), max_size=80).map(
    lambda xs: b"".join(a + b for a, b in xs)
)

# Counts that cannot depend on where the stream was cut (which line covered which, and the
# checks made, depend on the blocks: docs/serial-protocol.md).
_SAME = ("lines", "events", "rejected", "duplicates", "forged", "retired", "conflicts")


def _counts(st_: DecodeStats) -> tuple[object, ...]:
    return (*(getattr(st_, k) for k in _SAME), st_.reject_reasons, st_.forged_reasons)


def _in_pieces(
    data: bytes, cuts: list[int], budget: int | None = None
) -> tuple[list[Event], StreamDecoder]:
    d = StreamDecoder(pin=SYNTH_KEY.public)
    if budget is not None:
        d.BUDGET_LINES = budget
    got: list[Event] = []
    for a, b in itertools.pairwise([0, *sorted(cuts), len(data)]):
        got += d.feed(data[a:b])
    return got + d.flush(), d


@given(streams, st.lists(st.integers(0, 30_000), max_size=40))
def test_splitting_the_input_anywhere_gives_the_same_events_and_counts(
    data: bytes, cuts: list[int]
) -> None:
    whole, st_whole = decode_all(data, pin=SYNTH_KEY.public)
    got, d = _in_pieces(data, [c % (len(data) + 1) for c in cuts])
    assert got == whole
    assert _counts(d.stats) == _counts(st_whole)
    assert d.stats.unchecked == st_whole.unchecked == 0


@given(streams, st.integers(1, 300))
def test_fixed_pieces_give_the_same_events_and_counts(data: bytes, piece: int) -> None:
    """A reader of a pipe or a socket: pieces of one size, down to one byte. The signature
    budget is not what this checks (a block too small to check its lines leaves them to a
    later one: the same events, later): it is set out of reach here."""
    d0 = StreamDecoder(pin=SYNTH_KEY.public)
    d0.BUDGET_LINES = 10**6
    whole = d0.feed(data) + d0.flush()
    got, d = _in_pieces(data, list(range(piece, len(data), piece)), budget=10**6)
    assert got == whole and _counts(d.stats) == _counts(d0.stats)


@given(st.integers(-(10**13), 10**14))
def test_format_ts_is_strftime_of_the_second(ts_ms: int) -> None:
    dt = datetime.fromtimestamp(ts_ms // 1000, tz=UTC)
    want = dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{ts_ms % 1000:03d}Z"
    assert protocol.format_ts(ts_ms) == want


def _flood(n: int) -> bytes:
    w = Writer(boot="aaaa0001")
    head = w.line("start", {"v": "1"})
    return head + b"".join(_forged_tick(10**6 + i) + b"\n" for i in range(n))


@pytest.mark.parametrize("piece", [0, 64 << 10, 4 << 10, 512])
def test_the_budget_is_per_mib_whatever_the_piece_size(piece: int) -> None:
    """A flood of forged ticks (each one checked on the walk down) under one receive time:
    the checks made are those of the bytes, however small the pieces (they were the fixed
    share per feed() call: 96 per 4 KiB piece)."""
    data = _flood(4000)
    d = StreamDecoder(pin=SYNTH_KEY.public)
    if piece:
        for i in range(0, len(data), piece):
            d.feed(data[i : i + piece], 5.0)
    else:
        d.feed(data, 5.0)
    bound = d.BUDGET_LINES + len(data) // d.CREDIT_BYTES + len(data) // d.BUDGET_BYTES + 1
    assert 0 < d.stats.verified <= bound
    # within the read's first MiB, pieces get no more than the bytes read at once (issue 38:
    # the credit's refill by bytes started at once, 96 checks more per MiB in pieces)
    once = StreamDecoder(pin=SYNTH_KEY.public)
    once.feed(data, 5.0)
    assert d.stats.verified <= once.stats.verified


def test_a_new_read_gets_the_whole_fixed_share_again() -> None:
    """The poller's reads come with their receive time: each new one refills the credit."""
    d = StreamDecoder(pin=SYNTH_KEY.public)
    d.feed(_flood(300), 1.0)  # the flood spends the credit
    spent = d.stats.verified
    d.feed(b"".join(_forged_tick(2 * 10**6 + i) + b"\n" for i in range(200)), 1.0)
    same_read = d.stats.verified - spent
    d.feed(b"".join(_forged_tick(3 * 10**6 + i) + b"\n" for i in range(200)), 2.0)
    new_read = d.stats.verified - spent - same_read
    assert same_read < d.BUDGET_LINES <= new_read


def test_samples_are_the_streams_first_ones_not_per_piece() -> None:
    data = b"GCEWD3 x\r" * 20_000
    d = StreamDecoder(pin=SYNTH_KEY.public)
    rejects = 0
    for i in range(0, len(data), 4096):
        rejects += len(d.decode(data[i : i + 4096]).rejects)
    rejects += len(d.finish().rejects)
    assert d.stats.rejected == 20_000 and rejects == d.MAX_SAMPLES
