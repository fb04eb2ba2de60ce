"""What it cost (pure): one boot's facts in, billed, useful, ladder, linger, zombie and GPU
seconds out; a job's sum across its boots and instances (docs/job-progress.md, "What it cost").

Every category is a set of intervals on one time axis (Unix seconds), measured as a union, so a
second is never counted twice: within one boot the categories are clipped to what was billed;
across boots, the intervals of one instance are merged before they are measured (two records of
the same boot, or two boots whose clocks overlap, add nothing twice), and only different
instances add up (two machines billed in the same second are two machine-seconds).

Where each time comes from is the caller's choice (:func:`boot_facts` takes the serial lines'
signed times, capped by when the reader received them; the poller passes the Compute API's
``lastStartTimestamp``/``lastStopTimestamp`` and the ledger's reap time). No clock, no I/O.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from gce_watchdog.lib import jsontime
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import Event

Interval = tuple[float, float]

CATEGORIES = ("billed", "useful", "ladder", "linger", "zombie")

# GPUs per machine type (Google Cloud, "GPU machine types", cloud.google.com/compute/docs/gpus,
# and "Accelerator-optimized machine family", cloud.google.com/compute/docs/
# accelerator-optimized-machines). A2, A3, A4 and A4X name their count: ``-<n>g`` (a2-highgpu-1g:
# 1 A100, a2-megagpu-16g: 16, a3-highgpu-8g: 8 H100, a3-ultragpu-8g: 8 H200, a4-highgpu-8g: 8
# B200, a4x-highgpu-4g: 4 GB200). G2 (L4) and G4 (RTX PRO 6000) do not: their table is below.
# N1 machines carry attached GPUs only as ``guestAccelerators``, which wins whenever present.
_NAMED_COUNT = re.compile(r"(a2|a3|a4|a4x)-[a-z]+-(\d+)g\Z")
_FIXED = {
    "g2-standard-4": 1, "g2-standard-8": 1, "g2-standard-12": 1, "g2-standard-16": 1,
    "g2-standard-32": 1, "g2-standard-24": 2, "g2-standard-48": 4, "g2-standard-96": 8,
    "g4-standard-48": 1, "g4-standard-96": 2, "g4-standard-192": 4, "g4-standard-384": 8,
}  # fmt: skip


def machine_type_name(machine_type: str) -> str:
    """``zones/z/machineTypes/a3-highgpu-8g`` (the resource's URL) -> ``a3-highgpu-8g``."""
    return machine_type.rstrip("/").rsplit("/", 1)[-1]


def gpu_count(machine_type: str, accelerators: Sequence[Mapping[str, Any]] | None = None) -> int:
    """The instance's GPUs: ``guestAccelerators`` (the instance resource's list of
    ``{acceleratorType, acceleratorCount}``) when present, else the machine type's own (0 for a
    type without GPUs, or one not in the table)."""
    if accelerators:
        total = 0
        for a in accelerators:
            n = a.get("acceleratorCount", 0)
            total += n if isinstance(n, int) and n > 0 else 0
        return total
    name = machine_type_name(machine_type)
    if m := _NAMED_COUNT.match(name):
        return int(m.group(2))
    return _FIXED.get(name, 0)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint, non-empty intervals covering exactly what ``intervals`` cover."""
    out: list[Interval] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def measure(intervals: Iterable[Interval]) -> float:
    """Seconds covered by the union of ``intervals``."""
    return sum(b - a for a, b in union(intervals))


@dataclass(frozen=True)
class BootFacts:
    """One boot's times (Unix seconds) and its machine: what :func:`boot_intervals` needs.

    ``end``: when the instance stopped being billed for this boot (TERMINATED; or as far as it
    was seen). ``useful_end``: the last ``progress`` or ``result`` line (None: none).
    ``ladder_start``: the first failing rung of the climb that ended the boot, or its stall
    (None: none).
    ``final``: the shutdown decision (None: none). ``deleted``: the VM's deletion (None: not yet).
    """

    instance: str  # the instance id (or project/zone/name)
    boot: str
    start: float
    end: float
    useful_end: float | None = None
    ladder_start: float | None = None
    final: float | None = None
    deleted: float | None = None
    gpus: int = 0
    machine_type: str = ""

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> BootFacts:
        """The facts :meth:`to_json` wrote (unknown keys ignored: a newer writer's)."""

        def t(key: str) -> float | None:
            v = doc.get(key)
            return float(v) if isinstance(v, int | float) else None

        return cls(
            instance=str(doc.get("instance", "")),
            boot=str(doc.get("boot", "")),
            start=float(doc["start"]),
            end=float(doc["end"]),
            useful_end=t("useful_end"),
            ladder_start=t("ladder_start"),
            final=t("final"),
            deleted=t("deleted"),
            gpus=int(doc.get("gpus") or 0),
            machine_type=str(doc.get("machine_type") or ""),
        )


def boot_intervals(f: BootFacts) -> dict[str, list[Interval]]:
    """Each category's intervals for one boot (docs/job-progress.md, "What it cost"):

    - billed: [start, end): the instance ran (RUNNING is what GCE bills a VM and its GPUs for)
    - useful: [start, last progress or result), within billed
    - ladder: [first failing rung or stall, shutdown decision, else end), within billed
    - linger: [shutdown decision, end), within billed: the agent repeats its verdict, then off
    - zombie: [end, deleted): off (disks still billed) until the VM is deleted
    """
    end = max(f.end, f.start)
    stop = f.final if f.final is not None else end
    return {
        "billed": _span(f.start, end, f.start, end),
        "useful": _span(f.start, f.useful_end, f.start, end),
        "ladder": _span(f.ladder_start, stop, f.start, end),
        "linger": _span(f.final, end, f.start, end),
        "zombie": _span(end, f.deleted, end, f.deleted),
    }


def _span(a: float | None, b: float | None, lo: float, hi: float | None) -> list[Interval]:
    """[a, b) clipped to [lo, hi), as a list of at most one interval (None: no interval)."""
    if a is None or b is None or hi is None:
        return []
    a, b = max(a, lo), min(b, hi)
    return [(a, b)] if b > a else []


@dataclass(frozen=True)
class Cost:
    """Seconds per category, and GPU-seconds (billed seconds times the GPUs billed with them)."""

    billed: float = 0.0
    useful: float = 0.0
    ladder: float = 0.0
    linger: float = 0.0
    zombie: float = 0.0
    gpu: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        """Two costs side by side (different instances: nothing shared)."""
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_json(self) -> dict[str, float]:
        """The JSON view: ``<category>_seconds`` (3 decimals)."""
        return {f"{f.name}_seconds": round(getattr(self, f.name), 3) for f in fields(self)}


def boot_cost(f: BootFacts) -> Cost:
    """One boot's cost."""
    return job_cost([f])


def _gpu_seconds(boots: Sequence[BootFacts], billed: Sequence[list[Interval]]) -> float:
    """One instance's GPU-seconds: over the union of its billed intervals, at each moment the
    largest GPU count of the boots billed then (a boot counted twice adds nothing)."""
    spans = [(iv, b.gpus) for b, ivs in zip(boots, billed, strict=True) for iv in ivs]
    points = sorted({p for (a, z), _ in spans for p in (a, z)})
    total = 0.0
    for lo, hi in itertools.pairwise(points):
        gpus = max((g for (a, z), g in spans if a <= lo and hi <= z), default=0)
        total += (hi - lo) * gpus
    return total


def job_cost(boots: Iterable[BootFacts]) -> Cost:
    """A job's cost across its boots and instances: per instance, each category is the measure
    of the union of its boots' intervals (zombie: less what another boot of that instance was
    billed for, so billed and zombie never share a second); the instances' measures add up."""
    by_instance: dict[str, list[BootFacts]] = {}
    for b in boots:
        by_instance.setdefault(b.instance, []).append(b)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    gpu = 0.0
    for group in by_instance.values():
        per = [boot_intervals(b) for b in group]
        for cat in CATEGORIES:
            totals[cat] += measure(iv for p in per for iv in p[cat])
        billed = [iv for p in per for iv in p["billed"]]
        zombie = [iv for p in per for iv in p["zombie"]]
        totals["zombie"] += measure(billed + zombie) - measure(billed) - measure(zombie)
        gpu += _gpu_seconds(group, [p["billed"] for p in per])
    return Cost(gpu=gpu, **totals)


def _time(t: float | None) -> str | None:
    return None if t is None else jsontime.from_epoch(t, fraction=t != int(t))


def cost_doc(f: BootFacts, cost: Cost | None = None) -> dict[str, Any]:
    """One boot's facts and cost as JSON (``report --json``, the decisions view): the times as
    RFC 3339, the seconds per category as ``<category>_seconds``."""
    times = ("start", "end", "useful_end", "ladder_start", "final", "deleted")
    doc = {k: (_time(v) if k in times else v) for k, v in f.to_json().items()}
    return {**doc, **(cost or boot_cost(f)).to_json()}


def with_deletion(f: BootFacts, deleted: float | None) -> BootFacts:
    """The facts with the VM's deletion time (the ledger's reap), when known."""
    return f if deleted is None else replace(f, deleted=max(deleted, f.end))


# Lines that say the job moved: the last one ends the useful time.
USEFUL_EVENTS = frozenset({vocab.PROGRESS, vocab.RESULT})
# Lines that start the ladder without a rung: the job's or a GPU's stall.
STALL_EVENTS = frozenset({vocab.STALL, vocab.JOB_STUCK, vocab.GPU_STALL, vocab.GPU_FAULT})
# The decision to power off (the first one; the linger repeats it with ``rep``).
FINAL_EVENTS = frozenset({vocab.SHUTDOWN})


def _ladder_start(events: Sequence[Event]) -> int | None:
    """The first failing rung of the last climb (after the last rung 0), or the first stall
    after it, whichever is earlier (ms, the lines' time)."""
    start: int | None = None
    for ev in events:
        rung = vocab.decode_rung(ev.get("rung"))
        if (rung is not None and rung[0] == 0) or ev.event == vocab.RECOVERED:
            start = None
        elif (rung is not None and rung[0] > 0) or ev.event in STALL_EVENTS:
            start = ev.ts_ms if start is None else start
    return start


def boot_facts(
    instance: str,
    events: Sequence[Event],
    *,
    last_rx: float | None = None,
    span_ms: tuple[int, int] | None = None,
    started: float | None = None,
    stopped: float | None = None,
    gpus: int = 0,
    machine_type: str = "",
) -> BootFacts | None:
    """One boot's facts from its lines (stream order; None: no line). Times from where:

    - the lines' signed times (the guest's clock, NTP-synced to the metadata server), each capped
      by ``last_rx`` (the reader's clock when the boot's newest line was received: no line was
      written after it was read); ``span_ms``: the boot's first and last line when ``events``
      is not all of them (the poller's compacted timeline keeps the span in ``BootInfo``);
    - ``started`` (the Compute API's ``lastStartTimestamp``) replaces the first line's time
      when it is earlier (the VM runs, and is billed, before the agent writes its first line);
    - ``stopped`` (``lastStopTimestamp``, when it is this boot's) ends the billed time; else the
      boot's last line does.
    """
    if not events:
        return None
    cap = float("inf") if last_rx is None else last_rx

    def at(ms: int) -> float:
        return min(ms / 1000.0, cap)

    def t(ms: int | None) -> float | None:
        return None if ms is None else at(ms)

    stamps = [e.ts_ms for e in events] + list(span_ms or ())
    first, last = at(min(stamps)), at(max(stamps))
    start = first if started is None or started > first else started
    end = last if stopped is None or stopped < start else max(stopped, start)
    useful = [e.ts_ms for e in events if e.event in USEFUL_EVENTS]
    final = [e.ts_ms for e in events if e.event in FINAL_EVENTS and not e.get("rep")]
    return BootFacts(
        instance=instance,
        boot=events[0].boot,
        start=start,
        end=end,
        useful_end=t(max(useful)) if useful else None,
        ladder_start=t(_ladder_start(events)),
        final=t(min(final)) if final else None,
        gpus=gpus,
        machine_type=machine_type,
    )
