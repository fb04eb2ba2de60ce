"""The event vocabulary of the serial protocol: every event name, the field codecs that writers
and readers share, and fitting a line into :data:`~gce_watchdog.wire.protocol.MAX_LINE`.

Writers (the agent, the CLI commands, the start-up script's helpers) and readers (the poller, the
report) use these constants instead of string literals, so a renamed event or field is one edit and
a typo is an import error. ``docs/serial-protocol.md`` is the table of what each event carries.
Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gce_watchdog.wire import protocol

# -- event names (docs/serial-protocol.md, "Events") ---------------------------------------------
# the agent
START = "start"
TICK = "tick"
HEARTBEAT = "heartbeat"
RECOVERED = "recovered"
SHUTDOWN = "shutdown"
WOULD_SHUTDOWN = "would_shutdown"
# a dry-run decision (agent.action = "dry-run"): visible, never a failover, the agent goes on
DRY_RUN_SHUTDOWN = "dry_run_shutdown"
ACTION = "action"
STOP = "stop"
SIGNAL = "signal"
ERROR = "error"
WARN = "warn"
STALL = "stall"
PREEMPTED = "preempted"
INSTANCE = "instance"
MAINTENANCE = "maintenance"
DISARM = "disarm"
ARM = "arm"
# the memory watch (in the agent)
MEM = "mem"
MEMORY_GPU = "memory_gpu"
MEMORY_CLIMB = "memory_climb"
MEMORY_OK = "memory_ok"
MEMORY_ACTION = "memory_action"
# the GPU watch (in the agent; docs/serial-protocol.md, "GPU events")
GPU_FAULT = "gpu_fault"  # a hardware Xid (or NVML loss) confirmed by a second signal: decides
GPU_EVENT = "gpu_event"  # an application Xid, or a hardware one not confirmed: shown only
GPU_STALL = "gpu_stall"  # a GPU probe ran past its deadline: shown only
# the job's commands and the start-up script
PHASE = "phase"
SETUP_FAILED = "setup_failed"
EXIT = "exit"
# the job's own result, written by `gce-watchdog result ok|fail` (field `status`, optional `detail`)
RESULT = "result"
# the job watch (in the agent; docs/job-progress.md): the job's latest step and its age, at most
# one line per heartbeat period; a job with no progress for its window: decides
PROGRESS = "progress"
JOB_STUCK = "job_stuck"
# the end-of-life chain's announcement after a job's terminal line (`gce-watchdog end`)
END = "end"
FETCH = "fetch"
BOOTSTRAP_STEP = "bootstrap_step"
# the fault CLI
FAULT = "fault"
# every writer: the line key's announcement (seq 0 and 1 of a boot, every ANNOUNCE_EVERY-th seq)
KEY = protocol.KEY_EVENT
# `gce-watchdog key --rotate`: the new key, signed with the old one (never a verdict input)
REKEY = protocol.REKEY_EVENT

ALL_EVENTS = frozenset(
    {
        START, TICK, HEARTBEAT, RECOVERED, SHUTDOWN, WOULD_SHUTDOWN, ACTION, STOP, SIGNAL, ERROR,
        WARN, STALL, PREEMPTED, INSTANCE, MAINTENANCE, DISARM, ARM, MEM, MEMORY_GPU, MEMORY_CLIMB,
        MEMORY_OK, MEMORY_ACTION, PHASE, SETUP_FAILED, EXIT, FETCH, BOOTSTRAP_STEP, FAULT,
        DRY_RUN_SHUTDOWN, KEY, REKEY, RESULT, END, GPU_FAULT, GPU_EVENT, GPU_STALL, PROGRESS,
        JOB_STUCK,
    }
)  # fmt: skip

# -- the event sets, one per meaning -------------------------------------------------------------
# What a poller verdict can depend on (poller/verdict.py's table): these survive the timeline's
# compaction.
VERDICT_EVENTS = frozenset(
    {
        START, STOP, PHASE, SETUP_FAILED, EXIT, SHUTDOWN, PREEMPTED, RECOVERED, MAINTENANCE,
        GPU_FAULT, MEMORY_GPU, JOB_STUCK,
    }
)  # fmt: skip
# What a person wants to see as a point in time on the report's plot and in its table: the verdict
# inputs, plus what the agent decided while disarmed and the memory watch's turns.
MARKER_EVENTS = VERDICT_EVENTS | {WOULD_SHUTDOWN, DRY_RUN_SHUTDOWN, MEMORY_CLIMB, MEMORY_OK}
# Rows the HTML report highlights: the markers, except shutdown (it has a colour of its own) and
# memory_ok (the end of something already highlighted), plus the chain's steps and faults.
HIGHLIGHT_EVENTS = (MARKER_EVENTS - {SHUTDOWN, MEMORY_OK}) | {ACTION, FAULT}

# -- the job's result (docs/serial-protocol.md, `result` and `exit`) ----------------------------
# `result status=...`: what the job itself says about its run.
RESULT_OK = "ok"
RESULT_FAIL = "fail"
RESULT_STATUSES = (RESULT_OK, RESULT_FAIL)
# The `exit` line's `result` field, present only when the job was configured to report
# (`exec --expect-result`): whether a `result` line came from this run before the job exited.
EXIT_RESULT_REPORTED = "reported"
EXIT_RESULT_MISSING = "missing"
# The `exit` line's `idle` field (where the GPU watch is on, job/release.py): `busy` when a
# process still held a GPU or its memory was not back after the job (the poller's alarm).
EXIT_IDLE_BUSY = "busy"
# Why the VM ends (`end reason=...`): the job's own ending, never a wedge; `stuck`: the agent
# ended a stuck job (after its `job_stuck` line, [job] on_stuck = "end").
END_STUCK = "stuck"
END_REASONS = ("done", "failed", "setup_failed", END_STUCK)

# -- the GPU state on `memory_gpu` lines (`st`): `lost` is a GPU fault for the poller (every GPU
# stopped answering NVML) until a later `ok` of the same boot takes it back.
MEMORY_GPU_OK = "ok"
MEMORY_GPU_LOST = "lost"

# -- field codecs --------------------------------------------------------------------------------
# A probe result on ``tick``/``recovered`` lines: ``md``/``eg`` = ``verdict/reason/latency_ms``.
PROBE_KEYS = {"metadata": "md", "egress": "eg"}


@dataclass(frozen=True)
class ProbeField:
    """One probe's result as a line carries it. ``latency`` is the raw text (may be empty)."""

    verdict: str
    reason: str
    latency: str

    @property
    def latency_ms(self) -> int | None:
        return int(self.latency) if self.latency.isdigit() else None


def encode_probe(verdict: str, reason: str, latency_ms: int | str) -> str:
    """``fail/timeout/5001``: the value of ``md``/``eg``."""
    return f"{verdict}/{reason}/{latency_ms}"


def decode_probe(raw: str) -> ProbeField:
    """The inverse of :func:`encode_probe`; a bare ``fail`` (older writers) has empty parts."""
    verdict, _, rest = raw.partition("/")
    reason, _, latency = rest.partition("/")
    return ProbeField(verdict, reason, latency)


# The ladder's position on agent lines: ``rung`` = ``rung/threshold`` (``3/10``).
def encode_rung(rung: int, threshold: int) -> str:
    return f"{rung}/{threshold}"


def decode_rung(raw: str | None) -> tuple[int, int] | None:
    """``(rung, threshold)``, or None for a missing or malformed value."""
    rung, sep, threshold = (raw or "").partition("/")
    if not (
        sep and rung.isascii() and rung.isdigit() and threshold.isascii() and threshold.isdigit()
    ):
        return None
    return int(rung), int(threshold)


# -- fields for people ---------------------------------------------------------------------------


def human_value(key: str, value: str) -> str:
    """A field's value as a person reads it; the wire keeps the compact form.

    A probe result ``md``/``eg`` = ``verdict/reason/latency_ms`` reads ``fail timeout 500ms``
    (``ok 3ms``: the reason "ok" is left out); a latency ``mdl``/``egl`` gets its ``ms``.
    """
    if key in PROBE_KEYS.values() and "/" in value:
        pf = decode_probe(value)
        lat = pf.latency
        parts = [
            pf.verdict,
            pf.reason if pf.reason != "ok" else "",
            f"{lat}ms" if lat.isdigit() else lat,
        ]
        return " ".join(p for p in parts if p)
    if key in ("mdl", "egl") and value.isdigit():
        return f"{value}ms"
    return value


def human_fields(fields: Iterable[tuple[str, str]], skip: Iterable[str] = ()) -> str:
    """``k=v`` pairs for people (:func:`human_value`), ``skip`` keys left out."""
    left_out = set(skip)
    return " ".join(f"{k}={human_value(k, v)}" for k, v in fields if k not in left_out)


# -- fitting a line into MAX_LINE ----------------------------------------------------------------
# Worst case of the fixed part of a line: marker, boot, a 10-digit seq, timestamp, event name,
# the " #<signature><crc>" trailer and separators. Used to split `mem` lines with many GPUs
# (a2-megagpu-16g).
LINE_OVERHEAD = 6 + 1 + 8 + 1 + 10 + 1 + 24 + 1 + 3 + protocol.TRAILER_LEN


def fit_text(event: str, fields: Mapping[str, object], text: str) -> str:
    """The text, shortened (with "...") so the line stays within protocol.MAX_LINE.

    make_event would drop a too-long text altogether; for a failure reason the first 60 characters
    are worth much more than nothing. Sized for the widest seq and boot a line can carry.
    """
    clean = protocol.sanitize_text(text)
    probe = protocol.make_event(event, "f" * 8, 10**12, 0, fields)
    room = protocol.MAX_LINE - protocol.line_length(probe) - len(" | ")
    if len(clean) <= room:
        return clean
    return clean[: max(0, room - 3)].rstrip() + "..." if room > 3 else ""


def pack_fields(
    head: Sequence[tuple[str, object]], rest: Sequence[tuple[str, object]]
) -> list[list[tuple[str, object]]]:
    """Split fields over as few lines as fit in MAX_LINE (head fields on the first line)."""
    lines: list[list[tuple[str, object]]] = []
    cur = list(head)
    size = LINE_OVERHEAD + sum(len(k) + len(str(v)) + 2 for k, v in cur)
    for k, v in rest:
        add = len(k) + len(str(v)) + 2
        if size + add > protocol.MAX_LINE and cur:
            lines.append(cur)
            cur, size = [], LINE_OVERHEAD
        cur.append((k, v))
        size += add
    if cur:
        lines.append(cur)
    return lines
