"""Issue 25: the line key never changes silently, and a key problem is an alarm, never a
failover. The agent's side (``vm.state.load_line_key``, the emitter's ``warn what=key``) and the
reader's (a pinned ephemeral key followed by another key: the silence is not judged)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import KEY_FILE, SeqAllocator, inspect_line_key, load_line_key
from gce_watchdog.wire import protocol

pytestmark = pytest.mark.pure

RUN = InstanceState("RUNNING")
POL = Policy()


def _emit(state: Path, run: Path, boot: str, events: list[tuple[str, dict[str, object]]],
          t0: float = 1_800_000_000.0) -> tuple[bytes, protocol.LineKey]:  # fmt: skip
    """What one writer process puts on the console: load the key as the CLI does, write."""
    ks = load_line_key(state, run)
    key = protocol.LineKey(ks.seed, ks.ephemeral)
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(run, boot), boot, lambda: t0, key=key,
                 key_problems=ks.problems)  # fmt: skip
    for name, fields in events:
        em.emit(name, fields)
    return "".join(x + "\n" for x in sink.lines).encode(), key


def test_a_key_file_made_0644_is_kept_reported_and_a_finished_job_is_not_failed_over(
    tmp_path: Path,
) -> None:
    state, run = tmp_path / "state", tmp_path / "run"
    first, key = _emit(state, run, "aaaa0001", [("phase", {"ph": "workload"})])
    (state / KEY_FILE).chmod(0o644)  # a backup restore, config management
    ks = load_line_key(state, run)
    assert ks.seed and not ks.ephemeral and any("mode 0644" in p for p in ks.problems)
    assert protocol.LineKey(ks.seed).public == key.public  # the same key: never replaced
    later, key2 = _emit(state, run, "aaaa0001", [("exit", {"rc": 0, "sig": "-", "dur": 9})])
    assert key2.public == key.public
    tl = parse_bytes(first + later, rx=100.0)
    assert tl.forged == 0 and tl.pin == key.public
    warns = [e for e in tl.events if e.event == "warn"]
    assert [w.get("what") for w in warns] == ["key"] and "mode 0644" in warns[0].text
    v = tl.judge(InstanceState("TERMINATED"), 100.0 + 3600, POL)
    assert v.kind is VerdictKind.WORKLOAD_OK and not v.failover
    st = inspect_line_key(state, run)
    assert st is not None and any("0644" in p for p in st.problems)


def test_a_key_path_that_is_a_directory_still_lets_every_line_be_written(tmp_path: Path) -> None:
    state, run = tmp_path / "state", tmp_path / "run"
    (state / KEY_FILE).mkdir(parents=True)
    ks = load_line_key(state, run)
    assert ks.ephemeral and any("not a regular file" in p for p in ks.problems)
    assert (state / KEY_FILE).is_dir()  # not replaced
    data, _ = _emit(state, run, "aaaa0001", [("phase", {"ph": "workload"}), ("heartbeat", {})])
    tl = parse_bytes(data, rx=10.0)
    assert [e.event for e in tl.events] == ["key", "key", "phase", "warn", "heartbeat"]
    assert tl.ephemeral and "ephemeral_key" in tl.key_alarm and tl.forged == 0
    again = load_line_key(state, run)  # the next command of this boot: the same run-dir key
    assert again.seed == ks.seed


def _no_state(tmp_path: Path) -> tuple[Path, Path]:
    """State and run dirs that cannot be created (their parent is a file): nothing can keep
    a key, as with a full or read-only disk at the instance's first line."""
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    return blocker / "state", blocker / "run"


def test_no_writable_state_at_first_boot_gives_an_alarm_never_a_failover(tmp_path: Path) -> None:
    state, run = _no_state(tmp_path)
    ks = load_line_key(state, run)
    assert ks.ephemeral and ks.path is None and ks.problems
    # boot 1 (its lines pinned: the first line, read from byte 0), then a reboot: the next
    # process has another key of its own; the VM is healthy and writes heartbeats
    boot1, k1 = _emit(state, tmp_path / "r1", "aaaa0001", [("phase", {"ph": "workload"})])
    boot2, k2 = _emit(state, tmp_path / "r2", "bbbb0002", [("heartbeat", {"rung": "0/10"})])
    assert k1.public != k2.public and k1.ephemeral and k2.ephemeral
    tl = parse_bytes(boot1, rx=100.0)
    tl.feed(boot2, 200.0)
    assert tl.pin == k1.public and tl.ephemeral and tl.unplaced == [k2.fingerprint]
    v = tl.judge(RUN, 200.0 + 3600, POL)  # an hour on: the pinned boot looks silent
    assert v.kind is VerdictKind.UNKNOWN and not v.failover
    assert v.reason.startswith("ALARM") and "ephemeral_key" in v.reason


def test_a_durable_pin_and_a_forgers_key_still_catch_a_real_wedge(tmp_path: Path) -> None:
    """The counterpart: with a durable pin, a key someone printed cannot silence the wedge."""
    import secrets

    state, run = tmp_path / "state", tmp_path / "run"
    boot1, _key = _emit(state, run, "aaaa0001", [("phase", {"ph": "workload"})])
    evil = protocol.LineKey(secrets.token_bytes(32), ephemeral=True)
    fake = protocol.key_line("bbbb0002", 0, 0, evil).encode() + b"\n"
    tl = parse_bytes(boot1 + fake, rx=100.0)
    v = tl.judge(RUN, 100.0 + 3600, POL)
    assert v.kind is VerdictKind.SUSPECTED_WEDGE and v.failover
    assert v.reason.startswith("ALARM") and tl.unplaced == [evil.fingerprint]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_foreign_owned_state_dir_or_key_file_keeps_the_key(tmp_path: Path) -> None:
    state, run = tmp_path / "state", tmp_path / "run"
    _, key = _emit(state, run, "aaaa0001", [("phase", {"ph": "workload"})])
    os.chown(state, 65534, 65534)  # the state dir handed to another user
    ks = load_line_key(state, run)
    assert protocol.LineKey(ks.seed).public == key.public and not ks.ephemeral
    os.chown(state / KEY_FILE, 65534, 65534)
    ks = load_line_key(state, run)
    assert protocol.LineKey(ks.seed).public == key.public
    assert any("owned by uid 65534" in p for p in ks.problems)


def test_the_private_key_is_never_shown(tmp_path: Path) -> None:
    ks = load_line_key(tmp_path / "s", tmp_path / "r")
    key = protocol.LineKey(ks.seed)
    for shown in (repr(key), str(key), protocol.key_line("aaaa0001", 0, 0, key)):
        assert ks.seed.hex() not in shown and protocol.b64(ks.seed) not in shown


def test_a_corrupt_seq_record_never_numbers_back_from_zero(tmp_path: Path) -> None:
    """Issue 25: a corrupt run/seq.<boot> record numbered every line 0."""
    alloc = SeqAllocator(tmp_path, "aaaa0001", floor=lambda: 5_000_000)
    assert [alloc.next() for _ in range(3)] == [0, 1, 2]
    (tmp_path / "seq.aaaa0001").write_bytes(b"\x00garbage\n")
    other = SeqAllocator(tmp_path, "aaaa0001", floor=lambda: 5_000_000)  # another writer
    got = [other.next() for _ in range(3)]
    assert got == [5_000_000, 5_000_001, 5_000_002] and other.fallbacks == 1
    assert [alloc.next() for _ in range(2)] == [5_000_003, 5_000_004]  # the record goes on
