#!/usr/bin/env python3
"""Decode benchmark: protocol decode throughput on a realistic 1 MiB serial dump vs grep.

Usage::

    python bench/bench_decode.py RESULTS.json [--size BYTES] [--every N] [--repeats R]

The dump is real GCE serial output from the corpus (the repository's ``tests/data/serial-corpus``,
or ``GCE_WATCHDOG_SERIAL_CORPUS``) with one of our lines after every ``N`` console lines (default
20: a degrading agent writing a tick per 30 s tick between the console output of a busy VM).
Both sides read the same bytes in the same run:

- decode: ``wire.protocol.decode_all`` (split, marker scan, CRC check, parse, dedup), in
  process, from bytes already in memory;
- hostile inputs (issue 15: one VM's output must not stall a poll round), each 1 MiB: one line of
  nothing but markers (``hostile_line``), one line of markers each followed by trailer-shaped
  candidates (``hostile_trailers``), and a stream of short marker lines ended by a bare CR
  (``hostile_cr``). Decoding is linear: at most 8 markers per line, 200 bytes after each;
- grep: ``grep -F -c GCEWD2 FILE`` as a subprocess (process start included: that is what a
  shell pipeline pays too), the file in the page cache after a warm-up run.

Each is timed ``R`` times (after one warm-up); the median is reported. MB/s means 10^6 bytes
per second. ``ratio`` = decode median time / grep median time (goal: <= 5).
Exit status 0 on success, 1 when the decoder disagrees with grep on the marker count, 2 when
the corpus or grep is missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))

from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.testing.synth import corpus_dir, realistic_dump
from gce_watchdog.wire.protocol import MARKER, decode_all


def _median_time(fn: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: imports, page cache, allocator
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def run(size: int, every: int, repeats: int) -> dict[str, object]:
    d = corpus_dir(Path(__file__).resolve().parents[1] / "tests" / "data" / "serial-corpus")
    if d is None:
        raise FileNotFoundError("serial corpus not found (set GCE_WATCHDOG_SERIAL_CORPUS)")
    grep = shutil.which("grep")
    if grep is None:
        raise FileNotFoundError("grep not found")
    data, expected = realistic_dump(size, every=every, directory=d)
    events, stats = decode_all(data)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dump.log"
        path.write_bytes(data)
        argv = [grep, "-F", "-c", MARKER, str(path)]
        grep_count = int(subprocess.run(argv, capture_output=True, check=False).stdout)
        t_grep, grep_times = _median_time(
            lambda: subprocess.run(argv, capture_output=True, check=False), repeats
        )
    t_decode, decode_times = _median_time(lambda: decode_all(data), repeats)
    mib = 1 << 20
    hostile = {
        "hostile_line": b"GCEWD2 " * (mib // 7) + b"\n",
        "hostile_trailers": (b"GCEWD2 x #0123456789abcdef01234567 " * 7 + b"\n") * (mib // 246),
        "hostile_cr": b"GCEWD2 x\r" * (mib // 9),
    }
    hostile_res: dict[str, object] = {}
    for name, blob in hostile.items():
        t, _ = _median_time(lambda b=blob: decode_all(b), max(3, repeats // 3))  # type: ignore[misc]
        hostile_res[f"{name}_bytes"] = len(blob)
        hostile_res[f"{name}_median_s"] = t
        hostile_res[f"{name}_mb_s"] = len(blob) / 1e6 / t
    t_timeline, _ = _median_time(lambda: parse_bytes(data), repeats)
    marker_lines = sum(1 for ln in data.split(b"\n") if MARKER.encode() in ln)
    mb = len(data) / 1e6
    return {
        "benchmark": "decode",
        "bytes": len(data),
        "our_lines_every": every,
        "events": len(events),
        "events_expected": len(expected),
        "rejected": stats.rejected,
        "console_lines": stats.lines,
        "grep_count": grep_count,
        "marker_lines": marker_lines,
        "repeats": repeats,
        "decode_median_s": t_decode,
        "decode_mb_s": mb / t_decode,
        "decode_times_s": decode_times,
        "timeline_median_s": t_timeline,
        "timeline_mb_s": mb / t_timeline,
        "grep_median_s": t_grep,
        "grep_mb_s": mb / t_grep,
        "grep_times_s": grep_times,
        "ratio_decode_to_grep": t_decode / t_grep,
        **hostile_res,
        "goal_ratio": 5.0,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "corpus": str(d),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="path to write the JSON results to")
    ap.add_argument("--size", type=int, default=1024 * 1024, help="dump size (default 1 MiB)")
    ap.add_argument("--every", type=int, default=20, help="console lines per line of ours")
    ap.add_argument("--repeats", type=int, default=15, help="timed repeats (median reported)")
    args = ap.parse_args(argv)
    if args.size < 1024 or args.every < 1 or args.repeats < 1:
        ap.error("--size >= 1024, --every >= 1, --repeats >= 1")
    try:
        res = run(args.size, args.every, args.repeats)
    except FileNotFoundError as e:
        print(f"bench_decode: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(
        f"decode {res['decode_mb_s']:.1f} MB/s ({res['events']} events, {res['bytes']} bytes), "
        f"timeline {res['timeline_mb_s']:.1f} MB/s, grep -F -c {res['grep_mb_s']:.1f} MB/s, "
        f"ratio {res['ratio_decode_to_grep']:.2f}x (goal <= 5x); hostile 1 MiB: one line of "
        f"markers {res['hostile_line_mb_s']:.1f} MB/s, trailers {res['hostile_trailers_mb_s']:.1f}"
        f" MB/s, CR-ended marker lines {res['hostile_cr_mb_s']:.1f} MB/s -> {out}"
    )
    ok = res["grep_count"] == res["marker_lines"] and res["events"] == res["events_expected"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
