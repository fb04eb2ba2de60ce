"""GPU fault decisions: Xid episodes (dedup) and the second-signal rule. Pure: no clock, no I/O.

An *episode* of one (GPU, Xid) starts with its first record and lasts while records keep arriving
less than ``quiet`` seconds apart: a flood of 800,000 identical records (as NVSentinel reported for
Xid 95) is one episode and so one line. Times are the caller's monotonic seconds.

A hardware Xid decides ``fault`` only with a second signal on the same GPU (NVML: a lost handle,
a row-remap failure or pending remap, uncorrectable ECC rising, a recovery action other than
None; or the job's progress stopping), or, where NVML cannot answer at all, once the Xid has
stood unanswered for ``unanswered_window`` seconds. Everything else is an ``event``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from gce_watchdog.gpu.xid import XidClass, XidRecord

# Bounded memory whatever the kernel prints: past this many open episodes the oldest is dropped
# (it can only reopen as a new episode, i.e. one more line).
MAX_EPISODES = 256


@dataclass(frozen=True, slots=True)
class Episodes:
    """Open episodes: (pci, xid) -> monotonic time of the episode's last record."""

    last_seen: dict[tuple[str, int], float] = field(default_factory=dict)


def observe(state: Episodes, rec: XidRecord, now: float, quiet: float) -> tuple[Episodes, bool]:
    """The state after ``rec`` at ``now``, and whether ``rec`` starts a new episode (say it)."""
    key = (rec.pci, rec.xid)
    prev = state.last_seen.get(key)
    new = prev is None or now - prev >= quiet or now < prev
    seen = dict(state.last_seen)
    seen.pop(key, None)
    seen[key] = now
    while len(seen) > MAX_EPISODES:
        seen.pop(next(iter(seen)))
    return replace(state, last_seen=seen), new


class SecondSignal(Enum):
    NONE = "none"
    HANDLE_LOST = "handle_lost"  # NVML_ERROR_GPU_IS_LOST on this GPU's handle, or count below boot
    REMAP_FAILED = "remap_failed"  # nvmlDeviceGetRemappedRows: failureOccurred
    REMAP_PENDING = "remap_pending"  # nvmlDeviceGetRemappedRows: isPending
    ECC_RISING = "ecc_rising"  # uncorrected volatile ECC count above the last sample
    RECOVERY_ACTION = "recovery_action"  # the driver's recovery action is not None
    PROGRESS_STOPPED = "progress_stopped"  # the job's reported progress stopped
    NVML_UNANSWERED = "nvml_unanswered"  # NVML could not answer at all (a stall, no library)


class GpuDecision(Enum):
    FAULT = "gpu_fault"
    EVENT = "gpu_event"


def decide(
    xid_class: XidClass, signal: SecondSignal, unanswered_for: float, window: float
) -> GpuDecision:
    """The line an Xid record of ``xid_class`` earns given the second signal on the same GPU.

    ``unanswered_for`` is how long NVML has been unable to answer for this GPU (0 when it answers);
    it counts as a second signal only past ``window``.
    """
    if xid_class is not XidClass.HARDWARE:
        return GpuDecision.EVENT
    if signal is SecondSignal.NONE:
        return GpuDecision.EVENT
    if signal is SecondSignal.NVML_UNANSWERED and not unanswered_for >= window:
        return GpuDecision.EVENT
    return GpuDecision.FAULT
