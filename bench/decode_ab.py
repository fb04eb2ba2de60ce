#!/usr/bin/env python3
"""Decode cost of two source trees, A/B: the same 1 MiB inputs, alternate processes, CPU time.

Usage::

    python bench/decode_ab.py BASE_AGENT_DIR NEW_AGENT_DIR [--rounds N] [--repeats R]

Each ``*_AGENT_DIR`` is a tree's ``agent`` folder (``git archive REV agent | tar -x -C DIR``
gives an older commit's). The inputs are written once, by this checkout: the realistic dump and
the hostile shapes of ``bench/bench_decode.py``. Each round runs the base tree, then the new
one, in a fresh process each; a run times ``decode_all`` (and ``parse_bytes``: the timeline)
on every input ``R`` times, and a few shapes fed in 64 KiB and 4 KiB pieces (``_64k``,
``_4k``), in CPU time (``time.process_time``: other processes on a loaded machine count less
than in wall time) and keeps the median and the best. Printed: per input,
the median of the rounds' medians and the best run, base -> new, and the change.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = ["hostile_bad_sig", "hostile_bad_sig_routine", "hostile_walkdown", "hostile_cr"]
SHAPES += ["hostile_self_signed", "hostile_max_fields", "hostile_cr_lines"]
# Shapes also fed in 64 KiB and 4 KiB pieces under one receive time (issue 38: the budget per
# MiB, whatever the piece size): every one of them (``--pieced`` narrows it).
PIECED = list(SHAPES)

# One timed run, in the tree given: {input: [median ms, best ms]}.
_RUN = r"""
import json, statistics, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.wire.protocol import StreamDecoder, decode_all
d, reps, shapes = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
pieced = sys.argv[5].split(",")
def fed(blob, piece):
    dec = StreamDecoder(pin=SYNTH_KEY.public)
    for i in range(0, len(blob), piece):
        dec.feed(blob[i : i + piece], 1.0)
    return dec.flush(1.0)
def timed(fn):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        ts.append(time.process_time() - t0)
    return [statistics.median(ts) * 1000, min(ts) * 1000]
real = (d / "realistic.bin").read_bytes()
out = {"decode_realistic": timed(lambda: decode_all(real)),
       "timeline_realistic": timed(lambda: parse_bytes(real))}
for s in shapes:
    blob = (d / f"{s}.bin").read_bytes()
    out[s] = timed(lambda: decode_all(blob, pin=SYNTH_KEY.public))
    if s in pieced:
        out[s + "_64k"] = timed(lambda: fed(blob, 65536))
        out[s + "_4k"] = timed(lambda: fed(blob, 4096))
print(json.dumps(out))
"""


def write_inputs(d: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
    import bench_decode
    from gce_watchdog.testing.synth import corpus_dir, realistic_dump

    corpus = corpus_dir(Path(__file__).resolve().parents[1] / "tests" / "data" / "serial-corpus")
    if corpus is None:
        raise SystemExit("decode_ab: serial corpus not found (set GCE_WATCHDOG_SERIAL_CORPUS)")
    data, _ = realistic_dump(1 << 20, every=20, directory=corpus)
    (d / "realistic.bin").write_bytes(data)
    for name, blob in bench_decode.hostile_inputs(1 << 20).items():
        (d / f"{name}.bin").write_bytes(blob)


def one_run(tree: str, d: Path, repeats: int, pieced: str) -> dict[str, list[float]]:
    argv = [sys.executable, "-c", _RUN, tree, str(d), str(repeats), ",".join(SHAPES), pieced]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    res: dict[str, list[float]] = json.loads(out.stdout)
    return res


def process_runs(tree: str, path: Path, repeats: int) -> list[float]:
    """CPU seconds (the child's, ``getrusage``) of ``parse --json FILE`` by ``tree``, each of
    ``repeats`` runs after a warm-up, its bytecode cached as an installed wheel's is."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env |= {"PYTHONPATH": tree, "PYTHONPYCACHEPREFIX": str(path.parent / "pycache")}
    argv = [sys.executable, "-m", "gce_watchdog", "parse", "--json", str(path)]
    out = []
    for i in range(repeats + 1):
        c0 = _children_cpu()
        subprocess.run(argv, stdout=subprocess.DEVNULL, env=env, check=True, timeout=600)
        if i:
            out.append(_children_cpu() - c0)
    return out


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def process_ab(base: str, new: str, size: int, rounds: int) -> None:
    """Whole process, A/B: ``parse --json`` of a realistic dump of ``size`` bytes by each tree,
    alternately, against ``grep -F -c`` of it; CPU time, medians."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
    from gce_watchdog.testing.synth import corpus_dir, realistic_dump

    corpus = corpus_dir(Path(__file__).resolve().parents[1] / "tests" / "data" / "serial-corpus")
    if corpus is None:
        raise SystemExit("decode_ab: serial corpus not found (set GCE_WATCHDOG_SERIAL_CORPUS)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dump.log"
        path.write_bytes(realistic_dump(size, every=20, directory=corpus)[0])
        grep = ["grep", "-F", "-c", "GCEWD3", str(path)]
        times: dict[str, list[float]] = {"base": [], "new": [], "grep": []}
        for _ in range(rounds):
            times["base"] += process_runs(base, path, 1)
            times["new"] += process_runs(new, path, 1)
            c0 = _children_cpu()
            subprocess.run(grep, capture_output=True, check=False, timeout=60)
            times["grep"].append(_children_cpu() - c0)
    g = statistics.median(times["grep"]) * 1000
    for k in ("base", "new"):
        m = statistics.median(times[k]) * 1000
        line = f"process {size} bytes, {k}: parse --json {m:.0f} ms / grep {g:.1f} ms"
        print(f"{line} = {m / g:.1f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the base tree's agent folder")
    ap.add_argument("new", help="the new tree's agent folder")
    ap.add_argument("--rounds", type=int, default=6, help="base/new pairs (default 6)")
    ap.add_argument("--repeats", type=int, default=9, help="timed calls per run (default 9)")
    ap.add_argument(
        "--pieced", default=",".join(PIECED), help="shapes also fed in pieces (default: all)"
    )
    ap.add_argument(
        "--process",
        type=int,
        default=0,
        metavar="BYTES",
        help="instead: whole process, parse --json of a realistic dump of BYTES against grep",
    )
    a = ap.parse_args(argv)
    if a.process:
        process_ab(a.base, a.new, a.process, a.rounds)
        return 0
    runs: dict[str, list[dict[str, list[float]]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        write_inputs(Path(tmp))
        for _ in range(a.rounds):
            runs["base"].append(one_run(a.base, Path(tmp), a.repeats, a.pieced))
            runs["new"].append(one_run(a.new, Path(tmp), a.repeats, a.pieced))
    for key in runs["base"][0]:
        b_med = statistics.median(r[key][0] for r in runs["base"])
        n_med = statistics.median(r[key][0] for r in runs["new"])
        b_min = min(r[key][1] for r in runs["base"])
        n_min = min(r[key][1] for r in runs["new"])
        print(
            f"{key}: median {b_med:.2f} -> {n_med:.2f} ms ({n_med / b_med - 1:+.0%}), "
            f"best {b_min:.2f} -> {n_min:.2f} ms ({n_min / b_min - 1:+.0%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
