"""``gce-watchdog memwatch``: validate a workload's memory the way the team did by hand.

Samples host memory, a process tree's RSS and the GPU gauges every ``--interval``, then judges each
gauge with the climb detector and ends with PASS, FAIL or NOT ENOUGH DATA (distinct exit codes).
``docs/memory-watch.md`` documents the options, the verdict rules and the ``--out`` JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import FrameType
from typing import Any

from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.memory import GIB
from gce_watchdog.memory.detector import MIN_WINDOW, ClimbVerdict, DetectorParams, Status, detect

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_USAGE = 2  # argparse
EXIT_NOT_ENOUGH_DATA = 3
EXIT_CANNOT_RUN = 127  # like a shell: the command could not be started
# After a forwarded SIGINT/SIGTERM the command gets this long to exit before SIGKILL: long enough
# for a training loop to write a checkpoint line, short enough that Ctrl-C still feels like a stop.
KILL_GRACE_S = 10.0
JSON_VERSION = 1

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KIB": 1 << 10,
    "KB": 10**3,
    "M": 1 << 20,
    "MIB": 1 << 20,
    "MB": 10**6,
    "G": 1 << 30,
    "GIB": 1 << 30,
    "GB": 10**9,
    "T": 1 << 40,
    "TIB": 1 << 40,
    "TB": 10**12,
}


def parse_size(text: str) -> int:
    """Bytes from ``"1GiB"``, ``"512MiB"``, ``"1.5G"`` (binary), ``"2GB"`` (decimal), ``"4096"``."""
    m = _SIZE_RE.match(text)
    unit = (m.group(2) or "").upper() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use bytes or a unit: 512MiB, 1GiB, 2GB)"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


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


def register(sub: Any) -> None:
    p = sub.add_parser(
        "memwatch",
        help="watch host, process-tree and GPU memory; PASS/FAIL against the pass band",
        description=(
            "Sample memory every --interval and judge each gauge: PASS (exit 0) when it stays "
            "within --band after warm-up, FAIL (exit 1) on a climb, a step or a wide range, "
            "NOT ENOUGH DATA (exit 3) with fewer than --min-samples after warm-up. "
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
    p.add_argument("--band", type=parse_size, default=GIB, help="pass band for the range (1GiB)")
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


# --- sampling ------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one memwatch session collected."""

    interval: float
    samples: list[dict[str, float]] = field(default_factory=list)  # {"t": s, gauge: bytes, ...}
    gpu_available: bool = False
    gpu_reason: str = ""
    gpu_names: list[str] = field(default_factory=list)
    rc: int | None = None
    signal_name: str | None = None
    forwarded: list[str] = field(default_factory=list)
    stopped_by: str = ""  # "exit", "pid-gone", "duration", "signal"
    started_at: str = ""
    ended_at: str = ""


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class _Signals:
    """SIGINT/SIGTERM: forward to the command's process group, or end the sampling."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, stop: threading.Event) -> None:
        self.proc = proc
        self.stop = stop
        self.received: list[str] = []
        self.first_at: float | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum).name)
        if self.first_at is None:
            self.first_at = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signum)
        self.stop.set()  # wake the sampler; with a command it keeps sampling until that exits


def collect(
    *,
    interval: float,
    duration: float | None,
    pid: int | None,
    argv: Sequence[str] | None,
    gpu: bool,
    nvml: Any = None,
    out: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> Run:
    """Sample until the command exits, the pid is gone, --duration passes, or a signal arrives."""
    from gce_watchdog.memory.samplers import GpuSampler, host_gauges, tree_rss

    run = Run(interval=interval, started_at=_now_iso())
    sampler = GpuSampler(nvml=nvml)
    if gpu:
        run.gpu_available = sampler.open()
        run.gpu_reason = sampler.reason
        run.gpu_names = list(sampler.names)
    else:
        run.gpu_reason = "disabled (--no-gpu)"
    out(f"memwatch: GPU gauges {'present' if run.gpu_available else 'absent'}: {run.gpu_reason}")
    proc: subprocess.Popen[bytes] | None = None
    if argv:
        # argv, never a shell; its own process group so signals reach the whole tree.
        proc = subprocess.Popen(list(argv), process_group=0)
        pid = proc.pid
    stop = threading.Event()
    t0 = time.monotonic()
    try:
        with _Signals(proc, stop) as sigs:
            k = 0
            while True:
                now = time.monotonic()
                row: dict[str, float] = {"t": round(now - t0, 3)}
                row.update(host_gauges())
                if pid is not None:
                    rss = tree_rss(pid)
                    if rss is not None:
                        row["tree_rss"] = rss
                row.update(sampler.sample() if run.gpu_available else {})
                run.samples.append(row)
                if proc is not None and proc.poll() is not None:
                    run.stopped_by = "exit"
                    break
                if proc is None and pid is not None and "tree_rss" not in row:
                    run.stopped_by = "pid-gone"
                    break
                if duration is not None and now - t0 >= duration:
                    run.stopped_by = "duration"
                    break
                if sigs.received and proc is None:
                    run.stopped_by = "signal"
                    break
                if (
                    proc is not None
                    and sigs.first_at is not None
                    and time.monotonic() - sigs.first_at > KILL_GRACE_S
                ):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                k += 1
                # Sleep to the next slot on the grid (no drift); a signal wakes us early.
                stop.wait(max(0.0, t0 + k * interval - time.monotonic()))
                stop.clear()
            run.forwarded = list(sigs.received) if proc is not None else []
    finally:
        if proc is not None:
            if proc.poll() is None:  # we are leaving (duration, error): do not orphan it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            rc = proc.returncode
            run.rc = rc if rc >= 0 else None
            run.signal_name = signal.Signals(-rc).name if rc < 0 else None
        sampler.close()
    run.ended_at = _now_iso()
    return run


# --- judging -------------------------------------------------------------------------------------


def _gauge_kind(name: str) -> str:
    if name == "tree_rss":
        return "tree"
    if name.startswith("gpu"):
        return "gpu"
    return "host"


def judge(
    run: Run, params: DetectorParams, gate: Sequence[str]
) -> tuple[str, dict[str, tuple[ClimbVerdict, bool]]]:
    """Overall verdict (PASS, FAIL, NOT_ENOUGH_DATA) and per-gauge (verdict, gated)."""
    names = ["host_used", "tree_rss"]
    gpu_used = sorted(
        {k for row in run.samples for k in row if k.startswith("gpu") and k.endswith("_used")},
        key=lambda k: int("".join(c for c in k if c.isdigit()) or 0),
    )
    per: dict[str, tuple[ClimbVerdict, bool]] = {}
    last = run.samples[-1] if run.samples else {}
    for name in names + gpu_used:
        series = [(row["t"], row[name]) for row in run.samples if name in row]
        if not series:
            continue
        cap_key = "host_total" if name in ("host_used", "tree_rss") else name[:-5] + "_total"
        cap = last.get(cap_key)
        per[name] = (detect(series, params, capacity=cap), _gauge_kind(name) in gate)
    gated = [v for v, g in per.values() if g]
    if any(v.status in (Status.CLIMB, Status.STEP, Status.UNSTABLE) for v in gated):
        return "FAIL", per
    if not gated or any(v.status is Status.NOT_ENOUGH_DATA for v in gated):
        return "NOT_ENOUGH_DATA", per
    return "PASS", per


def to_json(
    run: Run,
    params: DetectorParams,
    gate: Sequence[str],
    overall: str,
    per: dict[str, tuple[ClimbVerdict, bool]],
    target: dict[str, Any],
) -> dict[str, Any]:
    return {
        "version": JSON_VERSION,
        "tool": "gce-watchdog memwatch",
        "verdict": overall,
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "stopped_by": run.stopped_by,
        "settings": {
            "interval_s": run.interval,
            "warmup_samples": params.warmup,
            "min_samples": params.window,
            "band_bytes": int(params.band),
            "alpha": params.alpha,
            "gate": list(gate),
        },
        "target": {
            **target,
            "rc": run.rc,
            "signal": run.signal_name,
            "forwarded_signals": run.forwarded,
        },
        "gpu": {
            "available": run.gpu_available,
            "reason": run.gpu_reason,
            "names": run.gpu_names,
        },
        "gauges": {name: {"gated": g, **v.to_dict()} for name, (v, g) in per.items()},
        "samples": run.samples,
    }


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


def cmd_memwatch(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if argv and args.pid is not None:
        print("gce-watchdog memwatch: give --pid or -- CMD, not both", file=sys.stderr)
        return EXIT_USAGE
    if args.pid is not None and args.pid <= 0:
        print(f"gce-watchdog memwatch: bad --pid {args.pid}", file=sys.stderr)
        return EXIT_USAGE
    kind, amount = args.warmup
    warmup = int(amount) if kind == "samples" else math.ceil(amount / args.interval)
    params = DetectorParams(
        warmup=warmup, window=args.min_samples, band=float(args.band), alpha=args.alpha
    )
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
        print(f"gce-watchdog memwatch: cannot run {argv[0]!r}: {e.strerror or e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    overall, per = judge(run, params, gate)
    target: dict[str, Any] = {"pid": args.pid, "argv": argv or None}
    if args.out:
        from gce_watchdog.lib.files import atomic_write

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
    print(overall.replace("_", " "))
    return {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL}.get(overall, EXIT_NOT_ENOUGH_DATA)
