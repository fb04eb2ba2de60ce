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
  shell pipeline pays too), the file in the page cache after a warm-up run;
- the floors of any Python decoder (issue 38, item 2): :data:`FLOOR_PROCESS`, a whole Python
  process that only reads the big dump and prints each line of ours as JSON, against grep; and
  :func:`floor_in_process` (the marker scan, a CRC and a regex match per line of ours) with
  the signature checks ``decode_all`` makes, against ``bytes.count``. A goal below its floor is
  out of reach of a decoder written in Python.

Each is timed ``R`` times (after one warm-up); the median is reported. MB/s means 10^6 bytes
per second. The ratios pair like with like (issue 38): ``ratio_process_to_grep`` is the whole
``parse --json`` process's median time over grep's (goal <= 5), ``ratio_decode_to_count`` is
``decode_all``'s CPU time over ``bytes.count``'s in process (goal <= 3).
Exit status 0 on success, 1 when the decoder disagrees with grep on the marker count, 2 when
the corpus or grep is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.testing.synth import SYNTH_KEY, Writer, corpus_dir, realistic_dump
from gce_watchdog.wire.lazy import _PLAIN_V3
from gce_watchdog.wire.protocol import (
    MARKER,
    MAX_LINE,
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
from gce_watchdog.wire.stream import _MARKER_LINE_RE

from bench.analysis import import_breakdown, parse_importtime

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO / "agent"


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
    shapes["hostile_max_fields"] = _max_fields(mib, head, evil)
    cr, w = bytearray(), Writer(boot="3f2a9c1e")
    while len(cr) < mib:
        cr += w.line("tick", {"rung": "0/10", "ph": "workload"}).replace(b"\n", b"\r")
    shapes["hostile_cr_lines"] = bytes(cr)
    keys = [LineKey(bytes([i]) * 32) for i in range(64)]
    own, i = bytearray(head), 0
    while len(own) < mib:
        own += key_line(f"{i:08x}", i % 2, 0, keys[i % 64]).encode() + b"\n"
        i += 1
    shapes["hostile_self_signed"] = bytes(own)
    return shapes


def _max_fields(mib: int, head: bytes, evil: LineKey) -> bytes:
    """Forged ``tick`` lines of the pinned boot with their fields at their maximum length
    (24-character keys, 64-character values, as many as a 280-byte line holds), each line's
    values its own (no cache helps), below one real tick of a higher seq that covers them all:
    every one of them parsed whole."""
    out, seq = bytearray(head), 3
    real = Writer(boot="3f2a9c1e", announce=False)
    while len(out) < mib - 400:
        fields = []
        for j in range(3):
            fields.append((f"k{j}" + "x" * 22, f"{seq:012d}{j}" + "v" * 51))
            ev = make_event("tick", "3f2a9c1e", seq, 1_800_000_000_000, fields)
            if len(encode(ev, SYNTH_KEY)) > MAX_LINE:
                fields.pop()
                break
        ev = make_event("tick", "3f2a9c1e", seq, 1_800_000_000_000, fields)
        body = encode(ev, SYNTH_KEY).encode()[: -(SIG_CHARS + 10)]
        signed = body + b" #" + b64(evil.sign(body)).encode()
        out += signed + _crc(signed) + b"\n"
        seq += 1
    real.seq, real.ts_ms = seq, 1_800_000_000_000
    return bytes(out + real.line("tick", {"rung": "0/10", "ph": "workload"}))


def _median_time(
    fn: Callable[[], object], repeats: int, cpu: bool = False
) -> tuple[float, list[float]]:
    """The median of ``repeats`` timed calls after a warm-up; wall time, or this process's CPU
    time (``cpu``: in-process figures on a shared machine, where wall time counts the others)."""
    clock = time.process_time if cpu else time.perf_counter
    fn()  # warm-up: imports, page cache, allocator
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times), times


PIECES = {"": 0, "_64k": 64 << 10, "_4k": 4 << 10}  # key suffix -> piece size (0: at once)


def _feed(blob: bytes, piece: int, pin: bytes) -> object:
    """``blob`` through one decoder: at once (``piece`` 0) or in pieces of ``piece`` bytes, as
    a reader of a pipe or a socket feeds it (one receive time: parse's case)."""
    d = StreamDecoder(pin=pin)
    if not piece:
        return d.feed(blob) + d.flush()
    out = []
    for i in range(0, len(blob), piece):
        out += d.feed(blob[i : i + piece])
    return out + d.flush()


def _hostile(repeats: int) -> dict[str, object]:
    """Every hostile 1 MiB shape, read at once and fed in 64 KiB and 4 KiB pieces: ms per MiB
    (CPU time of this process, the median of ``repeats``), and the checks made."""
    mib = 1 << 20
    pin = SYNTH_KEY.public
    res: dict[str, object] = {}
    for name, blob in hostile_inputs(mib).items():
        res[f"{name}_verified"] = decode_all(blob, pin=pin)[1].verified
        res[f"{name}_bytes"] = len(blob)
        for suffix, piece in PIECES.items():
            t, _ = _median_time(lambda b=blob, p=piece: _feed(b, p, pin), repeats, cpu=True)  # type: ignore[misc]
            res[f"{name}{suffix}_median_s"] = t
            res[f"{name}{suffix}_ms_per_mib"] = t * 1000 * mib / len(blob)
        res[f"{name}_mb_s"] = len(blob) / 1e6 / float(res[f"{name}_median_s"])  # type: ignore[arg-type]
    return res


def _children_cpu() -> float:
    """CPU time (user + system) of this process's waited-for children, in seconds."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _median_process(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Wall and CPU time of a child process run by ``fn`` (medians of ``repeats`` after a
    warm-up): on a machine shared with others, its CPU time is the steadier of the two."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), _children_cpu()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(_children_cpu() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _process_env(tmp: Path) -> dict[str, str]:
    """A child's environment: this checkout's package, and its bytecode cached (under ``tmp``)
    as an installed wheel's is, whatever PYTHONDONTWRITEBYTECODE says here: compiling every
    module at each start is not what a user's ``parse`` pays (the warm-up run writes it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(AGENT), "PYTHONPYCACHEPREFIX": str(tmp / "pycache")}


def _process_pair(path: Path, grep: str, repeats: int, floor: bool = False) -> dict[str, object]:
    """Whole process against whole process on one file: ``gce-watchdog parse --json FILE``
    (interpreter start-up, imports, reading, decoding, the timeline, the JSON printed to
    /dev/null) and ``grep -F -c GCEWD3 FILE`` (its own start-up), each the median of
    ``repeats`` after a warm-up (the file in the page cache); with ``floor``, also
    :data:`FLOOR_PROCESS` on the same file, timed alike, and its ratios to grep."""
    env = _process_env(path.parent)
    parse = [sys.executable, "-m", "gce_watchdog", "parse", "--json", str(path)]
    grep_argv = [grep, "-F", "-c", MARKER, str(path)]

    def run_parse() -> None:
        subprocess.run(parse, stdout=subprocess.DEVNULL, env=env, check=True)

    t_parse, c_parse = _median_process(run_parse, repeats)
    t_grep, c_grep = _median_process(
        lambda: subprocess.run(grep_argv, capture_output=True, check=False), repeats
    )
    mib = path.stat().st_size / (1 << 20)
    floors: dict[str, object] = {}
    if floor:
        argv = [sys.executable, "-c", FLOOR_PROCESS, str(path)]
        t_floor, c_floor = _median_process(
            lambda: subprocess.run(argv, stdout=subprocess.DEVNULL, check=True), repeats
        )
        floors = {
            "floor_median_s": t_floor,
            "floor_cpu_median_s": c_floor,
            "ratio_floor_to_grep": t_floor / t_grep,
            "ratio_floor_to_grep_cpu": c_floor / max(c_grep, 1e-6),
        }
    return {
        **floors,
        "bytes": path.stat().st_size,
        "parse_median_s": t_parse,
        "grep_median_s": t_grep,
        "ratio_parse_to_grep": t_parse / t_grep,
        "parse_cpu_median_s": c_parse,
        "grep_cpu_median_s": c_grep,
        "ratio_parse_to_grep_cpu": c_parse / max(c_grep, 1e-6),
        "parse_ms_per_mib": t_parse * 1000 / mib,
    }


# The least any Python ``parse --json`` does (issue 38, item 2: is the goal reachable in
# Python?): start the interpreter, read the file, find each line with the marker (C-level) and
# write one JSON object per line, its text only, to stdout. No checksum, no parse, no signature,
# no timeline, no verdict: a lower bound for a Python decoder that prints every event, whatever
# its design. Run as ``python -c FLOOR_PROCESS FILE`` (:func:`_process_pair`).
FLOOR_PROCESS = """\
import json, re, sys
with open(sys.argv[1], "rb") as f:
    data = f.read()
lines = re.findall(rb"GCEWD3[^\\n]*", data)
json.dump([{"line": x.decode("ascii", "replace")} for x in lines], sys.stdout)
"""


def floor_in_process(data: bytes) -> list[tuple[bytes, ...]]:
    """The least a Python decoder does in process for the lines it decodes (issue 38, item 2):
    the lines with the marker found by one C-level scan (the decoder's own ``_MARKER_LINE_RE``),
    then for each one CRC and one regex match of its head and trailer (``_PLAIN_V3``: boot,
    seq, event, signature, CRC), its groups kept. No line counting, no field parse, no event,
    no deduplication, no signature check: a lower bound, not a decoder."""
    out = []
    match, crc32 = _PLAIN_V3.match, zlib.crc32
    for ln in _MARKER_LINE_RE.findall(data):
        m = match(ln)
        if m is not None and crc32(ln[:-8]) == int(m.group(5), 16):
            out.append(m.groups())
    return out


def _startup(grep: str, repeats: int, tmp: Path) -> dict[str, object]:
    """What a whole process pays before any byte: the interpreter alone, ``parse --json`` of an
    empty file (start-up and the parse path's imports), grep of it; and ``-X importtime``'s
    breakdown of that parse."""
    empty = tmp / "empty.log"
    empty.write_bytes(b"")
    env = _process_env(tmp)
    parse = [sys.executable, "-m", "gce_watchdog", "parse", "--json", str(empty)]
    t_py, _ = _median_time(lambda: subprocess.run([sys.executable, "-c", "pass"]), repeats)
    t_empty, _ = _median_time(
        lambda: subprocess.run(parse, stdout=subprocess.DEVNULL, env=env, check=True), repeats
    )
    t_grep, _ = _median_time(
        lambda: subprocess.run([grep, "-F", "-c", MARKER, str(empty)], capture_output=True),
        repeats,
    )
    r = subprocess.run(
        [sys.executable, "-X", "importtime", *parse[1:]],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    imports = import_breakdown(parse_importtime(r.stderr), top=8)
    return {
        "python_start_median_s": t_py,
        "parse_empty_median_s": t_empty,
        "grep_empty_median_s": t_grep,
        "parse_import_ms": imports["total_ms"],
        "parse_imports_top": imports["top_level"],
    }


def run(size: int, every: int, repeats: int, process_size: int) -> dict[str, object]:
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
        preps = max(3, repeats // 3)
        process = {"small": _process_pair(path, grep, preps)}
        big = Path(tmp) / "big.log"
        big.write_bytes(realistic_dump(process_size, every=every, directory=d)[0])
        process["big"] = _process_pair(big, grep, preps, floor=True)
        big.unlink()
        startup = _startup(grep, preps, Path(tmp))
    marker = MARKER.encode()
    t_count, _ = _median_time(lambda: data.count(marker), repeats, cpu=True)
    t_decode, decode_times = _median_time(lambda: decode_all(data), repeats, cpu=True)
    t_floor, _ = _median_time(lambda: floor_in_process(data), repeats, cpu=True)

    def full() -> object:
        d = StreamDecoder()
        d.lazy = False
        return d.feed(data) + d.flush()

    t_full, _ = _median_time(full, repeats, cpu=True)
    hostile_res = _hostile(max(3, repeats // 3))
    pin = SYNTH_KEY.public
    body = b"GCEWD3 3f2a9c1e 42 2026-11-30T04:18:14.123Z tick rung=3/10 md=fail/timeout/5001"
    body += b" " + b"x" * (199 - len(body))
    sig = SYNTH_KEY.sign(body)
    n = 2000
    t_sign, _ = _median_time(lambda: [SYNTH_KEY.sign(body) for _ in range(n)], 5)
    t_verify, _ = _median_time(lambda: [verify(pin, body, sig) for _ in range(n)], 5)
    hostile_res["sign_us_per_line"] = t_sign / n * 1e6
    hostile_res["verify_us_per_line"] = t_verify / n * 1e6
    t_timeline, _ = _median_time(lambda: parse_bytes(data), repeats, cpu=True)
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
        "count_median_s": t_count,
        "ratio_decode_to_count": t_decode / t_count,
        # issue 38, item 2: the floors of any Python decoder, against the same references
        "floor_median_s": t_floor,
        "floor_lines": len(floor_in_process(data)),
        "ratio_floor_to_count": t_floor / t_count,
        "verify_ms_in_decode": stats.verified * t_verify / n * 1000,
        "ratio_verify_to_count": stats.verified * t_verify / n / t_count,
        "ratio_floor_process_to_grep": process["big"]["ratio_floor_to_grep"],
        "ratio_full_to_count": t_full / t_count,
        "timeline_median_s": t_timeline,
        "timeline_mb_s": mb / t_timeline,
        "grep_median_s": t_grep,
        "grep_mb_s": mb / t_grep,
        "grep_times_s": grep_times,
        "process_small": process["small"],
        "process_big": process["big"],
        "ratio_process_to_grep": process["big"]["ratio_parse_to_grep"],
        **startup,
        **hostile_res,
        "goal_ratio": 5.0,
        "goal_ratio_count": 3.0,
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
    ap.add_argument(
        "--process-size",
        type=int,
        default=64 << 20,
        help="the dump parse --json and grep read as whole processes (default 64 MiB)",
    )
    args = ap.parse_args(argv)
    if args.size < 1024 or args.every < 1 or args.repeats < 1 or args.process_size < 1024:
        ap.error("--size >= 1024, --process-size >= 1024, --every >= 1, --repeats >= 1")
    try:
        res = run(args.size, args.every, args.repeats, args.process_size)
    except FileNotFoundError as e:
        print(f"bench_decode: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    big, small = res["process_big"], res["process_small"]
    print(
        f"whole process: parse --json {big['bytes'] >> 20} MiB"
        f" {big['parse_median_s'] * 1000:.0f} ms"
        f" vs grep -F -c {big['grep_median_s'] * 1000:.1f} ms = {big['ratio_parse_to_grep']:.1f}x"
        f" (goal <= 5x); {small['bytes']} bytes {small['ratio_parse_to_grep']:.1f}x; start-up"
        f" {res['parse_empty_median_s'] * 1000:.0f} ms (python alone"
        f" {res['python_start_median_s'] * 1000:.0f} ms, imports {res['parse_import_ms']:.0f} ms)."
        f" In process: decode_all {res['decode_median_s'] * 1000:.2f} ms vs bytes.count"
        f" {res['count_median_s'] * 1000:.2f} ms = {res['ratio_decode_to_count']:.1f}x (goal <="
        f" 3x; every line verified {res['ratio_full_to_count']:.1f}x, {res['decode_verified']}"
        f" checks); verify {res['verify_us_per_line']:.0f} us per line. Floors of any Python"
        f" decoder: whole process {res['ratio_floor_process_to_grep']:.1f}x grep, in process"
        f" {res['ratio_floor_to_count']:.1f}x bytes.count (+ the signature checks"
        f" {res['ratio_verify_to_count']:.1f}x). Hostile ms per MiB"
        " (goal <= 50; at once / 64 KiB / 4 KiB pieces): "
        + ", ".join(
            f"{k[len('hostile_') :]} "
            + "/".join(f"{res[f'{k}{sfx}_ms_per_mib']:.0f}" for sfx in PIECES)
            for k in sorted(
                x[: -len("_verified")]
                for x in res
                if x.endswith("_verified") and x.startswith("hostile_")
            )
        )
        + f" -> {out}"
    )
    ok = res["grep_count"] == res["marker_lines"] and res["events"] == res["events_expected"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
