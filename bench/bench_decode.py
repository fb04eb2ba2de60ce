#!/usr/bin/env python3
"""Decode benchmark: protocol decode throughput on a realistic 1 MiB serial dump vs grep.

Usage::

    python bench/bench_decode.py RESULTS.json [--size BYTES] [--every N] [--repeats R]

The dump is real GCE serial output from the corpus (the repository's ``tests/data/serial-corpus``,
or ``GCE_WATCHDOG_SERIAL_CORPUS``) with one of our lines after every ``N`` console lines (default
20: a degrading agent writing a tick per 30 s tick between the console output of a busy VM).
Both sides read the same bytes in the same run:

- decode: ``wire.protocol.decode_all`` (split, marker scan, CRC check, parse, dedup, and the
  Ed25519 checks the poller's decoder makes: every line that decides, announcements first, and
  the newest routine line of each boot, which covers the older ones; docs/serial-protocol.md,
  "Verifying what decides"), in process, from bytes already in memory; ``decode_full`` is the
  same with every intact line verified (``StreamDecoder.lazy = False``), for reference;
- hostile inputs (issues 15 and 25: one VM's output must not stall a poll round), each 1 MiB,
  after the instance's real first lines (pinned): ``hostile_line`` (one line of nothing but
  markers), ``hostile_trailers`` (markers each followed by trailer-shaped candidates, the CRC
  wrong), ``hostile_cr`` (short marker lines ended by a bare CR), ``hostile_bad_sig`` (intact
  ``shutdown`` lines of the pinned boot signed by another key: decisive, each to be verified
  until the budget is spent), ``hostile_bad_sig_routine`` (the same with ``tick`` lines: the walk
  down from the highest seq), ``hostile_walkdown`` (a real agent's ticks, one per 20 lines,
  between forged ticks of the same boot with seqs far above them, meant to make the walk down
  long) and ``hostile_self_signed`` (self-signed announcements of other keys: never checked,
  their key is not the pin). Decoding is linear: at most 8 markers per line, 280 bytes after
  each, and at most ``BUDGET_LINES`` + 1 per ``BUDGET_BYTES`` signature checks per block; the
  JSON gives the checks made per shape (``*_verified``);
- grep: ``grep -F -c GCEWD3 FILE`` as a subprocess (process start included: that is what a
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
from gce_watchdog.testing.synth import SYNTH_KEY, Writer, corpus_dir, realistic_dump
from gce_watchdog.wire.protocol import (
    MARKER,
    SIG_CHARS,
    LineKey,
    StreamDecoder,
    b64,
    decode_all,
    encode,
    key_line,
    make_event,
    verify,
)


def _crc(signed: bytes) -> bytes:
    import zlib

    return b"%08x" % (zlib.crc32(signed) & 0xFFFFFFFF)


def _forged_line(kind: str, seq: int, evil: LineKey) -> bytes:
    """An intact line of the pinned boot signed by another key (what a local process can do)."""
    ev = make_event(kind, "3f2a9c1e", seq, 1_800_000_000_000, {"rung": "0/10", "ph": "workload"})
    body = encode(ev, SYNTH_KEY).encode()[: -(SIG_CHARS + 10)]
    signed = body + b" #" + b64(evil.sign(body)).encode()
    return signed + _crc(signed) + b"\n"


def hostile_inputs(mib: int) -> dict[str, bytes]:
    """The hostile 1 MiB shapes (issues 15 and 25): what anyone reaching the console can write.

    - ``hostile_line``: one line of nothing but markers;
    - ``hostile_trailers``: markers each followed by trailer-shaped candidates (a v3 trailer's
      shape, the CRC wrong);
    - ``hostile_cr``: short marker lines ended by a bare CR;
    - ``hostile_bad_sig``: intact lines (the CRC right) of the pinned instance's boot, each
      with a signature of nobody's making (each must be verified: the costly one);
    - ``hostile_bad_sig_routine``: the same with ``tick`` lines (routine: the walk down);
    - ``hostile_walkdown``: a real agent's ticks between forged ticks of far higher seqs;
    - ``hostile_self_signed``: self-signed announcements of other keys (no signature is
      checked: their key is not the pin).

    Each follows the instance's real first lines (its announcement, pinned)."""
    head = Writer(boot="3f2a9c1e").line("start", {"v": "3"})
    fill = b"A" * SIG_CHARS
    shapes = {
        "hostile_line": b"GCEWD3 " * (mib // 7) + b"\n",
        "hostile_trailers": (b"GCEWD3 x" + (b" #" + fill + b"0123abcd") * 2 + b"\n") * (mib // 201),
        "hostile_cr": b"GCEWD3 x\r" * (mib // 9),
    }
    bad, seq = bytearray(head), 3
    evil = LineKey(bytes(range(1, 33)))
    while len(bad) < mib:
        ev = make_event("shutdown", "3f2a9c1e", seq, 1_800_000_000_000, {"reason": "ladder"})
        # a real signature, by another key (libsodium rejects malformed ones before the math)
        body = encode(ev, SYNTH_KEY).encode()[: -(SIG_CHARS + 10)]
        signed = body + b" #" + b64(evil.sign(body)).encode()
        bad += signed + _crc(signed) + b"\n"
        seq += 1
    shapes["hostile_bad_sig"] = bytes(bad)
    routine, seq = bytearray(head), 3
    while len(routine) < mib:
        routine += _forged_line("tick", seq, evil)
        seq += 1
    shapes["hostile_bad_sig_routine"] = bytes(routine)
    w = Writer(boot="3f2a9c1e")
    walk, i = bytearray(w.line("start", {"v": "3"})), 0
    while len(walk) < mib:
        if i % 20 == 19:
            walk += w.line("tick", {"rung": "0/10", "ph": "workload"})
        else:
            walk += _forged_line("tick", 10**9 - i, evil)
        i += 1
    shapes["hostile_walkdown"] = bytes(walk)
    keys = [LineKey(bytes([i]) * 32) for i in range(64)]
    own, i = bytearray(head), 0
    while len(own) < mib:
        own += key_line(f"{i:08x}", i % 2, 0, keys[i % 64]).encode() + b"\n"
        i += 1
    shapes["hostile_self_signed"] = bytes(own)
    return shapes


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

    def full() -> object:
        d = StreamDecoder()
        d.lazy = False
        return d.feed(data) + d.flush()

    t_full, _ = _median_time(full, repeats)
    mib = 1 << 20
    hostile = hostile_inputs(mib)
    pin = SYNTH_KEY.public
    hostile_res: dict[str, object] = {}
    for name, blob in hostile.items():
        t, _ = _median_time(lambda b=blob: decode_all(b, pin=pin), max(3, repeats // 3))  # type: ignore[misc]
        hostile_res[f"{name}_verified"] = decode_all(blob, pin=pin)[1].verified
        hostile_res[f"{name}_bytes"] = len(blob)
        hostile_res[f"{name}_median_s"] = t
        hostile_res[f"{name}_ms_per_mib"] = t * 1000 * mib / len(blob)
        hostile_res[f"{name}_mb_s"] = len(blob) / 1e6 / t
    body = b"GCEWD3 3f2a9c1e 42 2026-11-30T04:18:14.123Z tick rung=3/10 md=fail/timeout/5001"
    body += b" " + b"x" * (199 - len(body))
    sig = SYNTH_KEY.sign(body)
    n = 2000
    t_sign, _ = _median_time(lambda: [SYNTH_KEY.sign(body) for _ in range(n)], 5)
    t_verify, _ = _median_time(lambda: [verify(pin, body, sig) for _ in range(n)], 5)
    hostile_res["sign_us_per_line"] = t_sign / n * 1e6
    hostile_res["verify_us_per_line"] = t_verify / n * 1e6
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
        "decode_verified": stats.verified,
        "decode_covered": stats.covered,
        "decode_unchecked": stats.unchecked,
        "decode_full_median_s": t_full,
        "ratio_full_to_grep": t_full / t_grep,
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
        f"ratio {res['ratio_decode_to_grep']:.2f}x (goal <= 5x; every line verified "
        f"{res['ratio_full_to_grep']:.2f}x, {res['decode_verified']} checks); sign "
        f"{res['sign_us_per_line']:.0f} us, verify {res['verify_us_per_line']:.0f} us per line; "
        "hostile ms per MiB (goal < 50): "
        + ", ".join(
            f"{k[len('hostile_') :]} {res[f'{k}_ms_per_mib']:.0f}"
            for k in (
                "hostile_line",
                "hostile_trailers",
                "hostile_cr",
                "hostile_bad_sig",
                "hostile_bad_sig_routine",
                "hostile_walkdown",
                "hostile_self_signed",
            )
        )
        + f" -> {out}"
    )
    ok = res["grep_count"] == res["marker_lines"] and res["events"] == res["events_expected"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
