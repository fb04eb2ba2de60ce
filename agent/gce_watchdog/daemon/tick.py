"""The values one tick produces: each probe's result, the tick's result, and its report (what the
metrics exporter and the tests see). Pure data, shared by probes, the service and the exporter, so
that none of them imports another for a type (the exporter and the service used to import each
other)."""

from __future__ import annotations

from dataclasses import dataclass

from gce_watchdog.daemon import ladder
from gce_watchdog.daemon.ladder import LadderState, ProbeVerdict


@dataclass(frozen=True)
class ProbeResult:
    verdict: ProbeVerdict
    reason: str
    latency_ms: int
    detail: str = ""  # metadata: the first bytes of the body (the instance id for instance/id)


@dataclass(frozen=True)
class TickResult:
    metadata: ProbeResult
    egress: ProbeResult
    dns: str  # "ok" | "fail" | "-" (no names to resolve)


@dataclass(frozen=True)
class TickReport:
    n: int
    result: TickResult
    state: LadderState
    actions: tuple[ladder.Action, ...]
    duration: float
    overruns: int = 0  # ticks so far that ran past their slot (the next one started at once)
    skipped: int = 0  # slots so far that got no tick (inside stalls)
    stalls: int = 0  # gaps so far of more than two intervals between tick starts
    armed: bool | None = None  # the disarm/platform gate's answer this tick (None: not asked)
