"""The agent's job watch (job/service.py) end to end over a fake ``/proc`` and a fake clock: a
soak of jittered steps over many windows writes 0 ``job_stuck`` lines, as the rule's own soak
(test_job_stuck.py) says, here with the watch's sampling, its trimmed sample queues and its
``progress`` lines in the way; the same soak with one stall writes exactly one."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import pytest
from gce_watchdog.job.progress import JobRecord, Proc, ProcStat, Tracker, write_job
from gce_watchdog.job.service import JobWatch
from gce_watchdog.job.stuck import Windows, advance
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol, vocab

pytestmark = pytest.mark.pure

TICK = 5.0  # the watch steps once per heartbeat period
PID, START = 4242, 777
AFTER, MAX, FIRST = 60.0, 1800.0, 600.0
WINDOWS = Windows(after=AFTER, max=MAX, first=FIRST)


class FakeProc(Proc):
    """The job as one process (proc(5)'s fields as ProcStat) whose CPU ticks the test sets."""

    def __init__(self) -> None:
        super().__init__(root="/nonexistent")
        self.ticks = 0

    def stat(self, pid: int) -> ProcStat | None:
        return ProcStat(1, START, self.ticks) if pid == PID else None

    def pids(self) -> Iterable[int]:
        return [PID]


def soak(
    tmp: Path, seed: int, windows: int, stall_after_s: float | None = None
) -> tuple[list[str], int]:
    """Run the watch over ``windows`` stuck_after windows of a job whose steps come 0.2 to 0.95
    of ``after`` apart (idle or lightly busy between them), with a checkpoint (CPU busy, up to
    0.95 of ``max`` without a step) now and then; ``stall_after_s``: from then on the job stops
    (no step, no CPU). The rules of the job_stuck lines the watch wrote, and its progress lines."""
    rnd = random.Random(seed)
    run = tmp / "run"
    run.mkdir()
    write_job(str(run), JobRecord(PID, START, WINDOWS))
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp / "state", "0badc0de"), "0badc0de", key=SYNTH_KEY)
    cfg = cfgmod.from_dict({"job": {"on_stuck": "alert"}})
    tracker, proc = Tracker(), FakeProc()
    w = JobWatch(cfg.job, str(run), em, tracker, proc, end=lambda _: None, line_every=30.0)
    rec = JobRecord(PID, START, WINDOWS)
    t, step = 0.0, None
    next_step = rnd.uniform(0.2, 0.95) * FIRST
    checkpoint = False
    hz = proc.hz
    while t < windows * AFTER:
        stalled = stall_after_s is not None and t >= stall_after_s
        if not stalled:
            rate = rnd.uniform(1.0, 4.0) if checkpoint else rnd.choice((0.0, rnd.uniform(0, 0.5)))
            proc.ticks += int(rate * TICK * hz)
        while not stalled and next_step <= t + TICK:  # the steps of this period, at their time
            step = advance(step, None)
            tracker.report(rec, step, next_step)
            checkpoint = rnd.random() < 0.01
            next_step += (
                rnd.uniform(0.3, 0.95) * MAX if checkpoint else rnd.uniform(0.2, 0.95) * AFTER
            )
        t += TICK
        w.step(t)
    rules, progress = [], 0
    for line in sink.lines:
        ev = protocol.decode_line(line, pin=SYNTH_KEY.public)
        if isinstance(ev, protocol.Event) and ev.event == vocab.JOB_STUCK:
            rules.append(ev.get("rule") or "")
        progress += isinstance(ev, protocol.Event) and ev.event == vocab.PROGRESS
    return rules, progress


@pytest.mark.parametrize("seed", range(3))
def test_a_soak_of_jittered_steps_through_the_watch_gives_no_job_stuck(
    tmp_path: Path, seed: int
) -> None:
    """600 windows per seed (1,800 in all, 21,600 steps of the watch): 0, and the steps were
    seen (a progress line at most every 30 s: one per 6 steps of the watch)."""
    rules, progress = soak(tmp_path, seed, 600)
    assert rules == [] and progress > 600 * 60.0 / 30.0 / 2


def test_the_same_soak_with_one_stall_gives_one_idle_job_stuck(tmp_path: Path) -> None:
    rules, _ = soak(tmp_path, 0, 600, stall_after_s=20_000.0)
    assert rules == ["idle"]


def test_the_fake_proc_is_the_job_the_watch_reads() -> None:
    """The watch samples this stand-in's CPU ticks (seconds at proc.hz), not the real /proc."""
    from gce_watchdog.job.progress import tree_cpu_seconds

    proc = FakeProc()
    proc.ticks = 3 * proc.hz
    assert tree_cpu_seconds(proc, JobRecord(PID, START, WINDOWS)) == 3.0
    assert tree_cpu_seconds(proc, JobRecord(PID, START + 1, WINDOWS)) is None  # a reused pid
