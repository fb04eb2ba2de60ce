"""The job watch as a service of the agent: the progress socket, signed ``progress`` lines and the
stuck rule (job/stuck.py) applied once per heartbeat period.

Every ``period`` (the agent's ``interval``) the watch reads the job record ``exec`` wrote
(job/progress.py), samples the CPU seconds of the job's process tree (and the GPUs' utilisation
where the GPU watch has a sample), writes a ``progress`` line when a new step came since the last
one, at most one per heartbeat period (``line_every``: the latest step and its age), and asks
the rule. A stuck job gets
one signed, drained ``job_stuck`` line; then, unless ``[job] on_stuck = "alert"``, the end-of-life
chain is requested as ``gce-watchdog end --reason stuck`` would (daemon/endoflife.py: the agent's
loop takes it at its next tick, lingers so the poller reads the line while the VM runs, and
powers off). No job record, or a job with no window: nothing is ever decided.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

from gce_watchdog.job.progress import (
    JobRecord,
    Proc,
    ProgressServer,
    Tracker,
    read_job,
    tree_cpu_seconds,
)
from gce_watchdog.job.stuck import Observation, Verdict, decide
from gce_watchdog.lib.loop import Loop
from gce_watchdog.vm.config import JobSection
from gce_watchdog.vm.console import Emitter
from gce_watchdog.wire import vocab


class JobWatch:
    """One step of the watch (``step(now)``), with its edges injected; the service's thread and
    the tests call it."""

    def __init__(
        self,
        cfg: JobSection,
        run_dir: str,
        emitter: Emitter,
        tracker: Tracker,
        proc: Proc,
        *,
        end: Callable[[str], object],
        gpu_util: Callable[[], float | None] = lambda: None,
        owner: int | None = None,
        line_every: float = 0.0,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.emitter = emitter
        self.tracker = tracker
        self.proc = proc
        self.end = end
        self.gpu_util = gpu_util
        self.owner = os.geteuid() if owner is None else owner
        self.line_every = line_every  # the heartbeat period: at most one `progress` line per
        self._line_at: float | None = None
        self._job: JobRecord | None = None
        self._started = 0.0
        self._cpu: deque[tuple[float, float]] = deque()
        self._gpu: deque[tuple[float, float]] = deque()
        self._said_step: int | None = None
        self.stuck: Verdict | None = None  # this job's verdict, once said

    def job(self) -> JobRecord | None:
        return read_job(self.run_dir, self.owner)

    def progress_stopped(self, now: float) -> bool:
        """The GPU watch's "progress stopped" signal (docs/gpu.md): the job seen last has a
        ``stuck_after`` window and reported nothing new (nor started) for that long. Weaker than
        the stuck rule, which also needs an idle tree: it only confirms a hardware Xid."""
        rec = self._job
        after = rec.windows.after if rec is not None else None
        if rec is None or not after:
            return False
        latest = self.tracker.latest(rec)
        since = latest.at if latest is not None else self._started
        return now - since >= after

    def step(self, now: float) -> Verdict | None:
        rec = self.job()
        if rec is None:
            self._job = None
            return None
        if self._job is None or (self._job.pid, self._job.start_ticks) != (
            rec.pid,
            rec.start_ticks,
        ):  # a new job: its own samples and verdict; its start is when we first saw it
            self._job, self._started = rec, now
            self._cpu.clear()
            self._gpu.clear()
            self._said_step, self.stuck = None, None
        w = rec.windows
        if w.any:  # no window, nothing to decide: no scan of /proc either
            cpu = tree_cpu_seconds(self.proc, rec)
            if cpu is None:
                return None  # the job is gone; exec removes the record
            self._cpu.append((now, cpu))
            util = self.gpu_util()
            if util is not None:
                self._gpu.append((now, util))
        keep = max(w.after or 0.0, w.max or 0.0, w.first or 0.0) + 60.0
        for q in (self._cpu, self._gpu):
            while len(q) > 2 and q[1][0] < now - keep:  # one sample before the window stays
                q.popleft()
        latest = self.tracker.latest(rec)
        due = self._line_at is None or now - self._line_at >= self.line_every
        if latest is not None and latest.step != self._said_step and due:
            self._said_step, self._line_at = latest.step, now
            age = max(0.0, now - latest.at)
            self.emitter.emit(
                vocab.PROGRESS,
                {"step": latest.step, "age": f"{age:.0f}"},
                f"job progress: step {latest.step}, {age:.0f}s ago",
            )
        if self.stuck is not None:
            return self.stuck
        v = decide(
            w,
            Observation(
                now=now,
                started=self._started,
                step=latest.step if latest is not None else None,
                progress_at=latest.at if latest is not None else None,
                cpu=tuple(self._cpu),
                gpu=tuple(self._gpu),
            ),
        )
        if not v.stuck:
            return v
        self.stuck = v
        fields: dict[str, object] = {
            "rule": v.rule,
            "step": "-" if latest is None else latest.step,
            "quiet": f"{v.quiet:.0f}",
            "act": self.cfg.on_stuck,
        }
        self.emitter.emit(
            vocab.JOB_STUCK, fields, vocab.fit_text(vocab.JOB_STUCK, fields, v.text), sync=True
        )
        if self.cfg.on_stuck == "end":
            self.end(vocab.END_STUCK)
        return v


class JobService:
    """The socket's thread and the watch's thread (a Service of daemon/service.py)."""

    def __init__(
        self,
        watch: JobWatch,
        server: ProgressServer,
        period: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.watch = watch
        self.server = server
        self.period = period
        self.monotonic = monotonic
        self._loop = Loop("jobwatch")

    def start(self) -> None:
        self.server.start()
        self._loop.every(self.period, lambda: self.watch.step(self.monotonic()))

    def stop(self, timeout: float = 5.0) -> bool:
        ended = self._loop.stop(timeout)
        served = self.server.stop(timeout)
        return served and ended


def gpu_util_of(latest: Callable[[], dict[str, object] | None]) -> Callable[[], float | None]:
    """The highest ``util`` of the GPU watch's latest probe sample (None: no sample, no GPU)."""

    def util() -> float | None:
        sample = latest()
        gpus = sample.get("gpus") if sample is not None else None
        vals = [
            float(g["util"])
            for g in (gpus if isinstance(gpus, list) else [])
            if isinstance(g, dict) and isinstance(g.get("util"), int | float)
        ]
        return max(vals) if vals else None

    return util
