"""``gce-watchdog memwatch``: validate a workload's memory the way the team did by hand.

Samples host memory, a process tree's RSS and the GPU gauges every ``--interval``, then judges each
gauge with the climb detector and ends with PASS, FAIL or NOT ENOUGH DATA (distinct exit codes).
``docs/memory-watch.md`` documents the options, the verdict rules and the ``--out`` JSON.
"""

from __future__ import annotations

import contextlib
import os
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

from gce_watchdog.lib.cli import size_arg
from gce_watchdog.memory.detector import ClimbVerdict, DetectorParams, Status, detect
from gce_watchdog.memory.samplers import GpuSampler, host_gauges, tree_rss

# memwatch's own verdict code (the others are lib/cli's: EX_OK PASS, EX_FAIL FAIL, EX_USAGE,
# EX_NOTFOUND when the command could not be started, like a shell)
EXIT_NOT_ENOUGH_DATA = 3
# After a forwarded SIGINT/SIGTERM the command gets this long to exit before SIGKILL: long enough
# for a training loop to write a checkpoint line, short enough that Ctrl-C still feels like a stop.
KILL_GRACE_S = 10.0
JSON_VERSION = 1


def parse_size(text: str) -> int:
    """Bytes from ``"1GiB"``, ``"512MiB"``, ``"2GB"``: the one size parser (lib/sizes), which
    needs a unit (a bare ``1.5`` is refused, not read as 1.5 bytes)."""
    return size_arg(text)


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


def killed_by(run: Run) -> str | None:
    """The signal that ended the command on its own (an OOM kill is a SIGKILL nobody here sent),
    or None: it exited, or memwatch itself stopped it (--duration, a forwarded Ctrl-C)."""
    if run.signal_name and run.stopped_by == "exit" and not run.forwarded:
        return run.signal_name
    return None


def judge(
    run: Run, params: DetectorParams, gate: Sequence[str]
) -> tuple[str, dict[str, tuple[ClimbVerdict, bool]]]:
    """Overall verdict (PASS, FAIL, NOT_ENOUGH_DATA) and per-gauge (verdict, gated).

    A command ended by a signal that memwatch did not send is FAIL whatever the gauges say: a
    SIGKILL out of nowhere is what the kernel's OOM killer looks like."""
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
    if killed_by(run) is not None:
        return "FAIL", per
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
            "killed_by": killed_by(run),
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
