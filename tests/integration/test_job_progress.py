"""The job's progress and the stuck watch (issue 37): the agent's socket counts only the job's
process tree (SO_PEERCRED) or ``[job] progress_uid``; steps strictly increase; the watch writes
``progress`` lines and one signed ``job_stuck`` for a job that stops (SIGSTOP) or beats the same
step, and nothing for a job with no window.

Real processes and a real Unix socket; the watch's clock is a fake one (kit/fakes.py) that the
test moves one heartbeat period per step, so "within the window plus one poll" is exact.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog import jobprogress as jp
from gce_watchdog.bootstrap.phases import run_exec
from gce_watchdog.job.progress import (
    JobRecord,
    Proc,
    ProgressServer,
    Tracker,
    read_job,
    socket_path,
    write_job,
)
from gce_watchdog.job.service import JobWatch
from gce_watchdog.job.stuck import Windows
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol, vocab
from kit.fakes import FakeClock
from kit.nobody import NOBODY_UID, Nobody
from kit.wait import wait_for

pytestmark = pytest.mark.process

PERIOD = 5.0  # the heartbeat period the watch steps at

# The job: reports 1, 1 (not progress), 0 (lower: not progress), 2, then no step (3); then
# `stop` SIGSTOPs itself, `beat` starts a thread that repeats step 3 while the main thread waits,
# `spin` keeps a CPU busy without progress (a checkpoint being written).
JOB = textwrap.dedent("""
    import os, signal, sys, threading, time
    from gce_watchdog import jobprogress as jp
    sys.stdin.readline()  # the test has written the job record
    out = [jp.progress(1), jp.progress(1), jp.progress(0), jp.progress(2), jp.progress()]
    print(" ".join(map(str, out)), flush=True)
    if sys.argv[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif sys.argv[1] == "spin":  # a checkpoint: CPU busy, no progress (bounded: 2 minutes)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            pass
    elif sys.argv[1] == "beat":
        def beat():
            for _ in range(3000):  # bounded: at most a minute
                jp.progress(3)
                time.sleep(0.02)
        threading.Thread(target=beat, daemon=True).start()
    sys.stdin.readline()
""")


class Served:
    def __init__(self, run_dir: Path, progress_uid: int) -> None:
        self.run_dir = run_dir
        self.clock = FakeClock()
        self.tracker = Tracker()
        self.proc = Proc()
        self.server = ProgressServer(
            str(run_dir),
            self.tracker,
            lambda: read_job(str(run_dir), os.geteuid()),
            self.proc,
            progress_uid,
            self.clock.monotonic,
        )
        self.sock = socket_path(str(run_dir))


@contextlib.contextmanager
def served(run_dir: Path, progress_uid: int = -1) -> Iterator[Served]:
    run_dir.mkdir(parents=True, exist_ok=True)
    s = Served(run_dir, progress_uid)
    s.server.start()
    assert s.server.reason.startswith("listening"), s.server.reason
    try:
        yield s
    finally:
        assert s.server.stop()


@contextlib.contextmanager
def job(s: Served, mode: str, windows: Windows) -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen(
        [sys.executable, "-c", JOB, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, jp.ENV: s.sock},
    )
    try:
        st = s.proc.stat(p.pid)
        assert st is not None
        write_job(str(s.run_dir), JobRecord(p.pid, st.start_ticks, windows))
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().split() == ["True", "False", "False", "True", "True"]
        yield p
    finally:
        p.kill()
        p.wait()


def _stopped(pid: int) -> bool:
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return raw[raw.rfind(b")") + 2 :].split()[0] == b"T"


def test_steps_count_from_the_job_and_outsiders_are_refused(tmp_path: Path) -> None:
    with served(tmp_path / "run") as s, job(s, "wait", Windows()) as p:
        rec = read_job(str(s.run_dir), os.geteuid())
        assert rec is not None and rec.pid == p.pid
        latest = s.tracker.latest(rec)
        assert latest is not None and latest.step == 3
        assert s.tracker.repeated == 2
        # this test's own process is not in the job's tree
        with pytest.raises(
            jp.ProgressRefused, match=f"not in the process tree of the job .pid {p.pid}"
        ):
            jp.progress(10, s.sock)
        assert s.server.refused == 1
        latest = s.tracker.latest(rec)
        assert latest is not None and latest.step == 3  # counted for nothing


def test_an_outsider_is_answered_before_it_says_anything(tmp_path: Path) -> None:
    """A caller outside the tree that connects and sends nothing gets its refusal at once: it
    cannot hold the server's one thread (and the job's reports) by staying silent."""
    import socket

    with served(tmp_path / "run") as s, job(s, "wait", Windows()):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10.0)
            c.connect(s.sock)
            assert c.recv(512).startswith(b"refused pid ")
        assert s.server.refused == 1


def test_the_cli_outside_the_tree_exits_77_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gce_watchdog.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[agent]\nrun_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/state"\n')
    with served(tmp_path / "run") as s, job(s, "wait", Windows()):
        assert main(["progress", "--step", "9", "--config", str(cfg)]) == 77
        assert "not in the process tree" in capsys.readouterr().err
    # no agent at all: 69
    assert main(["progress", "--config", str(cfg)]) == 69


def test_no_job_record_refuses_everyone(tmp_path: Path) -> None:
    with served(tmp_path / "run") as s, pytest.raises(jp.ProgressRefused, match="no job"):
        jp.progress(1, s.sock)


def test_no_socket_in_a_run_dir_others_may_write(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    s = Served(run, -1)
    s.server.start()
    try:
        if os.geteuid() == 0:  # untrusted_dir judges for root only (vm/state.py)
            assert "writable by group and others" in s.server.reason
            assert not Path(s.sock).exists()
        else:
            assert s.server.reason.startswith("listening")
    finally:
        assert s.server.stop()


def test_a_job_record_anyone_could_write_is_not_read(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_job(str(run), JobRecord(os.getpid(), 1, Windows(60.0)))
    assert read_job(str(run), os.geteuid()) is not None
    os.chmod(run / "job.json", 0o666)
    assert read_job(str(run), os.geteuid()) is None
    os.chmod(run / "job.json", 0o644)
    assert read_job(str(run), os.geteuid() + 1) is None  # not the agent's user's


def _nobody_reports(nb: Nobody, sock: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from gce_watchdog import jobprogress as jp; sys.exit(jp.main(['5']))"
    return subprocess.run(
        nb.argv("-c", code),
        env={"PYTHONPATH": nb.pythonpath, jp.ENV: sock, "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="runs code as uid nobody: needs root")
def test_another_uid_is_refused_unless_it_is_progress_uid(nobody: Nobody, nobody_dir: Path) -> None:
    with served(nobody_dir / "run", progress_uid=NOBODY_UID + 1) as s:
        os.chmod(s.run_dir, 0o755)
        with job(s, "wait", Windows()):
            done = _nobody_reports(nobody, s.sock)
            assert done.returncode == 77, done.stderr
            assert f"(uid {NOBODY_UID}) is not in the process tree" in done.stderr
            assert s.server.refused == 1
    with served(nobody_dir / "run2", progress_uid=NOBODY_UID) as s:
        os.chmod(s.run_dir, 0o755)
        with job(s, "wait", Windows()) as p:
            done = _nobody_reports(nobody, s.sock)
            assert done.returncode == 0, done.stderr
            rec = read_job(str(s.run_dir), os.geteuid())
            assert rec is not None and rec.pid == p.pid
            latest = s.tracker.latest(rec)
            assert latest is not None and latest.step == 5


def _watch(
    s: Served, tmp: Path, on_stuck: str = "end", gpu: float | None = None
) -> tuple[JobWatch, MemorySink, list[str]]:
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp / "state", "0badc0de"), "0badc0de", key=SYNTH_KEY)
    ended: list[str] = []
    cfg = cfgmod.from_dict({"job": {"on_stuck": on_stuck}})
    w = JobWatch(
        cfg.job,
        str(s.run_dir),
        em,
        s.tracker,
        s.proc,
        end=ended.append,
        gpu_util=lambda: gpu,
    )
    return w, sink, ended


def _events(sink: MemorySink, name: str) -> list[protocol.Event]:
    out = []
    for line in sink.lines:
        ev = protocol.decode_line(line, pin=SYNTH_KEY.public)
        if isinstance(ev, protocol.Event) and ev.event == name:
            out.append(ev)
    return out


def _drive(w: JobWatch, s: Served, periods: int) -> float | None:
    """Step the watch once per period; the fake time (since the last progress) of the verdict."""
    t0 = s.clock.monotonic()
    for _ in range(periods):
        v = w.step(s.clock.monotonic())
        if v is not None and v.stuck:
            return s.clock.monotonic() - t0
        s.clock.advance(PERIOD)
    return None


@pytest.mark.parametrize(("on_stuck", "ends"), [("end", ["stuck"]), ("alert", [])])
def test_a_job_that_stops_itself_is_stuck_within_the_window_plus_one_poll(
    tmp_path: Path, on_stuck: str, ends: list[str]
) -> None:
    after = 60.0
    with served(tmp_path / "run") as s, job(s, "stop", Windows(after=after)) as p:
        assert wait_for(lambda: _stopped(p.pid))
        w, sink, ended = _watch(s, tmp_path, on_stuck)
        at = _drive(w, s, 1000)
        assert at is not None and after <= at <= after + PERIOD
        assert w.step(s.clock.monotonic()) is w.stuck  # said once
        (line,) = _events(sink, vocab.JOB_STUCK)
        assert (line.get("rule"), line.get("step"), line.get("act")) == ("idle", "3", on_stuck)
        assert ended == ends
        (prog,) = _events(sink, vocab.PROGRESS)
        assert prog.get("step") == "3"


def test_a_stopped_job_with_a_busy_gpu_waits_for_max(tmp_path: Path) -> None:
    with served(tmp_path / "run") as s, job(s, "stop", Windows(after=60.0, max=300.0)) as p:
        assert wait_for(lambda: _stopped(p.pid))
        w, sink, _ = _watch(s, tmp_path, gpu=100.0)  # a kernel spinning on a dead peer
        at = _drive(w, s, 1000)
        assert at is not None and 300.0 <= at <= 300.0 + PERIOD
        (line,) = _events(sink, vocab.JOB_STUCK)
        assert line.get("rule") == "max"


def test_a_beating_thread_over_a_stuck_loop_is_stuck(tmp_path: Path) -> None:
    mx = 120.0
    with served(tmp_path / "run") as s, job(s, "beat", Windows(max=mx)):
        assert wait_for(lambda: s.tracker.repeated >= 2 + 5)  # the beats arrive, not progress
        w, sink, ended = _watch(s, tmp_path)
        at = _drive(w, s, 1000)
        assert at is not None and mx <= at <= mx + PERIOD
        (line,) = _events(sink, vocab.JOB_STUCK)
        assert (line.get("rule"), line.get("step")) == ("max", "3")
        assert ended == ["stuck"]


def _cpu_s(pid: int) -> float:
    """The process's CPU time (utime + stime, proc(5)), read apart from the watch's own scan."""
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    rest = raw[raw.rfind(b")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def test_a_checkpoint_busy_for_nine_tenths_of_max_gives_nothing(tmp_path: Path) -> None:
    """A job that "checkpoints" (no progress, CPU busy) gets no `job_stuck` for 0.9 of
    `stuck_max`, nor from the idle window (its tree is busy), and `rule=max` once max has
    passed. Each fake period waits until the job really used 0.1 s of CPU (2 % of a core per
    5 s, the idle threshold being 1 %): the CPU time the watch reads is real, only time is fake."""
    after, mx = 20.0, 60.0
    with served(tmp_path / "run") as s, job(s, "spin", Windows(after=after, max=mx)) as p:
        w, sink, ended = _watch(s, tmp_path)
        t0 = s.clock.monotonic()  # the job's last step came now
        at = None
        for _ in range(int(mx / PERIOD) + 2):
            used = _cpu_s(p.pid)
            assert wait_for(lambda: _cpu_s(p.pid) >= used + 0.1, timeout=60.0)
            v = w.step(s.clock.monotonic())
            if v is not None and v.stuck:
                at = s.clock.monotonic() - t0
                break
            s.clock.advance(PERIOD)
        assert at is not None and mx <= at <= mx + PERIOD  # nothing at 0.9 of max, nor idle
        (line,) = _events(sink, vocab.JOB_STUCK)
        assert (line.get("rule"), line.get("step")) == ("max", "3")
        assert ended == ["stuck"]


def test_a_job_with_no_window_is_never_stuck(tmp_path: Path) -> None:
    with served(tmp_path / "run") as s, job(s, "stop", Windows()) as p:
        assert wait_for(lambda: _stopped(p.pid))
        w, sink, ended = _watch(s, tmp_path)
        assert _drive(w, s, 20000) is None  # 27 hours of fake time
        assert _events(sink, vocab.JOB_STUCK) == [] and ended == []
        assert len(_events(sink, vocab.PROGRESS)) == 1  # one line per new step, not per period


def test_progress_lines_come_at_most_once_per_heartbeat_period(tmp_path: Path) -> None:
    with served(tmp_path / "run") as s, job(s, "wait", Windows()) as p:
        w, sink, _ = _watch(s, tmp_path)
        w.line_every = 6 * PERIOD
        rec = read_job(str(s.run_dir), os.geteuid())
        assert rec is not None and rec.pid == p.pid
        for n in range(60):  # a new step every period, reported as the job would
            s.tracker.report(rec, 100 + n, s.clock.monotonic())
            w.step(s.clock.monotonic())
            s.clock.advance(PERIOD)
        lines = _events(sink, vocab.PROGRESS)
        assert len(lines) == 10  # 60 periods / 6
        assert [int(e.get("step") or 0) for e in lines] == [100 + 6 * k for k in range(10)]


def test_exec_records_the_job_and_its_windows_then_removes_the_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = cfgmod.from_dict(
        {
            "agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(run)},
            "serial": {"device": str(tmp_path / "serial"), "fallback_file": str(tmp_path / "f")},
            "job": {"stuck_after": "10m", "stuck_first": "1h"},
        }
    )
    (tmp_path / "serial").touch()
    run.mkdir()
    out = tmp_path / "seen.json"
    code = (
        "import os, pathlib, sys; "
        f"pathlib.Path({str(out)!r}).write_text("
        "os.environ['GCEWD_PROGRESS'] + '\\n' + pathlib.Path(sys.argv[1]).read_text())"
    )
    rc = run_exec(cfg, [sys.executable, "-c", code, str(run / "job.json")], windows=None)
    assert rc == 0
    sock, body = out.read_text().split("\n", 1)
    assert sock == str(run / "progress.sock")
    rec = json.loads(body)
    assert rec["windows"] == {"after": 600.0, "max": None, "first": 3600.0}
    assert rec["version"] == 1 and rec["pid"] > 0
    assert not (run / "job.json").exists()


def test_progress_stopped_is_the_gpu_watchs_second_signal_after_the_window(tmp_path: Path) -> None:
    """Issue 36: the job's progress stopping confirms a hardware Xid (gpu/watch.py); it holds
    once the job reported nothing new for `stuck_after`, busy or not, and never without one."""
    after = 60.0
    with served(tmp_path / "run") as s, job(s, "stop", Windows(after=after)) as p:
        assert wait_for(lambda: _stopped(p.pid))
        w, _, _ = _watch(s, tmp_path)
        w.step(s.clock.monotonic())
        latest = s.tracker.latest(w._job) if w._job is not None else None
        assert latest is not None  # the job reported steps before it stopped
        assert not w.progress_stopped(latest.at + after - 1.0)
        assert w.progress_stopped(latest.at + after)
    with served(tmp_path / "run2") as s, job(s, "stop", Windows(max=300.0)) as p:
        assert wait_for(lambda: _stopped(p.pid))
        w, _, _ = _watch(s, tmp_path)
        w.step(s.clock.monotonic())
        assert w._job is not None and not w.progress_stopped(s.clock.monotonic() + 86400.0)
