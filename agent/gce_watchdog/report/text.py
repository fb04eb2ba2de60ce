"""The terminal view: one compact table per boot, the faults, the action chain, what was lost,
and a one-line verdict. No optional dependency."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gce_watchdog.poller.cost import Cost, boot_cost
from gce_watchdog.report.model import FaultWindow, Report
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import Event, format_ts

# Shown per table; the rest is summarised (the HTML and --json have every event).
MAX_ROWS_PER_BOOT = 200
MAX_GAPS_SHOWN = 10
# Fields shown in their own columns (not repeated in the detail column).
_COLUMN_FIELDS = frozenset({"rung", "md", "eg", "mdr", "mdl", "egr", "egl"})


def clock(ts_ms: int) -> str:
    """ISO 8601 UTC to the second, as every human line of ours writes time."""
    return datetime.fromtimestamp(ts_ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def duration(ms: int) -> str:
    s = max(0, ms) // 1000
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def probe_cell(ev: Event, key: str) -> str:
    """``fail timeout 5001ms`` from ``md=fail/timeout/5001`` (or ``md``/``mdr``/``mdl``)."""
    if ev.event == vocab.HEARTBEAT:
        lat = ev.get(f"{key}l")
        return f"ok {lat}ms" if lat else ""
    raw = ev.get(key)
    if raw is None:
        return ""
    pf = vocab.decode_probe(raw)
    reason = pf.reason or ev.get(f"{key}r") or ""
    lat = pf.latency or ev.get(f"{key}l") or ""
    return vocab.human_value(key, vocab.encode_probe(pf.verdict, reason, lat))


def detail(ev: Event) -> str:
    kv = vocab.human_fields(ev.fields, skip=_COLUMN_FIELDS)
    if ev.text:
        return f"{kv} | {ev.text}" if kv else ev.text
    return kv


# The event table's columns, in the terminal and in the HTML page alike.
COLUMNS = ("time (UTC)", "seq", "event", "rung", "metadata", "egress", "detail")


def cells(ev: Event, time: str) -> tuple[str, ...]:
    """One event's cells under COLUMNS (``time`` formatted by the caller)."""
    return (
        time,
        str(ev.seq),
        ev.event,
        ev.get("rung") or "",
        probe_cell(ev, "md"),
        probe_cell(ev, "eg"),
        detail(ev),
    )


@dataclass
class Row:
    first: Event
    last: Event
    count: int = 1


def _collapse_key(ev: Event) -> tuple[Any, ...] | None:
    """Routine lines that say the same thing in a row collapse into one row with a count."""
    if ev.event == vocab.HEARTBEAT:
        return ("heartbeat", ev.get("rung"), ev.get("ph"))
    if ev.event == vocab.TICK:
        md = vocab.decode_probe(ev.get("md") or "").verdict
        eg = vocab.decode_probe(ev.get("eg") or "").verdict
        return ("tick", ev.get("rung"), md, eg)
    if ev.event == vocab.MEM:
        return ("mem", ev.get("climb"))
    return None


def rows(events: list[Event]) -> list[Row]:
    out: list[Row] = []
    prev_key: tuple[Any, ...] | None = None
    for ev in events:
        key = _collapse_key(ev)
        if key is not None and key == prev_key and out:
            out[-1].last = ev
            out[-1].count += 1
            continue
        out.append(Row(ev, ev))
        prev_key = key
    return out


def fault_line(w: FaultWindow) -> str:
    how = {
        "clear": "cleared",
        "expire": "expired",
        "install_failed": "install failed",
        "replaced": "replaced by the next fault",
        "reboot": "ended by a reboot",
        "until": "planned end passed, no clear/expire line",
        "open": "still on where the log ends",
    }.get(w.end, w.end)
    return (
        f"  {w.fault_id} cut={w.cut} boot {w.boot} {clock(w.start_ms)} .. {clock(w.end_ms)} "
        f"({duration(w.end_ms - w.start_ms)}, {how})"
    )


COST_COLUMNS = ("boot", "billed", "useful", "ladder", "linger", "zombie", "GPU-seconds")


def cost_row(name: str, c: Cost) -> str:
    cols = (c.billed, c.useful, c.ladder, c.linger, c.zombie)
    return (
        f"  {name:<20} "
        + " ".join(f"{duration(int(x * 1000)):>9}" for x in cols)
        + (f" {c.gpu:>12.0f}")
    )


def cost_table(r: Report) -> Iterator[str]:
    """What it cost: one row per boot and the total (docs/report.md, "What it cost")."""
    if not r.costs:
        return
    gpus = sorted({f.gpus for f in r.costs})
    mt = sorted({f.machine_type for f in r.costs if f.machine_type})
    what = ", ".join(mt) or "machine type not given"
    yield ""
    yield f"what it cost ({what}; GPUs: {', '.join(map(str, gpus))}):"
    h = COST_COLUMNS
    yield f"  {h[0]:<20} " + " ".join(f"{x:>9}" for x in h[1:6]) + f" {h[6]:>12}"
    for f in r.costs:
        yield cost_row(f.boot, boot_cost(f))
    if len(r.costs) > 1:
        yield cost_row("total", r.total_cost)


def verdict_line(r: Report) -> str:
    v = r.verdict
    act = "FAILOVER" if v.failover else "no failover"
    return f"verdict: {v.kind.value} ({act}): {v.reason}"


def render(r: Report, width: int = 120) -> Iterator[str]:
    """The report as terminal lines."""
    n_ev = len(r.events) + r.dropped_events
    yield f"{r.source or '-'}: {r.size} bytes, {r.lines} console lines, {n_ev} events of ours"
    if not r.events:
        yield "no gce-watchdog line in this log (agent not installed yet, or another port?)"
    for i, sec in enumerate(r.sections, 1):
        b = sec.info
        yield ""
        yield (
            f"boot {b.boot} ({i} of {len(r.sections)}): seq {b.first_seq}..{b.max_seq}, "
            f"{b.count} lines, {b.lost} lost, {format_ts(b.first_ts_ms)} .. "
            f"{format_ts(b.last_ts_ms)} ({duration(b.last_ts_ms - b.first_ts_ms)})"
        )
        head = COLUMNS
        yield (
            f"  {head[0]:<20} {head[1]:>6}  {head[2]:<14} {head[3]:<6} {head[4]:<22} "
            f"{head[5]:<22} {head[6]}"
        )
        table = rows(sec.events)
        shown = (
            table
            if len(table) <= MAX_ROWS_PER_BOOT
            else (table[: MAX_ROWS_PER_BOOT // 2] + table[-MAX_ROWS_PER_BOOT // 2 :])
        )
        for j, row in enumerate(shown):
            if len(shown) < len(table) and j == MAX_ROWS_PER_BOOT // 2:
                yield f"  ... {len(table) - len(shown)} rows left out (--html has every event)"
            ev = row.last
            name = row.first.event + (f" x{row.count}" if row.count > 1 else "")
            extra = f" (until {clock(ev.ts_ms)})" if row.count > 1 else ""
            c = cells(ev, clock(row.first.ts_ms))
            line = (
                f"  {c[0]:<20} {row.first.seq:>6}  {name:<14} {c[3]:<6} {c[4]:<22} {c[5]:<22} "
                f"{c[6]}{extra}"
            )
            yield line if len(line) <= width else line[: width - 3] + "..."
    if r.faults:
        yield ""
        yield f"injected faults ({len(r.faults)}):"
        yield from (fault_line(w) for w in r.faults)
    if r.actions:
        yield ""
        yield "action chain:"
        for ev in r.actions:
            yield f"  {clock(ev.ts_ms)} {ev.boot} {ev.event:<9} {detail(ev)}"
    yield from cost_table(r)
    yield ""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.reject_reasons.items()))
    yield (
        f"decode: {r.rejected} rejected"
        + (f" ({reasons})" if reasons else "")
        + f", {r.duplicates} duplicates, {len(r.seq_gaps)} sequence gaps, "
        f"{r.lost_lines} lines lost"
        + (f", {r.dropped_events} events beyond the report's limit" if r.dropped_events else "")
    )
    if r.forged or r.key_conflict:
        why = ", ".join(f"{k} {v}" for k, v in sorted(r.forged_reasons.items()))
        yield (
            f"ALARM: {r.forged} forged lines"
            + (f" ({why})" if why else "")
            + ": lines that do not authenticate under the instance's key (never evidence)"
            + ("; TWO KEYS announced, no line decides" if r.key_conflict else "")
        )
        for s in r.forged_samples[:MAX_GAPS_SHOWN]:
            yield f"  {s.rstrip()!r}"
    if r.conflicts:
        yield f"sequence conflicts: {r.conflicts} (a seq seen twice with different content)"
    for g in r.seq_gaps[:MAX_GAPS_SHOWN]:
        yield f"  boot {g.boot}: after seq {g.after} came {g.next} ({g.missing} lost)"
    if len(r.seq_gaps) > MAX_GAPS_SHOWN:
        yield f"  ... and {len(r.seq_gaps) - MAX_GAPS_SHOWN} more gaps"
    yield verdict_line(r)
