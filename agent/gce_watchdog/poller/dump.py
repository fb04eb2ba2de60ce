"""``gce-watchdog parse``: decode a saved serial dump and show its timeline and verdict.

``poller/cli.py`` parses the options and hands over to :func:`show_dump`; this module reads the
dump, feeds the timeline, judges it and prints the result (text, or one JSON object).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import asdict
from typing import Any

from gce_watchdog.lib import jsontime
from gce_watchdog.lib.cli import EX_NOINPUT, EX_OK, CommandError
from gce_watchdog.poller.timeline import Timeline
from gce_watchdog.poller.verdict import InstanceState, Policy, Verdict
from gce_watchdog.wire.protocol import Event, format_ts
from gce_watchdog.wire.vocab import human_fields

EX_DATAERR = 65  # sysexits: the input is too large to be a dump
# What parse reads at most: a month of a busy console's export, far more than any real dump.
MAX_DUMP_BYTES = 1 << 30
# What one read takes (a file's; a pipe gives what it holds). The events are the same whatever
# the piece size; 8 MiB reads made 810 signature checks of a realistic 64 MiB dump instead of
# 1,822 but took as long (a 64 KiB block stays in the CPU's caches through the decoder's
# passes): docs/performance.md, issue 38.
READ_BYTES = 1 << 16
# `parse --json`'s version (docs/json.md, schemas/parse.schema.json): 1 since the boots' times
# are RFC 3339 strings (first_ts, last_ts, first_received, last_received; epoch numbers before).
PARSE_JSON_VERSION = 1


def show_dump(
    path: str,
    received: float,
    now: float,
    status: str | None,
    spot: bool,
    policy: Policy,
    as_json: bool,
) -> int:
    """Decode ``path`` (``-``: stdin) as bytes received at ``received``, judge it at ``now``."""
    tl = Timeline()
    # every event, in stream order: the timeline itself compacts past MAX_EVENTS (its verdict
    # inputs stay), parse shows all of them
    events: list[Event] = []
    total = 0
    try:
        fd = sys.stdin.fileno() if path == "-" else os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
                # /dev/zero, a tty, a directory: a dump is a file or a pipe
                kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file or a pipe"
                raise CommandError(EX_NOINPUT, f"gce-watchdog parse: {path} is {kind}")
            os.set_blocking(fd, True)
            while chunk := os.read(fd, READ_BYTES):
                total += len(chunk)
                if total > MAX_DUMP_BYTES:
                    raise CommandError(
                        EX_DATAERR,
                        f"gce-watchdog parse: {path} is over {MAX_DUMP_BYTES >> 20} MiB: stopped"
                        " (split it; a serial port's output through the API is 1 MiB a read)",
                    )
                events += tl.feed(chunk, received)
        finally:
            if path != "-":
                os.close(fd)
    except OSError as e:
        raise CommandError(
            EX_NOINPUT, f"gce-watchdog parse: cannot read {path}: {e.strerror or e}"
        ) from None
    events += tl.finish(received)
    events += tl.settle(received, checks=None)  # a dump: every line a flood delayed is checked
    events = tl.accepted(events)  # a contested start's announcements are taken back
    verdict = tl.judge(InstanceState(status, spot), now, policy)
    if as_json:
        print(json.dumps(_timeline_json(tl, events, verdict, total), sort_keys=True))
        return EX_OK
    out = sys.stdout
    print(f"{path}: {total} bytes, {tl.lines} lines", file=out)
    print(f"boots ({len(tl.boots)}):", file=out)
    for b in sorted(tl.boots.values(), key=lambda b: b.order):
        print(
            f"  {b.boot}  seq {b.first_seq}..{b.max_seq}  {b.count} lines  lost {b.lost}  "
            f"{format_ts(b.first_ts_ms)} .. {format_ts(b.last_ts_ms)}",
            file=out,
        )
    print(f"events ({len(events)}):", file=out)
    for ev in events:
        kv = human_fields(ev.fields)
        text = f" | {ev.text}" if ev.text else ""
        print(f"  {format_ts(ev.ts_ms)} {ev.boot} #{ev.seq} {ev.event} {kv}{text}", file=out)
    print(f"gaps: {len(tl.seq_gaps)} sequence, {tl.lost_lines} lines lost", file=out)
    for g in tl.seq_gaps:
        print(f"  boot {g.boot}: after seq {g.after} came {g.next} ({g.missing} lost)", file=out)
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(tl.reject_reasons.items()))
    print(f"rejected: {tl.rejected}" + (f" ({reasons})" if reasons else ""), file=out)
    for s in tl.reject_samples:
        print(f"  {s.rstrip()!r}", file=out)
    print(f"duplicates: {tl.duplicates}", file=out)
    if tl.conflicts:
        print(f"sequence conflicts: {tl.conflicts}", file=out)
    if tl.forged or tl.key_conflict:
        why = ", ".join(f"{k} {v}" for k, v in sorted(tl.forged_reasons.items()))
        two = "; TWO KEYS announced, no line decides" if tl.key_conflict else ""
        print(f"ALARM: forged: {tl.forged} ({why}){two}", file=out)
        for s in tl.forged_samples:
            print(f"  {s.rstrip()!r}", file=out)
    print(f"key: {tl.key_id or 'none announced'}", file=out)
    act = "FAILOVER" if verdict.failover else "no failover"
    print(f"verdict: {verdict.kind.value} ({act}): {verdict.reason}", file=out)
    for item in verdict.evidence:
        print(f"  {item}", file=out)
    return EX_OK


def _timeline_json(
    tl: Timeline, events: list[Event], verdict: Verdict, total: int
) -> dict[str, Any]:
    return {
        "v": PARSE_JSON_VERSION,
        "bytes": total,
        "lines": tl.lines,
        "boots": [
            jsontime.times({**asdict(b), "lost": b.lost})
            for b in sorted(tl.boots.values(), key=lambda b: b.order)
        ],
        "events": [e.to_json() for e in events],
        "seq_gaps": [{**asdict(g), "missing": g.missing} for g in tl.seq_gaps],
        "lost_lines": tl.lost_lines,
        "rejected": tl.rejected,
        "reject_reasons": tl.reject_reasons,
        "reject_samples": tl.reject_samples,
        "duplicates": tl.duplicates,
        "forged": tl.forged,
        "forged_reasons": tl.forged_reasons,
        "forged_samples": tl.forged_samples,
        "conflicts": tl.conflicts,
        "key_id": tl.key_id,
        "key_conflict": tl.key_conflict,
        "verdict": {
            "kind": verdict.kind.value,
            "failover": verdict.failover,
            "reason": verdict.reason,
            "boot": verdict.boot,
            "evidence": list(verdict.evidence),
        },
    }
