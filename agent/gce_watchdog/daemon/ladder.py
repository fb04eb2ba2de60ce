"""The ladder: a pure state machine from one tick's probe verdicts to the next state and actions.

No clock, no I/O, no logging. The daemon feeds it one :class:`Observation` per tick and performs
the returned actions.

Rules (``docs/agent.md`` explains the why):

- both probes ``fail``: climb one rung (capped at the threshold);
- either probe ``ok``: reset to 0 (emitting :class:`Recovered` if the rung was above 0);
- anything else (an ``unknown`` verdict with no ``ok``): hold. ``unknown`` means the probe could not
  be run at all, which is evidence neither of an outage nor of health, so it must not push a healthy
  VM towards shutdown and must not hide a real outage either;
- during the boot grace period a both-fail tick holds instead of climbing;
- reaching the threshold armed emits :class:`Shutdown` once per boot; disarmed, it emits
  :class:`WouldShutdown` once per climb and keeps the rung at the threshold, so arming again
  while the outage lasts fires on the next both-fail tick.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class ProbeVerdict(StrEnum):
    OK = "ok"
    FAIL = "fail"
    UNKNOWN = "unknown"


class TickClass(StrEnum):
    BOTH_FAIL = "both_fail"
    ANY_OK = "any_ok"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Observation:
    metadata: ProbeVerdict
    egress: ProbeVerdict
    in_grace: bool = False
    armed: bool = True


@dataclass(frozen=True)
class LadderState:
    rung: int = 0
    fired: bool = False  # the shutdown was decided; never again in this boot
    warned: bool = False  # disarmed "would shut down" already said for this climb


@dataclass(frozen=True)
class Climb:
    rung: int
    threshold: int


@dataclass(frozen=True)
class Hold:
    rung: int
    why: str  # "inconclusive" | "grace" | "decided"


@dataclass(frozen=True)
class Recovered:
    from_rung: int


@dataclass(frozen=True)
class Shutdown:
    rung: int
    threshold: int


@dataclass(frozen=True)
class WouldShutdown:
    rung: int
    threshold: int


Action = Climb | Hold | Recovered | Shutdown | WouldShutdown


def classify(metadata: ProbeVerdict, egress: ProbeVerdict) -> TickClass:
    if metadata is ProbeVerdict.OK or egress is ProbeVerdict.OK:
        return TickClass.ANY_OK
    if metadata is ProbeVerdict.FAIL and egress is ProbeVerdict.FAIL:
        return TickClass.BOTH_FAIL
    return TickClass.INCONCLUSIVE


def step(
    state: LadderState, obs: Observation, threshold: int
) -> tuple[LadderState, tuple[Action, ...]]:
    """One tick. Raises ValueError on a broken invariant (loud in the core)."""
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    if not 0 <= state.rung <= threshold:
        raise ValueError(f"rung {state.rung} outside 0..{threshold}")
    if state.fired:
        return state, (Hold(state.rung, "decided"),)

    cls = classify(obs.metadata, obs.egress)
    if cls is TickClass.ANY_OK:
        if state.rung == 0 and not state.warned:
            return state, ()
        return LadderState(), (Recovered(state.rung),)
    if cls is TickClass.INCONCLUSIVE:
        return state, (Hold(state.rung, "inconclusive"),)
    if obs.in_grace:
        return state, (Hold(state.rung, "grace"),)

    rung = min(state.rung + 1, threshold)
    actions: list[Action] = [Climb(rung, threshold)]
    new = replace(state, rung=rung)
    if rung >= threshold:
        if obs.armed:
            actions.append(Shutdown(rung, threshold))
            new = replace(new, fired=True)
        elif not state.warned:
            actions.append(WouldShutdown(rung, threshold))
            new = replace(new, warned=True)
    return new, tuple(actions)
