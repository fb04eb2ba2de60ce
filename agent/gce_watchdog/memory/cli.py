"""The ``memwatch`` command: run a command and judge whether its memory climbs. argparse code
only; sampling and judging live in memwatch.py."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from gce_watchdog.lib.cli import EX_NOTFOUND, EX_USAGE, CommandError
from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.lib.files import atomic_write
from gce_watchdog.memory import GIB
from gce_watchdog.memory.detector import MIN_WINDOW, ClimbVerdict, DetectorParams, Status
from gce_watchdog.memory.memwatch import (
    collect,
    exit_code,
    judge,
    killed_by,
    memory_verdict,
    parse_size,
    to_json,
)


def _duration_arg(text: str) -> float:
    try:
        v = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def _warmup_arg(text: str) -> tuple[str, float]:
    """A plain integer is a number of samples; a duration ("30s", "2m") is converted later."""
    if text.strip().isdigit():
        return ("samples", float(int(text)))
    try:
        return ("seconds", parse_duration(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"warm-up must be a number of samples (10) or a duration (30s, 5m), got {text!r}"
        ) from None


def _window_arg(text: str) -> int:
    if not text.strip().isdigit() or int(text) < MIN_WINDOW:
        raise argparse.ArgumentTypeError(f"must be an integer >= {MIN_WINDOW}, got {text!r}")
    return int(text)


def _alpha_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v < 0.5:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 0.5), got {text!r}")
    return v


def _gate_arg(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in ("host", "tree", "gpu")]
    if not parts or bad:
        raise argparse.ArgumentTypeError(f"a comma list of host, tree, gpu; got {text!r}")
    return parts


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "memwatch",
        help="watch host, process-tree and GPU memory; PASS/FAIL against the pass band",
        description=(
            "Sample memory every --interval and judge each gauge: PASS (exit 0) when it stays "
            "within --band after warm-up, FAIL (exit 1) on a climb, a step or a wide range, "
            "NOT ENOUGH DATA (exit 3) with fewer than --min-samples after warm-up. A command "
            "that exits non-zero is COMMAND FAILED with the command's own exit status as "
            "memwatch's (never PASS, whatever the gauges say). "
            "Give --pid to watch a running process tree, or -- CMD ARGS... to run one."
        ),
    )
    p.add_argument("--pid", type=int, default=None, help="watch this process and its children")
    p.add_argument("--interval", type=_duration_arg, default=1.0, help="sampling period (1s)")
    p.add_argument(
        "--warmup",
        type=_warmup_arg,
        default=("samples", 10.0),
        help="samples (10) or a duration (30s) skipped before judging (default 10 samples)",
    )
    p.add_argument(
        "--min-samples",
        type=_window_arg,
        default=30,
        help="samples needed after warm-up for a verdict (default 30, the team's rule)",
    )
    p.add_argument(
        "--band", type=parse_size, default=GIB, help="pass band for the range, with a unit (1GiB)"
    )
    p.add_argument("--alpha", type=_alpha_arg, default=0.01, help="trend significance (0.01)")
    p.add_argument(
        "--duration", type=_duration_arg, default=None, help="stop sampling after this long"
    )
    p.add_argument(
        "--gate",
        type=_gate_arg,
        default=None,
        help="gauges that decide PASS/FAIL: host,tree,gpu "
        "(default tree,gpu with --pid or a command, else host,gpu)",
    )
    p.add_argument("--no-gpu", action="store_true", help="do not load NVML")
    p.add_argument("--out", default=None, metavar="PATH", help="write the JSON log here")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...: run and watch this")
    p.set_defaults(func=cmd_memwatch)


def _line(name: str, v: ClimbVerdict, gated: bool) -> str:
    word = {
        Status.PASS: "PASS",
        Status.NOT_ENOUGH_DATA: "NOT ENOUGH DATA",
    }.get(v.status, f"FAIL ({v.status})")
    if not gated:
        word = f"info: {v.status}"
    s = (
        f"  {name:<10} {word:<18} range {v.range_gib:.3f} GiB  "
        f"slope {v.slope_gib_per_min:+.4f} GiB/min  p={v.p_value:.2g}  n={v.samples}"
    )
    if v.status is Status.CLIMB and v.seconds_to_full is not None:
        s += f"  full in ~{v.seconds_to_full / 60:.0f} min"
    if v.status is Status.STEP and v.step_bytes is not None:
        s += f"  step {v.step_bytes / GIB:+.3f} GiB at t={v.step_at_s or 0:.0f}s"
    return s


def _unwritable(path: str) -> str | None:
    """Why the --out file could not be written at the end of the run, or None. Tried for real: a
    temporary file is created (and removed) in its directory."""
    import tempfile

    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    try:
        if p.is_dir():
            return "is a directory"
        if not parent.is_dir():
            return f"directory {parent} does not exist"
    except OSError as e:  # e.g. a directory on the way that this user may not enter
        return f"cannot reach {parent}: {e.strerror or e}"
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{p.name}.", suffix=".check"):
            pass
    except OSError as e:
        return f"cannot write in {parent}: {e.strerror or e}"
    return None


def cmd_memwatch(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if argv and args.pid is not None:
        raise CommandError(EX_USAGE, "gce-watchdog memwatch: give --pid or -- CMD, not both")
    if args.pid is not None and args.pid <= 0:
        raise CommandError(EX_USAGE, f"gce-watchdog memwatch: bad --pid {args.pid}")
    kind, amount = args.warmup
    warmup = int(amount) if kind == "samples" else math.ceil(amount / args.interval)
    params = DetectorParams(
        warmup=warmup, window=args.min_samples, band=float(args.band), alpha=args.alpha
    )
    if args.out:
        why = _unwritable(args.out)
        if why:  # found out now, not after an hour of sampling (the verdict would be lost)
            raise CommandError(EX_USAGE, f"gce-watchdog memwatch: --out {args.out}: {why}")
    watching = bool(argv) or args.pid is not None
    gate = args.gate or (("tree", "gpu") if watching else ("host", "gpu"))
    try:
        run = collect(
            interval=args.interval,
            duration=args.duration,
            pid=args.pid,
            argv=argv or None,
            gpu=not args.no_gpu,
        )
    except OSError as e:  # the command could not be started (not found, not executable)
        raise CommandError(
            EX_NOTFOUND, f"gce-watchdog memwatch: cannot run {argv[0]!r}: {e.strerror or e}"
        ) from None
    overall, per = judge(run, params, gate)
    target: dict[str, Any] = {"pid": args.pid, "argv": argv or None}
    if args.out:
        doc = to_json(run, params, gate, overall, per, target)
        atomic_write(args.out, (json.dumps(doc, indent=1) + "\n").encode())
    head = (
        f"memwatch: {len(run.samples)} samples every {args.interval:g}s "
        f"(warm-up {warmup}, min {params.window}, band {params.band / GIB:g} GiB, "
        f"gate {','.join(gate)}); stopped by {run.stopped_by}"
    )
    if argv:
        head += f"; command {'rc=' + str(run.rc) if run.rc is not None else run.signal_name}"
    print(head)
    for name, (v, g) in per.items():
        print(_line(name, v, g))
    if not run.gpu_available:
        print(f"  gpu        absent: {run.gpu_reason}")
    sig = killed_by(run)
    if sig is not None:
        print(f"  command    FAIL: killed by {sig} (not sent by memwatch; an OOM kill is SIGKILL)")
    if overall == "COMMAND_FAILED":
        print(f"COMMAND FAILED (rc={run.rc}; memory: {memory_verdict(run, per).replace('_', ' ')})")
    else:
        print(overall.replace("_", " "))
    return exit_code(run, overall)
