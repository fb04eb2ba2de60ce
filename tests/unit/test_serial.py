"""The serial writer against real files and a pty nobody reads."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import pytest
from gce_watchdog.daemon.service import Agent, Deps, LadderStore
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import (
    REOPEN_PAUSES,
    REOPEN_WINDOW,
    Emitter,
    MemorySink,
    SerialPort,
    reopen_pauses,
)
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire.protocol import decode_all
from hypothesis import given
from hypothesis import strategies as st
from kit.fakes import FakeClock, FakeNotifier, ScriptedProber, result


@pytest.mark.pure
def test_lines_reach_a_file_in_order_and_decode(tmp_path: Path) -> None:
    f = tmp_path / "ttyS0"
    f.touch()  # a device that exists (a missing one is unusable)
    with SerialPort(str(f)) as port:
        em = Emitter(port, SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=SYNTH_KEY)
        for i in range(50):
            em.emit("heartbeat", {"i": i})
        # seq 0, 1 and 32: the key announcement
        assert em.emit("exit", {"rc": 0}, sync=True).seq == 53
        # the sync line is on disk when emit returns
        evs, stats = decode_all(f.read_bytes())
        assert [e.seq for e in evs] == list(range(54)) and stats.rejected == 0
        assert [e.seq for e in evs if e.event == "key"] == [0, 1, 32] and stats.forged == 0


@pytest.mark.pure
def test_missing_device_falls_back_to_file(tmp_path: Path) -> None:
    port = SerialPort(str(tmp_path / "no" / "such" / "dir" / "tty"), str(tmp_path / "fb.log"))
    port.device = "/proc/nonexistent/ttyS9"  # a path that cannot be created
    with port:
        assert port.target.endswith("fb.log") and port.open_error
        assert port.write_line("x", sync=True)
    assert (tmp_path / "fb.log").read_text() == "x\n"


@pytest.mark.pure
def test_seq_is_shared_between_writers_and_restarts_per_boot(tmp_path: Path) -> None:
    a, b = SeqAllocator(tmp_path, "aaaaaaaa"), SeqAllocator(tmp_path, "aaaaaaaa")
    got = [a.next(), b.next(), a.next()]
    assert got == [0, 1, 2]
    assert SeqAllocator(tmp_path, "bbbbbbbb").next() == 0  # new boot


def _stalled_pty() -> tuple[int, int, str]:
    master, slave = os.openpty()
    path = os.ttyname(slave)
    os.set_blocking(slave, False)
    # Fill the pty until the kernel keeps refusing: the line discipline moves data along
    # asynchronously, so one EAGAIN is not yet "full". Bounded: at most 2 s.
    refused_since: float | None = None
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        try:
            os.write(slave, b"x" * 4096)
            refused_since = None
        except BlockingIOError:
            refused_since = refused_since or time.monotonic()
            if time.monotonic() - refused_since > 0.2:
                break
            time.sleep(0.01)
    # keep the slave open: closing the last slave fd would let the kernel flush the buffer
    return master, slave, path


@pytest.mark.process
def test_stalled_pty_never_stalls_the_ladder(tmp_path: Path) -> None:
    master, slave, path = _stalled_pty()
    port = SerialPort(path, queue_size=4, sync_timeout=0.2).open()
    try:
        assert port.target == path
        clock = FakeClock()
        fired: list[int] = []
        cfg = cfgmod.replace(
            cfgmod.Config(),
            agent={
                "interval": 1.0,
                "probe_timeout": 0.5,
                "state_dir": str(tmp_path),
                "run_dir": str(tmp_path / "run"),
            },
        )
        deps = Deps(
            emitter=Emitter(
                port, SeqAllocator(tmp_path, "cafecafe"), "cafecafe", clock.wall, key=SYNTH_KEY
            ),
            prober=ScriptedProber([result("fail", "fail")]),
            clock=clock,
            notifier=FakeNotifier(),
            store=LadderStore(tmp_path / "ladder.json", "boot"),
            on_shutdown=lambda reason, rung, thr, **k: fired.append(agent.ticks),
        )
        agent = Agent.from_config(cfg, deps)
        t0 = time.monotonic()
        agent.run(threading.Event(), max_ticks=30)
        took = time.monotonic() - t0
        assert fired == [10]  # on time, although nothing is read from the port
        assert port.dropped > 0  # and the loss is counted, to be reported later
        assert took < 5.0  # only the bounded sync waits (start, stop) cost real time
    finally:
        port.close(timeout=0.2)
        os.close(master)
        os.close(slave)


@pytest.mark.process
def test_dropped_count_is_reported_in_later_lines(tmp_path: Path) -> None:
    master, slave, path = _stalled_pty()
    port = SerialPort(path, queue_size=1, sync_timeout=0.1).open()
    try:
        em = Emitter(port, SeqAllocator(tmp_path, "cafecafe"), "cafecafe", key=SYNTH_KEY)
        for _ in range(10):
            em.emit("tick", {"n": 1})
        assert port.dropped >= 8
    finally:
        port.close(timeout=0.2)
        os.close(master)
        os.close(slave)


@pytest.mark.pure
def test_a_failed_write_answers_a_sync_caller_at_once() -> None:
    # /dev/full refuses every write (ENOSPC): the caller learns it now, not after sync_timeout.
    with SerialPort("/dev/full", sync_timeout=30.0) as port:
        t0 = time.monotonic()
        assert port.write_line("x", sync=True) is False
        assert time.monotonic() - t0 < 5.0
        assert port.dropped == 1


@pytest.mark.pure
def test_threads_of_one_process_reach_the_port_in_seq_order(tmp_path: Path) -> None:
    f = tmp_path / "ttyS0"
    f.touch()
    with SerialPort(str(f), queue_size=4096) as port:
        em = Emitter(port, SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=SYNTH_KEY)

        def burst(k: int) -> None:
            for i in range(200):
                em.emit("heartbeat", {"t": k, "i": i})

        threads = [threading.Thread(target=burst, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        em.emit("stop", sync=True)
    lines = f.read_text().splitlines()
    raw = [int(line.split(" ")[2]) for line in lines]
    announcements = [n for n, line in zip(raw, lines, strict=True) if " key pk=" in line]
    assert announcements == [0, 1, *range(32, len(raw), 32)]
    assert raw == list(range(801 + len(announcements)))  # on the port itself, not decoded


@pytest.mark.pure
def test_without_the_key_nothing_is_written_and_seq_0_stays_for_the_announcement(
    tmp_path: Path,
) -> None:
    sink = MemorySink()
    unsigned = Emitter(sink, SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=None)
    unsigned.emit("phase", {"ph": "workload"})
    assert sink.lines == [] and unsigned.unsigned == 1
    signed = Emitter(sink, SeqAllocator(tmp_path, "0badc0de"), "0badc0de", key=SYNTH_KEY)
    signed.emit("phase", {"ph": "workload"})
    evs, stats = decode_all("".join(ln + "\n" for ln in sink.lines).encode())
    assert [(e.seq, e.event) for e in evs] == [(0, "key"), (1, "key"), (2, "phase")]
    assert stats.forged == 0


@pytest.mark.pure
@given(
    first=st.floats(0.001, 1.0),
    cap=st.floats(0.001, 5.0),
    window=st.floats(0.0, 30.0),
)
def test_reopen_pauses_double_up_to_the_cap_within_the_window(
    first: float, cap: float, window: float
) -> None:
    pauses = reopen_pauses(first, cap, window)
    assert pauses  # a line always gets at least one reopen
    if first > window:
        assert pauses == (window,)
        return
    assert pauses[0] == first
    assert sum(pauses) <= window + 1e-9
    # doubling, then held at the cap (the first pause may already be above it)
    for a, b in itertools.pairwise(pauses):
        assert b == min(a * 2, cap)
    # as many as fit: the next pause would overrun the window
    nxt = min(pauses[-1] * 2, cap)
    assert sum(pauses) + nxt > window
    assert len(pauses) <= window / min(first, cap) + 1  # bounded in count too


@pytest.mark.pure
def test_the_default_window_outlasts_a_loaded_getty_restart() -> None:
    # A serial logout's hangups (the session's, systemd's at the getty's exit and at its
    # restart) were seen spread over more than 0.3 s on a loaded guest (docs/e2e.md); the
    # window is a few seconds, and never more than REOPEN_WINDOW for one line.
    assert 2.0 <= sum(REOPEN_PAUSES) <= REOPEN_WINDOW
    assert REOPEN_PAUSES[0] <= 0.05  # the common case, one hangup, costs little
