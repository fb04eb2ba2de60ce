"""Issue 35 item 1 (writer side): the boot counter's file, vm/bootcount.py, and ``bc`` on every
line a real writer makes (docs/serial-protocol.md, "Boot counter").

The file edge with real files: the first boot, the next one, writers racing (threads and
processes) for one boot, a FIFO or a symlink where ``boot.count`` goes, a lost counter, a state
dir the writer cannot write (uid nobody). Then the agent's own run and the CLI: every line of a
boot carries the same ``bc``, the next boot one more."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.vm.bootcount import COUNT_FILE, LOCK_FILE, WARN_TEXT, BootCount, BootCounter
from gce_watchdog.vm.console import open_emitter
from gce_watchdog.vm.state import KEY_FILE
from gce_watchdog.wire import protocol
from kit.agent import agent_config, run_agent
from kit.nobody import Nobody

A = "a" * 32
B = "b" * 32


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "state", tmp_path / "run"


@pytest.mark.pure
def test_the_first_boot_counts_1_the_next_2_and_the_file_is_roots_0600(tmp_path: Path) -> None:
    state, run = _dirs(tmp_path)
    assert BootCounter(state, run, A).get() == BootCount("1")
    st = (state / COUNT_FILE).stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    assert (state / COUNT_FILE).read_text() == f"1 {A}\n"
    assert (run / f"bc.{A[:8]}").read_text() == "1\n"  # the per-boot cache (tmpfs)
    (state / KEY_FILE).write_bytes(b"k" * 32)  # the first line made the key
    assert BootCounter(state, run, A).get() == BootCount("1")  # a later writer of the boot
    (run / f"bc.{A[:8]}").unlink()
    assert BootCounter(state, run, A).get() == BootCount("1")  # from the file: no increment
    assert BootCounter(state, tmp_path / "run2", B).get() == BootCount("2")
    assert (state / COUNT_FILE).read_text() == f"2 {B}\n"
    assert not [p.name for p in state.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.pure
def test_writers_racing_in_threads_get_one_value_for_the_boot(tmp_path: Path) -> None:
    state = tmp_path / "state"
    BootCounter(state, tmp_path / "r0", A).get()  # boot 1
    barrier = threading.Barrier(8)
    got: list[str] = []

    def writer(i: int) -> None:
        c = BootCounter(state, tmp_path / f"run{i}", B)  # a run dir each: no shared cache
        barrier.wait(10)
        got.append(c.get().value)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == ["2"] * 8
    assert (state / COUNT_FILE).read_text() == f"2 {B}\n"


RACER = """
import sys
from gce_watchdog.vm.bootcount import BootCounter
state, run, bid, go = sys.argv[1:]
c = BootCounter(state, run, bid)
while not __import__("os").path.exists(go):
    __import__("time").sleep(0.005)
print(c.get().value)
"""


@pytest.mark.process
def test_writers_racing_in_processes_get_one_value_for_the_boot(tmp_path: Path) -> None:
    state = tmp_path / "state"
    BootCounter(state, tmp_path / "r0", A).get()  # boot 1
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(state), str(tmp_path / f"run{i}"), B, str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    go.touch()
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == ["2"] * 6
    assert (state / COUNT_FILE).read_text() == f"2 {B}\n"


def _refused(state: Path, run: Path, what: str) -> BootCount:
    """The counter with ``boot.count`` something else than a file; bounded: a writer that
    blocked on a FIFO would fail here, not hang the run."""
    got: list[BootCount] = []
    t = threading.Thread(target=lambda: got.append(BootCounter(state, run, B).get()))
    t.start()
    t.join(20)
    assert not t.is_alive(), f"the writer blocked on {what}"
    (bc,) = got
    return bc


@pytest.mark.pure
def test_a_fifo_at_boot_count_is_refused_never_read(tmp_path: Path) -> None:
    state, run = _dirs(tmp_path)
    state.mkdir()
    os.mkfifo(state / COUNT_FILE)
    bc = _refused(state, run, "a FIFO")
    assert bc.value == "-" and "not a regular file" in bc.problem and "lost" in bc.problem
    assert (state / COUNT_FILE).is_fifo()  # left alone, not replaced


@pytest.mark.pure
def test_a_symlink_at_boot_count_is_refused_never_followed(tmp_path: Path) -> None:
    state, run = _dirs(tmp_path)
    state.mkdir()
    elsewhere = tmp_path / "planted"
    elsewhere.write_text(f"41 {A}\n")
    (state / COUNT_FILE).symlink_to(elsewhere)
    bc = _refused(state, run, "a symlink")
    assert bc.value == "-" and "symlink" in bc.problem
    assert elsewhere.read_text() == f"41 {A}\n"  # not read as the counter, not written through
    assert (state / COUNT_FILE).is_symlink()


@pytest.mark.pure
def test_a_lock_that_is_not_a_file_means_no_write_so_bc_dash(tmp_path: Path) -> None:
    state, run = _dirs(tmp_path)
    BootCounter(state, tmp_path / "r0", A).get()
    (state / LOCK_FILE).unlink()
    (state / LOCK_FILE).mkdir()
    bc = BootCounter(state, run, B).get()
    assert bc.value == "-" and "cannot be written" in bc.problem
    assert (state / COUNT_FILE).read_text() == f"1 {A}\n"
    # the next boot, with the lock back, counts 2: the value no boot carried
    (state / LOCK_FILE).rmdir()
    assert BootCounter(state, tmp_path / "r2", "c" * 32).get() == BootCount("2")


@pytest.mark.pure
def test_a_lost_counter_is_dash_for_good_and_the_cache_keeps_the_boot_consistent(
    tmp_path: Path,
) -> None:
    state, run = _dirs(tmp_path)
    BootCounter(state, tmp_path / "r0", A).get()
    (state / KEY_FILE).write_bytes(b"k" * 32)
    backup = (state / COUNT_FILE).read_bytes()
    (state / COUNT_FILE).unlink()
    bc = BootCounter(state, run, B).get()
    assert bc.value == "-" and "missing while signing.key exists" in bc.problem
    assert not (state / COUNT_FILE).exists()  # never restarted at 1
    # the operator restores the backup: this boot stays '-' (its writers agree), the next
    # boot counts on from the backup
    (state / COUNT_FILE).write_bytes(backup)
    assert BootCounter(state, run, B).get().value == "-"
    assert BootCounter(state, tmp_path / "r3", "c" * 32).get() == BootCount("2")


@pytest.mark.pure
def test_without_a_trusted_state_dir_the_boot_takes_its_cached_value_or_dash(
    tmp_path: Path,
) -> None:
    """The agent's private state dir (an untrusted one not used) is not the instance's: counting
    there would start at 1 again, so it is never counted in."""
    state, run = _dirs(tmp_path)
    bc = BootCounter(None, run, A).get()
    assert bc.value == "-" and "no trusted state dir" in bc.problem
    assert BootCounter(state, run, A).get().value == "-"  # the boot's writers agree
    assert not (state / COUNT_FILE).exists()
    assert BootCounter(state, tmp_path / "r2", B).get() == BootCount("1")
    assert BootCounter(None, tmp_path / "r2", B).get() == BootCount("1")  # cached for boot B


@pytest.mark.skipif(os.geteuid() != 0, reason="the run dir's trust is checked as root only")
@pytest.mark.pure
def test_a_cache_in_a_run_dir_others_can_write_is_ignored(tmp_path: Path) -> None:
    state, run = _dirs(tmp_path)
    run.mkdir()
    run.chmod(0o777)
    (run / f"bc.{A[:8]}").write_text("999\n")  # planted by anyone
    assert BootCounter(state, run, A).get() == BootCount("1")
    assert (run / f"bc.{A[:8]}").read_text() == "999\n"  # neither read nor written


def _lines(serial: Path, state: Path) -> list[protocol.Event]:
    """Every line in ``serial`` (announcements included) as a pinned reader decodes it."""
    key = protocol.LineKey((state / KEY_FILE).read_bytes())
    evs, stats = protocol.decode_all(serial.read_bytes(), pin=key.public)
    assert stats.forged == 0 and stats.rejected == 0
    return evs


@pytest.mark.pure
def test_every_line_of_an_emitter_carries_bc_and_the_announcement_bid(tmp_path: Path) -> None:
    state, run = _dirs(tmp_path)
    serial = tmp_path / "ttyS0"
    serial.touch()
    for n, bid in ((1, A), (2, B)):
        em, port = open_emitter(str(serial), None, str(state), str(run), bid[:8], boot_id=bid)
        for i in range(40):  # past seq 32: a repeated announcement too
            em.emit("heartbeat", {"i": str(i)}, "x" * 200)
        port.close()
        evs = [e for e in _lines(serial, state) if e.boot == bid[:8]]
        keys = [e for e in evs if e.event == protocol.KEY_EVENT]
        assert [e.seq for e in keys] == [0, 1, 32]
        assert {e.get("bc") for e in evs} == {str(n)}
        assert {e.get("bid") for e in keys} == {bid}
        assert all(e.fields[-1] == ("bc", str(n)) for e in evs if e.event == "heartbeat")


@pytest.mark.pure
def test_a_lost_counter_is_said_once_per_process_and_every_line_is_bc_dash(
    tmp_path: Path,
) -> None:
    state, run = _dirs(tmp_path)
    state.mkdir()
    (state / KEY_FILE).write_bytes(b"k" * 32)
    (state / KEY_FILE).chmod(0o600)
    serial = tmp_path / "ttyS0"
    serial.touch()
    for _ in range(2):  # two processes of the boot (the second from the run dir's cache)
        em, port = open_emitter(str(serial), None, str(state), str(run), A[:8], boot_id=A)
        for _ in range(3):
            em.emit("heartbeat")
        port.close()
    evs = _lines(serial, state)
    assert {e.get("bc") for e in evs} == {"-"}
    warns = [e for e in evs if e.event == "warn"]
    assert [w.get("what") for w in warns] == ["bootcount", "bootcount"]
    assert warns[0].text.startswith(WARN_TEXT.split("(")[0].strip()[:40])
    assert "position only" in warns[0].text
    assert [e.event for e in evs if e.event != protocol.KEY_EVENT] == (
        ["heartbeat", "warn", "heartbeat", "heartbeat"] * 2
    )


NOBODY_WRITER = """
import sys
from gce_watchdog.vm.bootcount import BootCounter
bc = BootCounter(sys.argv[1], sys.argv[2], sys.argv[3]).get()
print(bc.value + "|" + bc.problem)
"""


@pytest.mark.process
def test_a_state_dir_the_writer_cannot_write_gives_bc_dash_for_that_boot(
    nobody: Nobody, nobody_dir: Path
) -> None:
    """Read-only for the writer (a 0755 root dir, the writer uid nobody): the previous boot's
    value is read, nothing is written, this boot carries '-'; the next boot (writable) counts
    one more than the last value any boot carried."""
    state, run = nobody_dir / "state", nobody_dir / "run"
    BootCounter(state, nobody_dir / "r0", A).get()
    (state / COUNT_FILE).chmod(0o644)
    run.mkdir(mode=0o777)
    run.chmod(0o777)
    p = nobody.run(["-c", NOBODY_WRITER, str(state), str(run), B], cwd=nobody_dir)
    assert p.returncode == 0, p.stderr
    value, _, problem = p.stdout.strip().partition("|")
    assert value == "-" and "cannot be written" in problem, p.stdout
    assert (state / COUNT_FILE).read_text() == f"1 {A}\n"
    assert BootCounter(state, nobody_dir / "r2", "c" * 32).get() == BootCount("2")


@pytest.mark.process
def test_every_line_of_an_agent_run_carries_the_boots_counter(tmp_path: Path) -> None:
    """The agent's own loop (a real process against the fakes), two simulated boots."""
    boot_id = tmp_path / "boot_id"
    serial = tmp_path / "ttyS0"
    with SimGCE() as sim:
        cfg = agent_config(tmp_path, sim, agent={"boot_id_path": str(boot_id)})
        for n, bid in ((1, A), (2, B)):
            boot_id.write_text(f"{bid[:8]}-{bid[8:12]}-{bid[12:16]}-{bid[16:20]}-{bid[20:]}\n")
            p = run_agent(cfg, "--max-ticks", "3", timeout=60)
            assert p.returncode == 0, p.stderr
            evs = [e for e in _lines(serial, tmp_path / "state") if e.boot == bid[:8]]
            assert len(evs) >= 5 and {e.get("bc") for e in evs} == {str(n)}, evs
            keys = [e for e in evs if e.event == protocol.KEY_EVENT]
            assert [e.seq for e in keys][:2] == [0, 1] and {e.get("bid") for e in keys} == {bid}
            assert not any(e.event == "warn" and e.get("what") == "bootcount" for e in evs)
    assert (tmp_path / "state" / COUNT_FILE).read_text() == f"2 {B}\n"


@pytest.mark.pure
def test_with_no_usable_state_or_run_dir_the_boot_still_announces_at_seq_0_and_1(
    tmp_path: Path,
) -> None:
    """Issue 35.4 kept: nothing can be written (the state dir's parent is a file, a FIFO where
    the run dir goes): seq 0 and 1 are still the announcement, with bc=- and the warn."""
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    run = tmp_path / "run"
    os.mkfifo(run)
    serial = tmp_path / "ttyS0"
    serial.touch()
    em, port = open_emitter(str(serial), None, str(blocker / "state"), str(run), A[:8], boot_id=A)
    em.emit("start")
    em.emit("heartbeat")
    port.close()
    evs, stats = protocol.decode_all(serial.read_bytes())  # pinned from its first line
    assert stats.forged == 0 and stats.rejected == 0
    keys = [e for e in evs if e.event == protocol.KEY_EVENT]
    # seq 0 and 1 from memory; the later lines are numbered from CLOCK_BOOTTIME (no seq file),
    # so one of them may fall on a multiple of ANNOUNCE_EVERY and be announced there too
    seqs = [e.seq for e in keys]
    assert seqs[:2] == [0, 1] and all(s % protocol.ANNOUNCE_EVERY == 0 for s in seqs[2:]), seqs
    assert {e.get("eph") for e in keys} == {"1"}
    assert {e.get("bc") for e in evs} == {"-"} and {e.get("bid") for e in keys} == {A}
    assert [e.get("what") for e in evs if e.event == "warn"] == ["key", "bootcount"]
