"""``gce-watchdog report SERIAL_LOG [--png OUT.png] [--html OUT.html] [--json]``.

Exit codes (also in docs/report.md):

==  ======================================================================================
0   the report was written (whatever the verdict)
64  usage error (bad --now, --drain-timeout, --band or --gpus)
66  the input cannot be read (EX_NOINPUT)
69  --png asked for but matplotlib is not installed (the message says what to install: pip,
    or, in the Debian package's venv that has no pip, a venv of your own)
    (EX_UNAVAILABLE)
73  an output file cannot be written (EX_CANTCREAT)
==  ======================================================================================
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from gce_watchdog.lib.cli import (
    EX_CANTCREAT,
    EX_NOINPUT,
    EX_OK,
    EX_UNAVAILABLE,
    EX_USAGE,
    CommandError,
    size_arg,
)
from gce_watchdog.poller.cli import add_judging_args, judging_times

_CHUNK = 1 << 16


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="timeline report of a serial log: table, PNG plot, HTML page",
        description="Decode a saved serial-port dump (or the agent's own serial file) into a "
        "timeline: boots, phases, ladder per tick, probe latencies, injected faults, memory, "
        "the action chain and the poller's verdict. The plot needs gce-watchdog[report].",
    )
    p.add_argument("file", metavar="SERIAL_LOG", help="the dump, or - for stdin")
    p.add_argument("--png", metavar="OUT.png", help="write the timeline plot (needs matplotlib)")
    p.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML page")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_judging_args(p)
    p.add_argument(
        "--machine-type",
        default="",
        metavar="TYPE",
        help="the VM's machine type, for its GPU count in what it cost (a3-highgpu-8g)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="the VM's GPUs, when not the machine type's own (attached N1 GPUs); wins",
    )
    band = p.add_mutually_exclusive_group()
    band.add_argument(
        "--band",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="memory pass band width with a unit, as memwatch --band (1GiB)",
    )
    # The old spelling: a float in GiB. Kept so existing scripts keep working; not in --help.
    band.add_argument("--band-gib", type=float, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_report)


def _read(path: str) -> Any:
    if path == "-":
        src = sys.stdin.buffer
        while chunk := src.read(_CHUNK):
            yield chunk
        return
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _write(path: str, data: bytes) -> str | None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    return None


def cmd_report(args: argparse.Namespace) -> int:
    from gce_watchdog.lib.durations import parse_duration
    from gce_watchdog.poller.cost import gpu_count
    from gce_watchdog.poller.verdict import InstanceState, Policy
    from gce_watchdog.report.model import build_report

    def fail(rc: int, msg: str) -> CommandError:
        return CommandError(rc, f"gce-watchdog report: {msg}")

    try:
        policy = Policy(drain_timeout_s=parse_duration(args.drain_timeout))
    except ValueError as e:
        raise fail(EX_USAGE, f"--drain-timeout: {e}") from None
    if args.gpus is not None and args.gpus < 0:
        raise fail(EX_USAGE, f"--gpus must be >= 0, got {args.gpus}")
    gpus = args.gpus if args.gpus is not None else gpu_count(args.machine_type)
    if args.band_gib is not None and not args.band_gib > 0:
        raise fail(EX_USAGE, f"--band-gib must be > 0, got {args.band_gib}")
    band_gib = args.band / (1 << 30) if args.band else args.band_gib if args.band_gib else 1.0
    times = judging_times(args, args.file)
    if isinstance(times, str):
        raise fail(EX_USAGE, times)
    received, now = times
    plot: Any = None
    if args.png:
        # Before reading a large log: a missing extra is known at once.
        from gce_watchdog.report import plot as plot_mod

        try:
            plot_mod._mpl()
        except plot_mod.MatplotlibMissing as e:
            raise fail(EX_UNAVAILABLE, f"--png: {e}") from None
        plot = plot_mod
    try:
        report = build_report(
            _read(args.file),
            source=args.file,
            now=now,
            received=received,
            instance=InstanceState(args.status, args.spot),
            policy=policy,
            band_gib=band_gib,
            gpus=gpus,
            machine_type=args.machine_type,
        )
    except OSError as e:
        raise fail(EX_NOINPUT, f"cannot read {args.file}: {e.strerror or e}") from None

    png: bytes | None = None
    note = ""
    if args.png or args.html:
        if plot is None:
            from gce_watchdog.report import plot as plot_mod

            plot = plot_mod
        buf = io.BytesIO()
        try:
            plot.write_png(report, buf)
            png = buf.getvalue()
        except plot.MatplotlibMissing as e:  # only reachable for --html without --png
            note = f"no plot: {e}"
            print(f"gce-watchdog report: --html: {note}", file=sys.stderr)
    if args.png and png is not None:
        err = _write(args.png, png)
        if err:
            raise fail(EX_CANTCREAT, err)
    if args.html:
        from gce_watchdog.report.html import render as render_html

        err = _write(args.html, render_html(report, png, note).encode("utf-8"))
        if err:
            raise fail(EX_CANTCREAT, err)
    if args.json:
        print(json.dumps(to_json(report), sort_keys=True))
        return EX_OK
    from gce_watchdog.report.text import render as render_text

    width = max(80, _columns())
    for line in render_text(report, width):
        print(line)
    for kind, path in (("plot", args.png), ("page", args.html)):
        if path:
            print(f"{kind} written to {path}")
    return EX_OK


def _columns() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 160  # not a terminal (a pipe, a file): wide enough for most rows


# `report --json`'s version (docs/json.md, schemas/report.schema.json): 1 since every time is an
# RFC 3339 string (the series' ts, the boots' and the faults' times were epoch numbers before).
REPORT_JSON_VERSION = 1


def to_json(r: Any) -> dict[str, Any]:
    """The report as plain JSON-able data (series included)."""
    from gce_watchdog.lib import jsontime
    from gce_watchdog.poller.cost import cost_doc
    from gce_watchdog.wire.protocol import format_ts

    v = r.verdict
    return {
        "v": REPORT_JSON_VERSION,
        "source": r.source,
        "bytes": r.size,
        "lines": r.lines,
        "boots": [jsontime.times({**asdict(s.info), "lost": s.info.lost}) for s in r.sections],
        "events": [e.to_json() for e in r.events],
        "dropped_events": r.dropped_events,
        "seq_gaps": [{**asdict(g), "missing": g.missing} for g in r.seq_gaps],
        "lost_lines": r.lost_lines,
        "rejected": r.rejected,
        "reject_reasons": r.reject_reasons,
        "duplicates": r.duplicates,
        "forged": r.forged,
        "forged_reasons": r.forged_reasons,
        "forged_samples": r.forged_samples,
        "conflicts": r.conflicts,
        "key_id": r.key_id,
        "key_conflict": r.key_conflict,
        "threshold": r.threshold,
        "rungs": [jsontime.times(asdict(x)) for x in r.rungs],
        "probes": [jsontime.times(asdict(x)) for x in r.probes],
        "memory": [jsontime.times(asdict(x)) for x in r.memory],
        "faults": [jsontime.times(asdict(x)) for x in r.faults],
        "markers": [jsontime.times(asdict(x)) for x in r.markers],
        "actions": [
            {"ts": format_ts(e.ts_ms), "boot": e.boot, "event": e.event, "fields": dict(e.fields)}
            for e in r.actions
        ],
        "cost": {
            "boots": [cost_doc(f) for f in r.costs],
            "total": r.total_cost.to_json(),
        },
        "verdict": {
            "kind": v.kind.value,
            "failover": v.failover,
            "reason": v.reason,
            "boot": v.boot,
            "evidence": list(v.evidence),
        },
    }
