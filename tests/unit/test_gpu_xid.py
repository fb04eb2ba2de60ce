"""The Xid table and parser (gpu/xid.py), the kmsg record parser (gpu/kmsg.py) and the episode and
second-signal rules (gpu/episode.py): pure cores, tested against published records and by
properties."""

from __future__ import annotations

from pathlib import Path

import pytest
from gce_watchdog.gpu import episode, kmsg, xid
from gce_watchdog.gpu.episode import Episodes, GpuDecision, SecondSignal
from gce_watchdog.gpu.xid import XidClass, XidRecord
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "kmsg" / "xid-records.txt"

# The references, as published (see gpu/xid.py's docstring): a change to the table that is not
# also a change here fails.
EKS_WELL_KNOWN_XIDS = [
    46,
    48,
    54,
    62,
    63,
    64,
    74,
    79,
    95,
    109,
    110,
    119,
    120,
    136,
    140,
    142,
    143,
    151,
    155,
    156,
    158,
]
DEVICE_PLUGIN_SKIPPED_XIDS = [13, 31, 43, 45, 68, 109]


def test_table_matches_the_references() -> None:
    assert sorted(xid.HARDWARE_XIDS) == EKS_WELL_KNOWN_XIDS
    # 109 is on both anchors' lists; the EKS list wins (hardware, and still needs a second signal).
    assert sorted(xid.APPLICATION_XIDS) == [x for x in DEVICE_PLUGIN_SKIPPED_XIDS if x != 109]
    assert not xid.HARDWARE_XIDS & xid.APPLICATION_XIDS


@given(st.integers(min_value=0, max_value=xid.MAX_XID))
def test_classify_is_total_and_follows_the_table(n: int) -> None:
    c = xid.classify(n)
    assert (c is XidClass.HARDWARE) == (n in xid.HARDWARE_XIDS)
    assert (c is XidClass.APPLICATION) == (n in xid.APPLICATION_XIDS)


def _records() -> list[kmsg.KmsgRecord]:
    blob = FIXTURE.read_bytes()
    recs = [
        kmsg.parse_record(line) for line in blob.split(b"\n") if line and not line.startswith(b" ")
    ]
    return [r for r in recs if r is not None]


def test_published_records_parse() -> None:
    recs = _records()
    assert [r.seq for r in recs] == list(range(1201, 1210))
    parsed = [(r.facility, xid.parse_xid(r.message)) for r in recs]
    got = [(f, p.pci, p.xid, p.pid) for f, p in parsed if p is not None]
    assert got == [
        (0, "0000:00:04", 79, 1234),
        (0, "0000:cb:00", 13, None),
        (0, "0000:3b:00", 48, 2211),
        (0, "0000:3b:00", 63, 2211),
        (0, "0000:00:05", 45, 991),
        (0, "0000:03:00", 31, None),
        (0, "0000:00:04", 94, 1234),
        (1, "0000:00:04", 79, 1),  # PRI 14: facility 1, a user-space forgery
    ]
    assert recs[-1].from_kernel is False
    assert recs[0].message.endswith("GPU has fallen off the bus.")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"garbage",
        b"6,1,2;",
        b"x,1,2,-;m",
        b"6,1;m",
        b"6,1,2,-",
        b"99999,1,2,-;m",
        b"-6,1,2,-;m",
    ],
)
def test_malformed_records_are_none(raw: bytes) -> None:
    assert kmsg.parse_record(raw) is None


def test_three_fields_are_not_a_record() -> None:
    assert kmsg.parse_record(b"6,1,2;m") is None
    assert kmsg.parse_record(b"6,1,2,-;m") == kmsg.KmsgRecord(0, 6, 1, 2, "m")


@given(st.binary(max_size=512))
def test_parse_record_never_raises(raw: bytes) -> None:
    rec = kmsg.parse_record(raw)
    if rec is not None:
        assert 0 <= rec.level <= 7 and rec.facility >= 0 and "\n" not in rec.message


@given(st.text(max_size=300))
def test_parse_xid_never_raises_and_text_is_bounded(message: str) -> None:
    rec = xid.parse_xid(message)
    if rec is not None:
        assert len(rec.text) <= xid.TEXT_MAX and rec.text.isprintable()


@given(
    pri=st.integers(0, 1023),
    seq=st.integers(0, 2**63),
    usec=st.integers(0, 2**63),
    msg=st.text(
        alphabet=st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=80
    ),
)
def test_parse_record_round_trips_the_abi(pri: int, seq: int, usec: int, msg: str) -> None:
    raw = f"{pri},{seq},{usec},-;{msg}\n SUBSYSTEM=pci\n".encode()
    rec = kmsg.parse_record(raw)
    assert rec == kmsg.KmsgRecord(pri >> 3, pri & 7, seq, usec, msg)


def _rec(pci: str = "0000:00:04", n: int = 79) -> XidRecord:
    return XidRecord(pci, n, None, "")


def test_a_flood_of_one_xid_is_one_episode() -> None:
    state, said = Episodes(), 0
    for i in range(800_000 // 1000):  # 800 records 0.01 s apart stand for the flood's shape
        state, new = episode.observe(state, _rec(n=95), i * 0.01, quiet=60.0)
        said += new
    assert said == 1
    state, new = episode.observe(state, _rec(n=95), 8.0 + 60.0, quiet=60.0)
    assert new  # a quiet minute later: a new episode


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]), st.sampled_from([79, 48, 13]), st.floats(0, 10)
        ),
        max_size=60,
    )
)
def test_episodes_open_once_per_key_and_quiet_gap(events: list[tuple[str, int, float]]) -> None:
    state, now, last = Episodes(), 0.0, {}
    for pci, n, gap in events:
        now += gap
        state, new = episode.observe(state, _rec(pci, n), now, quiet=5.0)
        key = (pci, n)
        assert new == (key not in last or now - last[key] >= 5.0)
        last[key] = now
    assert len(state.last_seen) <= episode.MAX_EPISODES


def test_episode_memory_is_bounded() -> None:
    state = Episodes()
    for i in range(episode.MAX_EPISODES * 3):
        state, _ = episode.observe(state, _rec(f"0000:{i:04x}:00"), float(i), quiet=60.0)
    assert len(state.last_seen) == episode.MAX_EPISODES


@pytest.mark.parametrize("cls", list(XidClass))
@pytest.mark.parametrize("signal", list(SecondSignal))
@pytest.mark.parametrize("unanswered", [0.0, 59.9, 60.0, float("inf")])
def test_decide_needs_a_hardware_xid_and_a_second_signal(
    cls: XidClass, signal: SecondSignal, unanswered: float
) -> None:
    got = episode.decide(cls, signal, unanswered, window=60.0)
    fault = (
        cls is XidClass.HARDWARE
        and signal is not SecondSignal.NONE
        and (signal is not SecondSignal.NVML_UNANSWERED or unanswered >= 60.0)
    )
    assert got is (GpuDecision.FAULT if fault else GpuDecision.EVENT)


def test_xid_45_never_decides_alone_or_with_a_signal() -> None:
    for signal in SecondSignal:
        assert episode.decide(xid.classify(45), signal, float("inf"), 0.0) is GpuDecision.EVENT


def test_nan_window_never_decides() -> None:
    assert (
        episode.decide(XidClass.HARDWARE, SecondSignal.NVML_UNANSWERED, float("nan"), 60.0)
        is GpuDecision.EVENT
    )
