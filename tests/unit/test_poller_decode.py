"""Decoding realistic serial logs: real GCE console output, our lines, and real damage."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from gce_watchdog.poller.timeline import Timeline, parse_bytes
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind, decide
from gce_watchdog.testing.synth import (
    CORPUS_ENV,
    KERNEL_MSG,
    SYNTH_KEY,
    Writer,
    corpus_dir,
    corpus_files,
    corpus_lines,
    realistic_dump,
    splice,
)
from gce_watchdog.wire.protocol import Event, decode_all, decode_line, encode
from hypothesis import given
from hypothesis import strategies as st
from kit.corpus import file_lines, scenario_one_boot_with_damage, weave
from kit.paths import CORPUS

pytestmark = pytest.mark.pure


def test_the_corpus_is_vendored_with_its_sources() -> None:
    """A clean clone holds the real corpus: no test may skip for want of it."""
    assert corpus_dir(CORPUS) == CORPUS
    files = corpus_files(CORPUS)
    assert len(files) == 10
    assert sum(f.stat().st_size for f in files) > 1_000_000
    sources = (CORPUS / "SOURCES.md").read_text()
    assert all(f.name in sources for f in files)
    # kept byte for byte: the gcpdiag dumps still carry their CRLF endings
    assert b"\r\n" in (CORPUS / "debian11-workbench-notebook-boot-ok.log").read_bytes()


def test_the_kit_finds_no_corpus_by_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gce_watchdog.testing ships in the wheel: it never reaches into a checkout's tests/data.
    The caller names the corpus (or $GCE_WATCHDOG_SERIAL_CORPUS does)."""
    monkeypatch.delenv(CORPUS_ENV, raising=False)
    assert corpus_dir() is None
    assert corpus_dir(tmp_path) is None  # a directory without dumps is no corpus
    (tmp_path / "a.log").write_bytes(b"console\n")
    monkeypatch.setenv(CORPUS_ENV, str(tmp_path))
    assert corpus_dir(CORPUS) == tmp_path  # the variable wins over the caller's default
    with pytest.raises(FileNotFoundError, match="no serial corpus"):
        realistic_dump(1024, directory=tmp_path / "missing")


def test_nothing_in_the_real_corpus_decodes_as_ours() -> None:
    files = corpus_files(CORPUS)
    assert len(files) >= 5
    for p in files:
        events, stats = decode_all(p.read_bytes())
        assert events == [], p.name
        assert stats.rejected == 0, p.name  # the marker never appears in real output
        assert stats.lines > 0


def test_realistic_log_with_damage_exact_events_and_verdict() -> None:
    data, expected, w = scenario_one_boot_with_damage()
    tl = parse_bytes(data)
    assert tl.events == expected
    assert [e.event for e in tl.events] == [
        "key",  # v3: the announcement takes seq 0 and 1
        "key",
        "phase",
        "start",
        "phase",
        "tick",
        "tick",
        "tick",
        "shutdown",
    ]
    assert tl.rejected == 3  # spliced, truncated, bare marker
    assert tl.duplicates == 1
    assert tl.lost_lines == 2  # the spliced heartbeat and the truncated tick
    assert [(g.after, g.next) for g in tl.seq_gaps] == [(3, 5), (5, 7)]
    assert tl.forged == 0
    v = tl.judge(InstanceState("TERMINATED"), w.ts_ms / 1000, Policy())
    assert v.kind is VerdictKind.SELF_SHUTDOWN and v.failover
    assert v.boot == "aaaa0001"
    assert "reason=ladder" in v.evidence[0]


def test_reboot_in_the_middle_only_latest_boot_decides() -> None:
    first = file_lines("debian11-uefi-boot-ssh-restart-killed-oslogin.log")
    second = file_lines("bigip-ve-centos7-cloud-init-reboot.log")
    w = Writer(boot="aaaa0001")
    a = {
        50: w.line("phase", {"ph": "workload"}),
        900: w.line("shutdown", {"reason": "ladder", "rung": "10/10"}),
    }
    w.reboot("bbbb0002")
    b = {
        30: w.line("start", {"v": "0.1.0"}),
        60: w.line("phase", {"ph": "bootstrap"}),
        # the reboot cuts a line: the second boot's first line glues onto it
        200: w.line("setup_failed", {"step": "fetch_uv", "reason": "dns", "rc": 6}),
    }
    data = weave(first, a) + weave(second, b)
    tl = parse_bytes(data)
    assert [(e.boot, e.seq, e.event) for e in tl.events] == [
        ("aaaa0001", 0, "key"),
        ("aaaa0001", 1, "key"),
        ("aaaa0001", 2, "phase"),
        ("aaaa0001", 3, "shutdown"),
        ("bbbb0002", 0, "key"),
        ("bbbb0002", 1, "key"),
        ("bbbb0002", 2, "start"),
        ("bbbb0002", 3, "phase"),
        ("bbbb0002", 4, "setup_failed"),
    ]
    assert list(tl.boots) == ["aaaa0001", "bbbb0002"]
    assert tl.latest_boot == "bbbb0002"
    # the earlier boot's ladder shutdown does not count: the job is broken, no failover
    v = tl.judge(InstanceState("TERMINATED"), w.ts_ms / 1000, Policy())
    assert v.kind is VerdictKind.SETUP_FAILED and not v.failover
    assert v.boot == "bbbb0002"


def test_silent_workload_is_a_wedge_only_after_the_drain_timeout() -> None:
    console = file_lines("debian11-workbench-notebook-boot-ok.log")
    w = Writer(boot="cccc0003")
    ins = {
        100: w.line("start", {"v": "0.1.0"}),
        200: w.line("phase", {"ph": "workload"}),
        300: w.line("heartbeat", {"rung": "0/10", "ph": "workload", "ticks": 10}),
    }
    last = 5_000_000.0  # when the reader received the dump, on its own clock
    tl = parse_bytes(weave(console, ins), rx=last)
    running = InstanceState("RUNNING")
    assert tl.judge(running, last + 60, Policy()).kind is VerdictKind.HEALTHY
    assert tl.judge(running, last + 900, Policy()).kind is VerdictKind.HEALTHY
    v = tl.judge(running, last + 901, Policy())
    assert v.kind is VerdictKind.SUSPECTED_WEDGE and v.failover


def test_realistic_dump_builder_is_decoded_exactly() -> None:
    data, expected = realistic_dump(256 * 1024, directory=CORPUS)
    assert 256 * 1024 - 300 < len(data) <= 256 * 1024
    events, stats = decode_all(data)
    assert events == expected
    assert len(expected) > 100
    assert stats.rejected <= 1  # at most the line cut by the size limit


# -- chunk boundaries -------------------------------------------------------------------------


def _small_realistic() -> tuple[bytes, list[Event]]:
    lines = corpus_lines(CORPUS)[:400]
    w = Writer(boot="dddd0004", step_ms=1000)
    ins = {i: w.line("tick", {"rung": f"{i % 10}/10", "ph": "workload"}) for i in range(0, 400, 9)}
    ins[126] = splice(ins[126])
    data = weave([ln if ln.endswith(b"\n") else ln + b"\n" for ln in lines], ins)
    return data, parse_bytes(data).events


_SMALL = _small_realistic()


@given(st.lists(st.integers(min_value=0, max_value=len(_SMALL[0])), max_size=60))
def test_events_identical_whatever_the_chunk_boundaries(cuts: list[int]) -> None:
    data, expected = _SMALL
    bounds = [0, *sorted(cuts), len(data)]
    tl = Timeline()
    got: list[Event] = []
    for a, b in itertools.pairwise(bounds):
        got += tl.feed(data[a:b])
    got += tl.finish()
    assert got == expected
    assert tl.rejected == 1


# -- fuzz ------------------------------------------------------------------------------------


def _valid_lines(rng: random.Random, n: int) -> list[str]:
    w = Writer(boot="eeee0005", step_ms=1234)
    names = ["tick", "heartbeat", "phase", "exit", "shutdown", "start", "preempted", "x_custom"]
    out = []
    for _ in range(n):
        fields = {
            f"k{j}": rng.choice(["fail", "ok", "3/10", "a.b:c", "-", "12345"])
            for j in range(rng.randint(0, 5))
        }
        text = rng.choice(["", "BOTH reachability probes FAILED (3/10)", "done"])
        out.append(encode(w.event(rng.choice(names), fields, text), SYNTH_KEY))
    return out


def _mutate(rng: random.Random, line: bytes, pool: list[bytes]) -> bytes:
    b = bytearray(line)
    op = rng.randrange(9)
    if op == 0 and b:  # flip one bit
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1 and b:  # delete a byte
        del b[rng.randrange(len(b))]
    elif op == 2:  # insert a random byte
        b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
    elif op == 3:  # truncate
        del b[rng.randrange(len(b) + 1) :]
    elif op == 4:  # splice a kernel message
        i = rng.randrange(len(b) + 1)
        b[i:i] = KERNEL_MSG
    elif op == 5:  # two lines glued, one cut
        other = rng.choice(pool)
        b = b[: rng.randrange(len(b) + 1)] + bytearray(other[rng.randrange(len(other)) :])
    elif op == 6:  # replace a byte with a structural one
        if b:
            b[rng.randrange(len(b))] = rng.choice(b" #|=\r\x00\n")
    elif op == 7:  # random bytes with the marker inside
        junk = bytearray(rng.randbytes(rng.randrange(0, 120)))
        junk[rng.randrange(len(junk) + 1) : 0] = rng.choice([b"GCEWD3 ", b"GCEWD2 ", b"GCEWD1 "])
        b = junk
    else:  # pure random bytes
        b = bytearray(rng.randbytes(rng.randrange(0, 220)))
    return bytes(b)


def test_fuzz_decoder_no_exception_no_false_event() -> None:
    rng = random.Random(20261130)
    originals = _valid_lines(rng, 500)
    pool = [s.encode() for s in originals]
    known = set(originals)
    n = 100_000
    accepted = rejected = 0
    for _ in range(n):
        raw = _mutate(rng, rng.choice(pool), pool)
        if rng.random() < 0.3:  # sometimes mutate twice
            raw = _mutate(rng, raw, pool)
        res = decode_line(raw, pin=SYNTH_KEY.public)
        if isinstance(res, Event):
            line = encode(res, SYNTH_KEY)
            # an event is accepted only when it is exactly one that was encoded, present whole
            assert line in known, raw
            assert line.encode() in raw, raw
            accepted += 1
        elif res is not None:
            rejected += 1
    # (v3 lines are ~100 bytes longer than v2: more mutations land in them, fewer stay whole)
    assert accepted > 300 and rejected > 10_000  # the mix exercises both paths


def test_fuzz_stream_decoder_on_concatenated_garbage() -> None:
    rng = random.Random(7)
    originals = _valid_lines(rng, 200)
    pool = [s.encode() for s in originals]
    blob = b"".join(
        (_mutate(rng, rng.choice(pool), pool) if rng.random() < 0.5 else rng.choice(pool))
        + rng.choice([b"\n", b"\r\n", b"", b"\x00"])
        for _ in range(5000)
    )
    events, _ = decode_all(blob, pin=SYNTH_KEY.public)
    known = set(originals)
    assert events and all(encode(e, SYNTH_KEY) in known for e in events)


def test_compaction_keeps_the_first_terminal_event_behind_a_long_tail() -> None:
    # A finished job whose VM stays up on a flapping network: hundreds of `recovered` lines,
    # then the ladder shuts it down. Saving the cursor compacts the timeline; the `exit rc=0`
    # must survive it, or the ladder shutdown becomes "first" and a finished job fails over.
    w = Writer(boot="dddd0004")
    data = w.line("start", {"v": "0.1.0"}) + w.line("phase", {"ph": "workload"})
    data += w.line("exit", {"rc": 0, "sig": "-"})
    for _ in range(600):
        data += w.line("recovered", {"from": "1/10", "md": "ok", "eg": "ok"})
    data += w.line("shutdown", {"reason": "ladder", "rung": "10/10"})
    tl = Timeline.from_json(json.loads(json.dumps(parse_bytes(data).to_json())))
    assert len(tl.events) < 600  # it was compacted
    v = decide(tl.events, InstanceState("RUNNING"), w.ts_ms / 1000, Policy())
    assert v.kind is VerdictKind.WORKLOAD_OK and not v.failover
