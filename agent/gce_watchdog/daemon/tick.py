"""The values one tick produces: each probe's result, the tick's result, and its report (what the
metrics exporter and the tests see). Pure data, shared by probes, the service and the exporter, so
that none of them imports another for a type (the exporter and the service used to import each
other). And the words the operator reads for a tick (:func:`tick_lines`), a pure function of the
tick's outcome that ``Agent.tick_once`` writes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gce_watchdog.daemon import ladder
from gce_watchdog.daemon.ladder import LadderState, ProbeVerdict
from gce_watchdog.wire import vocab


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


@dataclass(frozen=True)
class Line:
    """One line for the console and the journal: ``Emitter.emit(event, fields, text, sync)``."""

    event: str
    fields: Mapping[str, object]
    text: str = ""
    sync: bool = False


@dataclass(frozen=True)
class TickLines:
    """What a tick says, in the order the agent says it: ``lines`` (a recovery, then the tick or
    the heartbeat), then systemd's ``STATUS=`` (``status``), then ``would`` (a disarmed "would
    shut down"). ``streak``: the healthy ticks in a row after this one."""

    streak: int
    lines: tuple[Line, ...]
    status: str
    would: tuple[Line, ...]


def probe_field(r: ProbeResult) -> str:
    return vocab.encode_probe(r.verdict.value, r.reason, r.latency_ms)


def tick_text(state: LadderState, actions: Sequence[ladder.Action], threshold: int) -> str:
    """The text of a ``tick`` line (a tick that is not healthy, or not at rung 0)."""
    if any(isinstance(a, ladder.Climb) for a in actions):
        return f"BOTH reachability probes FAILED ({state.rung}/{threshold})"
    if any(isinstance(a, ladder.Hold) and a.why == "grace" for a in actions):
        return "BOTH reachability probes FAILED (boot grace, not counted)"
    if state.fired:
        return f"shutdown already decided ({state.rung}/{threshold})"
    return "one reachability probe failed, ladder holds"


def tick_lines(
    res: TickResult,
    state: LadderState,
    actions: Sequence[ladder.Action],
    threshold: int,
    *,
    streak: int,
    heartbeat_every: int,
    ticks: int,
    dropped: int,
    why: str,
    rehearsing: bool,
    phase: Callable[[], str],
) -> TickLines:
    """The lines of one tick, from its result, the ladder's new ``state`` and ``actions``.
    ``streak``: the healthy ticks in a row before this one; ``ticks``: this tick's number;
    ``dropped``: the console's dropped lines; ``why``: the gate's reason when disarmed;
    ``rehearsing``: a dry run that is armed rehearses the chain instead of a "would shut down"
    line. ``phase`` is read only for a line that carries it (a heartbeat is not every tick)."""
    rung = vocab.encode_rung(state.rung, threshold)
    md, eg = res.metadata, res.egress
    lines = [
        Line(
            vocab.RECOVERED,
            {"from": a.from_rung, "rung": rung, "md": md.verdict, "eg": eg.verdict},
            f"reachability restored after {a.from_rung}/{threshold}",
        )
        for a in actions
        if isinstance(a, ladder.Recovered)
    ]
    healthy = md.verdict is ProbeVerdict.OK and eg.verdict is ProbeVerdict.OK
    if not healthy or state.rung > 0:
        streak = 0
        drop = {"drop": dropped} if dropped else {}
        fields = {"rung": rung, "md": probe_field(md), "eg": probe_field(eg), "dns": res.dns}
        text = tick_text(state, actions, threshold)
        lines.append(Line(vocab.TICK, {**fields, "ph": phase(), **drop}, text))
    else:
        streak += 1
        if streak % heartbeat_every == 0:
            beat = {"rung": rung, "ph": phase(), "ticks": ticks, "dns": res.dns}
            beat |= {"mdl": md.latency_ms, "egl": eg.latency_ms, "drop": dropped}
            lines.append(Line(vocab.HEARTBEAT, beat))
    status = f"rung {rung}, metadata {md.verdict.value}, egress {eg.verdict.value}"
    would = tuple(
        Line(
            vocab.WOULD_SHUTDOWN,
            {"rung": rung, "why": why or "disarmed"},
            f"disarmed: would shut down ({rung})",
            sync=True,
        )
        for a in actions
        if isinstance(a, ladder.WouldShutdown) and not rehearsing
    )
    return TickLines(streak, tuple(lines), status, would)
