"""The stuck rule: is the job started by ``gce-watchdog exec`` stuck? Pure: times in, verdict out.

A job reports progress (``gce-watchdog progress --step N``); the agent samples the CPU seconds of
the job's process tree and, where NVML is present, the GPUs' utilisation. From those:

* **idle**: no progress for ``after`` while the tree is idle over that whole window: CPU time
  *flat* (it rose by less than :data:`IDLE_CPU_FRACTION` of one core over the window, and never
  fell: a fall means the tree changed, which is not evidence of idleness) and, where known, every
  GPU utilisation sample in the window at most :data:`IDLE_GPU_PCT`. A window the samples do not
  cover is not idle (no evidence is no verdict).
* **max**: no progress for ``max``, whatever the activity (a GPU kernel spinning on a dead peer is
  busy and stuck; a checkpoint is busy and not stuck: ``max`` must exceed the longest checkpoint).
* **first**: before the first step, when ``first`` is set, the one window is ``first`` from the
  job's start, whatever the activity: start-up (imports, downloads, rendezvous, a checkpoint load)
  is long and may be idle or busy, so neither is evidence. With ``first`` unset, the job's start
  stands for the last progress and ``after``/``max`` apply from it.

A job with no window never is stuck. Steps strictly increase (:func:`advance`): a repeated or lower
step is not progress, so a beating thread over a stuck loop is caught.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

# "Flat": the tree used less than 1 % of one core over the window. A process blocked in a futex,
# a socket read or SIGSTOP uses none; Python's own housekeeping threads (a beating one included)
# use far less than this; a data loader or a checkpoint write uses far more.
IDLE_CPU_FRACTION = 0.01
# NVML's utilisation is the share of the last sample period a kernel ran: an idle GPU reads 0;
# monitoring tools' own queries can read a few percent.
IDLE_GPU_PCT = 5.0


@dataclass(frozen=True, slots=True)
class Windows:
    """The job's windows in seconds; ``None``: that rule is off."""

    after: float | None = None
    max: float | None = None
    first: float | None = None

    @property
    def any(self) -> bool:
        return self.after is not None or self.max is not None or self.first is not None


@dataclass(frozen=True, slots=True)
class Observation:
    """What the agent knows at ``now`` (monotonic seconds, like every time here).

    ``cpu``: (time, CPU seconds of the tree) samples, oldest first. ``gpu``: (time, the highest
    utilisation percent of the GPUs) samples, oldest first; empty where NVML is absent."""

    now: float
    started: float
    step: int | None = None
    progress_at: float | None = None
    cpu: Sequence[tuple[float, float]] = ()
    gpu: Sequence[tuple[float, float]] = ()


@dataclass(frozen=True, slots=True)
class Verdict:
    stuck: bool
    rule: str  # idle, max, first; "" when not stuck
    quiet: float  # seconds since the last progress (or the job's start)
    text: str


def advance(last: int | None, step: int | None) -> int | None:
    """The new step if ``step`` is progress after ``last``, else ``None``. No step given: the next
    one (each call is a step)."""
    if step is None:
        return 0 if last is None else last + 1
    if last is None or step > last:
        return step
    return None


def cpu_flat(samples: Sequence[tuple[float, float]], start: float) -> bool:
    """Whether the samples cover ``[start, last sample]`` and the CPU time in it is flat."""
    base = None
    for i, (t, _) in enumerate(samples):
        if t <= start:
            base = i
    if base is None:
        return False  # the window starts before the first sample: not covered
    window = samples[base:]
    if len(window) < 2:
        return False
    for (_, a), (_, b) in itertools.pairwise(window):
        if b < a:
            return False
    span = window[-1][0] - window[0][0]
    if span <= 0:
        return False
    return window[-1][1] - window[0][1] < IDLE_CPU_FRACTION * span


def gpu_idle(samples: Sequence[tuple[float, float]], start: float) -> bool:
    """Every known GPU sample in the window is idle (none known: idle as far as we know)."""
    return all(u <= IDLE_GPU_PCT for t, u in samples if t >= start)


def decide(w: Windows, o: Observation) -> Verdict:
    """The verdict at ``o.now``."""
    first_step = o.step is None or o.progress_at is None
    since = o.started if first_step else o.progress_at
    assert since is not None
    quiet = max(0.0, o.now - since)
    if not w.any:
        return Verdict(False, "", quiet, "no window")
    if first_step and w.first is not None:
        if quiet >= w.first:
            return Verdict(True, "first", quiet, f"no first step {quiet:.0f}s after the start")
        return Verdict(False, "", quiet, "before the first step")
    what = "no first step" if first_step else f"no progress since step {o.step}"
    if w.max is not None and quiet >= w.max:
        return Verdict(True, "max", quiet, f"{what} for {quiet:.0f}s")
    if w.after is not None and quiet >= w.after:
        start = o.now - w.after
        if cpu_flat(o.cpu, start) and gpu_idle(o.gpu, start):
            return Verdict(True, "idle", quiet, f"{what} for {quiet:.0f}s, the job idle")
    return Verdict(False, "", quiet, "progressing or busy")
