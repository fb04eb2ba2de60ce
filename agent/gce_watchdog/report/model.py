"""The report's data: a pure function of a serial dump (no clock, no I/O, no matplotlib).

Decoding and loss accounting are :class:`gce_watchdog.poller.timeline.Timeline`; the verdict is
:func:`gce_watchdog.poller.verdict.decide`. This module only turns decoded events into what a person
looks at: one section per boot, series on one time axis, windows and markers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from gce_watchdog.poller.cost import BootFacts, Cost, boot_facts, job_cost
from gce_watchdog.poller.timeline import BootInfo, SeqGap, Timeline
from gce_watchdog.poller.verdict import InstanceState, Policy, Verdict, VerdictKind
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import Event, parse_ts

PROBES = ("metadata", "egress")
VERDICTS = ("ok", "fail", "unknown")
# Events kept for the report. The agent's own fallback file can grow past the 1 MB the Compute API
# keeps; 200k lines (~30 MB of ours, ~70 days of 30 s ticks) bounds memory at a few hundred MB.
MAX_EVENTS = 200_000
# Events that mark a point in time on the plot and in the table.
MARKER_EVENTS = vocab.MARKER_EVENTS
_GPU_FIELD_RE = re.compile(r"g(\d+)\Z")


@dataclass(frozen=True)
class RungPoint:
    ts_ms: int
    boot: str
    rung: int
    threshold: int


@dataclass(frozen=True)
class ProbePoint:
    ts_ms: int
    boot: str
    probe: str  # "metadata" | "egress"
    verdict: str  # "ok" | "fail" | "unknown"
    reason: str  # "" when the line does not say
    latency_ms: int | None  # None when the line does not say (e.g. `recovered`)


@dataclass(frozen=True)
class MemPoint:
    ts_ms: int
    boot: str
    gauge: str  # host_used, swap_used, gpu<i>_used (the memory monitor's names)
    gib: float


@dataclass(frozen=True)
class FaultWindow:
    fault_id: str
    cut: str
    boot: str
    start_ms: int
    end_ms: int
    # How it ended: "clear", "expire", "install_failed", "replaced" (a new inject took its place);
    # "reboot" (the boot ended: iptables rules
    # do not survive one), "until" (no end line, but its planned end passed within the log) or
    # "open" (still on where the log ends).
    end: str
    planned_end_ms: int | None = None


@dataclass(frozen=True)
class Marker:
    ts_ms: int
    boot: str
    kind: str  # the event name
    label: str


@dataclass
class BootSection:
    info: BootInfo
    events: list[Event] = field(default_factory=list)  # stream order

    @property
    def boot(self) -> str:
        return self.info.boot


@dataclass
class Report:
    source: str
    size: int
    lines: int
    events: list[Event]  # every event kept, stream order
    dropped_events: int  # events beyond MAX_EVENTS (not kept; accounting still exact)
    sections: list[BootSection]
    seq_gaps: list[SeqGap]
    lost_lines: int
    rejected: int
    reject_reasons: dict[str, int]
    reject_samples: list[str]
    duplicates: int
    forged: int  # intact lines that did not authenticate: an alarm, never evidence
    forged_reasons: dict[str, int]
    forged_samples: list[str]
    conflicts: int  # authenticated lines with a (boot, seq) already seen with other content
    key_id: str | None  # fingerprint of the pinned line key
    key_conflict: bool
    rungs: list[RungPoint]
    probes: list[ProbePoint]
    memory: list[MemPoint]
    faults: list[FaultWindow]
    markers: list[Marker]
    actions: list[Event]  # `shutdown` (first per boot) and `action` lines: the chain
    threshold: int | None  # from the latest rung field seen
    band_gib: float
    verdict: Verdict
    # What it cost, per boot (poller/cost.py): times from the lines (capped by their receipt)
    costs: list[BootFacts] = field(default_factory=list)

    @property
    def total_cost(self) -> Cost:
        """The dump's boots together (one instance: its boots as a union, never added twice)."""
        return job_cost(self.costs)

    @property
    def start_ms(self) -> int | None:
        return min((e.ts_ms for e in self.events), default=None)

    @property
    def end_ms(self) -> int | None:
        return max((e.ts_ms for e in self.events), default=None)


# What a person must see first (docs/report.md, "The verdict at a glance"): each class has one
# word and, in the HTML page, one colour. Checked in this order; the first that holds is shown.
#   failover    the poller fails this job over (a decided failover)
#   alarm       a human must look: an alarm verdict, lines that do not authenticate, two keys
#   dry-run     the agent decided to shut down with agent.action = "dry-run": nothing was off
#   job-failed  the job's own failure (setup_failed cause=job, workload_failed): no failover
#   unknown     no evidence either way
#   healthy     alive, or the job ended well
VERDICT_WORDS = {
    "failover": "FAILOVER",
    "alarm": "ALARM",
    "dry-run": "DRY RUN",
    "job-failed": "JOB FAILED",
    "unknown": "UNKNOWN",
    "healthy": "HEALTHY",
}
_JOB_FAILED = frozenset({VerdictKind.SETUP_FAILED, VerdictKind.WORKLOAD_FAILED})


def is_dry_run(ev: Event) -> bool:
    """A shutdown decided with ``agent.action = "dry-run"`` (its own event since protocol v2, a
    ``shutdown`` line with ``action=dry-run`` before)."""
    if ev.event == vocab.DRY_RUN_SHUTDOWN:
        return True
    return ev.event == vocab.SHUTDOWN and (ev.get("action") or "").replace("_", "-") == "dry-run"


def verdict_class(r: Report) -> str:
    """The report's class, a key of :data:`VERDICT_WORDS`."""
    v = r.verdict
    if v.failover:
        return "failover"
    if v.alarm or r.forged or r.key_conflict:
        return "alarm"
    if any(is_dry_run(ev) for ev in r.actions):
        return "dry-run"
    if v.kind in _JOB_FAILED:
        return "job-failed"
    if v.kind is VerdictKind.UNKNOWN:
        return "unknown"
    return "healthy"


def parse_rung(value: str | None) -> tuple[int, int] | None:
    return vocab.decode_rung(value)


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    v = value.removesuffix("ms")
    return int(v) if v.isdigit() else None


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def probe_points(ev: Event) -> list[ProbePoint]:
    """Probe observations in one line.

    ``tick`` lines carry ``md``/``eg`` as ``verdict/reason/latency_ms`` (the agent) or as a bare
    verdict with ``mdr``/``mdl`` beside it (older writers); ``heartbeat`` lines are written only
    after healthy ticks and carry the latencies ``mdl``/``egl``; ``recovered`` carries verdicts.
    """
    out: list[ProbePoint] = []
    for probe, key in (("metadata", "md"), ("egress", "eg")):
        if ev.event == vocab.HEARTBEAT:
            lat = _int(ev.get(f"{key}l"))
            if lat is not None:
                out.append(ProbePoint(ev.ts_ms, ev.boot, probe, "ok", "ok", lat))
            continue
        if ev.event not in (vocab.TICK, vocab.RECOVERED):
            continue
        raw = ev.get(key)
        if raw is None:
            continue
        pf = vocab.decode_probe(raw)
        verdict, reason, lat_s = pf.verdict, pf.reason, pf.latency
        if verdict not in VERDICTS:
            continue
        lat = _int(lat_s) if lat_s else _int(ev.get(f"{key}l"))
        reason = reason or ev.get(f"{key}r") or ""
        out.append(ProbePoint(ev.ts_ms, ev.boot, probe, verdict, reason, lat))
    return out


def mem_points(ev: Event) -> list[MemPoint]:
    """Gauges of a ``mem`` line (GiB): ``hu`` host used, ``sw`` swap used, ``g<i>`` GPU i used."""
    out: list[MemPoint] = []
    for k, v in ev.fields:
        if k == "hu":
            gauge = "host_used"
        elif k == "sw":
            gauge = "swap_used"
        elif m := _GPU_FIELD_RE.match(k):
            gauge = f"gpu{m.group(1)}_used"
        else:
            continue
        gib = _float(v)
        if gib is not None:
            out.append(MemPoint(ev.ts_ms, ev.boot, gauge, gib))
    return out


def _label(ev: Event) -> str:
    f = ev.fields_dict
    if ev.event == vocab.PHASE:
        return f.get("ph", "?")
    if ev.event == vocab.START:
        return f"agent start {f.get('v', '')}".strip()
    if ev.event == vocab.STOP:
        return f"agent stop ({f.get('reason', '?')})"
    if ev.event == vocab.SHUTDOWN:
        return f"SHUTDOWN {f.get('rung', '')} {f.get('action', '')}".strip()
    if ev.event == vocab.WOULD_SHUTDOWN:
        return f"would shut down {f.get('rung', '')}".strip()
    if ev.event == vocab.SETUP_FAILED:
        return f"setup_failed {f.get('step', '?')}"
    if ev.event == vocab.EXIT:
        return f"exit rc={f.get('rc', '?')}"
    if ev.event == vocab.RECOVERED:
        return f"recovered from {f.get('from', '?')}"
    if ev.event in (vocab.MEMORY_CLIMB, vocab.MEMORY_OK):
        return f"{ev.event} {f.get('g', '?')}"
    return ev.event


def _fault_windows(events: list[Event], boot_end: dict[str, int]) -> list[FaultWindow]:
    open_: dict[str, tuple[Event, int | None]] = {}
    out: list[FaultWindow] = []
    for ev in events:
        if ev.event != vocab.FAULT:
            continue
        op, fid = ev.get("op"), ev.get("id", "-") or "-"
        if op == "inject":
            until = ev.get("until")
            planned = None
            if until:
                ms = parse_ts(until.replace("Z", ".000Z") if "." not in until else until)
                planned = ms
            open_[fid] = (ev, planned)
        elif op in ("clear", "expire"):
            start = open_.pop(fid, None)
            if start is None:
                continue  # its inject line was lost: nothing to draw from
            inj, planned = start
            why = ev.get("why")
            end = why if why in ("install_failed", "replaced") else op
            out.append(
                FaultWindow(
                    fid, inj.get("cut", "?") or "?", inj.boot, inj.ts_ms, ev.ts_ms, end, planned
                )
            )
    log_end = max((e.ts_ms for e in events), default=0)
    latest = events[-1].boot if events else ""
    for fid, (inj, planned) in open_.items():
        if inj.boot != latest:  # that boot ended: the rules went with it
            end_ms, how = boot_end.get(inj.boot, inj.ts_ms), "reboot"
        elif planned is not None and planned <= log_end:
            end_ms, how = planned, "until"
        else:
            end_ms, how = log_end, "open"
        out.append(
            FaultWindow(
                fid,
                inj.get("cut", "?") or "?",
                inj.boot,
                inj.ts_ms,
                max(end_ms, inj.ts_ms),
                how,
                planned,
            )
        )
    out.sort(key=lambda w: w.start_ms)
    return out


def _costs(sections: list[BootSection], instance: str, gpus: int, mt: str) -> list[BootFacts]:
    """Each boot's cost facts, from its lines capped by their receipt (poller/cost.py)."""
    out = []
    for sec in sections:
        f = boot_facts(instance, sec.events, last_rx=sec.info.last_rx, gpus=gpus, machine_type=mt)
        if f is not None:
            out.append(f)
    return out


def from_timeline(
    tl: Timeline,
    events: list[Event],
    *,
    source: str = "",
    size: int = 0,
    dropped_events: int = 0,
    now: float | None = None,
    instance: InstanceState | None = None,
    policy: Policy | None = None,
    band_gib: float = 1.0,
    gpus: int = 0,
    machine_type: str = "",
) -> Report:
    """Build the report from a finished timeline and every event it yielded (stream order).

    ``now`` (Unix seconds, the reader's clock) is what silence is judged against, from when the
    bytes were received (what the timeline was fed with); None: as of their receipt.
    """
    by_boot: dict[str, BootSection] = {
        b.boot: BootSection(b) for b in sorted(tl.boots.values(), key=lambda b: b.order)
    }
    rungs: list[RungPoint] = []
    probes: list[ProbePoint] = []
    memory: list[MemPoint] = []
    markers: list[Marker] = []
    actions: list[Event] = []
    threshold: int | None = None
    shutdown_seen: set[str] = set()
    for ev in events:
        sec = by_boot.get(ev.boot)
        if sec is not None:
            sec.events.append(ev)
        r = parse_rung(ev.get("rung"))
        if r is not None:
            rungs.append(RungPoint(ev.ts_ms, ev.boot, r[0], r[1]))
            threshold = r[1]
        probes.extend(probe_points(ev))
        if ev.event == vocab.MEM:
            memory.extend(mem_points(ev))
        if ev.event in (vocab.SHUTDOWN, vocab.DRY_RUN_SHUTDOWN):
            if ev.get("rep"):
                continue  # the linger repeats the verdict line; the first one is the decision
            if ev.event == vocab.SHUTDOWN:
                if ev.boot in shutdown_seen:
                    continue
                shutdown_seen.add(ev.boot)
            actions.append(ev)
        elif ev.event == vocab.ACTION:
            actions.append(ev)
        if ev.event in MARKER_EVENTS:
            markers.append(Marker(ev.ts_ms, ev.boot, ev.event, _label(ev)))
    boot_end = {b.boot: b.last_ts_ms for b in tl.boots.values()}
    cur = tl.latest_boot
    rx = tl.boots[cur].last_rx if cur is not None else None
    judged_at = now if now is not None else (rx or 0.0)
    verdict = tl.judge(instance or InstanceState(), judged_at, policy or Policy())
    return Report(
        source=source,
        size=size,
        lines=tl.lines,
        events=events,
        dropped_events=dropped_events,
        sections=list(by_boot.values()),
        seq_gaps=list(tl.seq_gaps),
        lost_lines=tl.lost_lines,
        rejected=tl.rejected,
        reject_reasons=tl.reject_reasons,
        reject_samples=list(tl.reject_samples),
        duplicates=tl.duplicates,
        forged=tl.forged,
        forged_reasons=tl.forged_reasons,
        forged_samples=list(tl.forged_samples),
        conflicts=tl.conflicts,
        key_id=tl.key_id,
        key_conflict=tl.key_conflict,
        rungs=rungs,
        probes=probes,
        memory=memory,
        faults=_fault_windows(events, boot_end),
        markers=markers,
        actions=actions,
        threshold=threshold,
        band_gib=band_gib,
        verdict=verdict,
        costs=_costs(list(by_boot.values()), source or "-", gpus, machine_type),
    )


def build_report(
    data: bytes | Iterable[bytes],
    *,
    source: str = "",
    now: float | None = None,
    received: float | None = None,
    pin: bytes | None = None,
    instance: InstanceState | None = None,
    policy: Policy | None = None,
    band_gib: float = 1.0,
    gpus: int = 0,
    machine_type: str = "",
) -> Report:
    """Decode a dump (bytes, or chunks in order) received at ``received`` and build its report
    (``pin``: the instance's v3 public key; default: the dump's first announcement)."""
    tl = Timeline(pin=pin)
    kept: list[Event] = []
    dropped = size = 0
    chunks: Iterable[bytes] = [data] if isinstance(data, bytes | bytearray) else data

    def keep(new: list[Event]) -> None:
        nonlocal dropped
        room = MAX_EVENTS - len(kept)
        kept.extend(new[: max(room, 0)])
        dropped += max(0, len(new) - max(room, 0))

    for chunk in chunks:
        size += len(chunk)
        keep(tl.feed(bytes(chunk), received))
    keep(tl.finish(received))
    keep(tl.settle(received, checks=None))  # a dump: every line a flood delayed is checked
    return from_timeline(
        tl,
        tl.accepted(kept),  # a contested start's announcements are taken back
        source=source,
        size=size,
        dropped_events=dropped,
        now=now,
        instance=instance,
        policy=policy,
        band_gib=band_gib,
        gpus=gpus,
        machine_type=machine_type,
    )
