"""Prometheus text-format metrics for node_exporter's textfile collector.

After every tick the agent rewrites one small file (``[metrics] directory``/``filename``, default
``/var/lib/prometheus/node-exporter/gce_watchdog.prom``): written to a temporary name in the same
directory, then renamed over the old one, so node_exporter never reads half a file. The format
(``# HELP``/``# TYPE`` lines, ``name{label="value"} number``) is simple enough to write by hand;
``prometheus-client`` would add a dependency to an agent that runs as root on every VM, for one
function (the tests parse the file with prometheus_client's own parser, as an oracle).
``docs/report.md`` lists every metric with a sample file.

Wiring (the daemon does this)::

    exp = MetricsExporter(cfg.metrics, cfg.agent.threshold, dropped=lambda: emitter.sink.dropped,
                          memory=lambda: mon.latest)
    deps.tick_hooks.append(exp)                 # one write + rename per tick, never raises
    on_shutdown = exp.wrap_shutdown(chain.execute)  # optional: the file says "decided" first

Rendering is a pure function of a :class:`Snapshot` (:func:`render`); only
:meth:`MetricsExporter.write` touches the file system.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from gce_watchdog import __version__
from gce_watchdog.daemon.ladder import ProbeVerdict, Shutdown, WouldShutdown
from gce_watchdog.daemon.tick import ProbeResult, TickReport
from gce_watchdog.vm.config import Config, MetricsSection

T = TypeVar("T")

PREFIX = "gce_watchdog"
FILE_MODE = 0o644  # node_exporter runs as its own user: the file must be world-readable

# The metric families, in file order: (name, type, help).
FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("build_info", "gauge", "gce-watchdog build; the value is always 1"),
    ("ladder_rung", "gauge", "ladder position: consecutive ticks with both probes failed"),
    ("ladder_threshold", "gauge", "rung at which the agent shuts the VM down"),
    ("ladder_fired", "gauge", "1 once the shutdown was decided in this boot"),
    (
        "armed",
        "gauge",
        "1 when reaching the threshold powers the VM off; 0 when disarmed, off GCE or a dry run",
    ),
    ("dry_run", "gauge", "1 when agent.action is dry-run: decisions are rehearsed, never acted on"),
    ("probe_verdict", "gauge", "last verdict per probe: 1 for the current verdict, else 0"),
    ("probe_latency_seconds", "gauge", "last probe latency per probe"),
    ("dns_ok", "gauge", "1 when DNS resolved the egress targets in the last tick, 0 when not"),
    ("tick_duration_seconds", "gauge", "wall time of the last tick (probes and actions)"),
    ("last_tick_timestamp_seconds", "gauge", "Unix time of the last tick (staleness alerts)"),
    ("ticks_total", "counter", "ticks since the agent process started"),
    ("tick_overruns_total", "counter", "ticks that ran past their slot (next one started at once)"),
    ("ticks_skipped_total", "counter", "tick slots that got no tick (in stalls)"),
    ("stalls_total", "counter", "gaps of more than two intervals between two tick starts"),
    ("shutdowns_decided_total", "counter", "real shutdowns decided (threshold reached, armed)"),
    (
        "dry_run_decisions_total",
        "counter",
        "threshold reached with agent.action = dry-run: the chain was rehearsed, nothing acted",
    ),
    ("would_shutdowns_total", "counter", "threshold reached while disarmed: nothing was done"),
    ("serial_lines_dropped_total", "counter", "serial lines lost (queue full or write failed)"),
    ("serial_reopens_total", "counter", "serial port reopens after a hangup or I/O error"),
    ("memory_bytes", "gauge", "latest memory sample per gauge (host_used, gpu0_used, ...)"),
    ("metrics_write_errors_total", "counter", "failed writes of this file (seen on the next)"),
)


@dataclass(frozen=True)
class Snapshot:
    """Everything the file says, as plain values."""

    rung: int = 0
    threshold: int = 10
    fired: bool = False
    armed: bool | None = None  # None: not known yet (no tick), no series
    dry_run: bool = False
    metadata: ProbeResult | None = None
    egress: ProbeResult | None = None
    dns: str = "-"
    tick_duration: float = 0.0
    last_tick: float = 0.0
    ticks: int = 0
    overruns: int = 0
    skipped: int = 0
    stalls: int = 0
    shutdowns: int = 0
    dry_runs: int = 0
    would_shutdowns: int = 0
    dropped: int = 0
    reopens: int = 0
    memory: Mapping[str, float] = field(default_factory=dict)
    write_errors: int = 0
    version: str = __version__


def printable(value: str) -> str:
    """Control characters (and lone surrogates) as ``_``: a label value is one line of UTF-8."""
    return "".join(c if c.isprintable() else "_" for c in value)


def escape_label(value: str) -> str:
    """A label value as the text format wants it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(float(v))


def _samples(s: Snapshot) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name, _, _ in FAMILIES}
    out["build_info"].append(({"version": s.version}, 1))
    out["ladder_rung"].append(({}, s.rung))
    out["ladder_threshold"].append(({}, s.threshold))
    out["ladder_fired"].append(({}, 1 if s.fired else 0))
    if s.armed is not None:
        out["armed"].append(({}, 1 if s.armed and not s.dry_run else 0))
    out["dry_run"].append(({}, 1 if s.dry_run else 0))
    for probe, r in (("metadata", s.metadata), ("egress", s.egress)):
        if r is None:
            continue
        for v in ProbeVerdict:  # a state set: every verdict present, so a change never leaves gaps
            out["probe_verdict"].append(({"probe": probe, "verdict": v.value}, v is r.verdict))
        out["probe_latency_seconds"].append(({"probe": probe}, r.latency_ms / 1000))
    if s.dns in ("ok", "fail"):  # "-": no names to resolve, nothing to say
        out["dns_ok"].append(({}, 1 if s.dns == "ok" else 0))
    if s.last_tick:
        out["tick_duration_seconds"].append(({}, s.tick_duration))
        out["last_tick_timestamp_seconds"].append(({}, s.last_tick))
    out["ticks_total"].append(({}, s.ticks))
    out["tick_overruns_total"].append(({}, s.overruns))
    out["ticks_skipped_total"].append(({}, s.skipped))
    out["stalls_total"].append(({}, s.stalls))
    out["shutdowns_decided_total"].append(({}, s.shutdowns))
    out["dry_run_decisions_total"].append(({}, s.dry_runs))
    out["would_shutdowns_total"].append(({}, s.would_shutdowns))
    out["serial_lines_dropped_total"].append(({}, s.dropped))
    out["serial_reopens_total"].append(({}, s.reopens))
    seen: set[str] = set()
    for gauge in sorted(s.memory):
        label = printable(gauge)
        if label not in seen:  # two names that only differ in unprintable characters: first wins
            seen.add(label)
            out["memory_bytes"].append(({"gauge": label}, float(s.memory[gauge])))
    out["metrics_write_errors_total"].append(({}, s.write_errors))
    return out


def render(s: Snapshot) -> str:
    """The whole file. Families without samples (no probe yet, no memory monitor) are left out."""
    lines: list[str] = []
    samples = _samples(s)
    for name, kind, help_text in FAMILIES:
        rows = samples[name]
        if not rows:
            continue
        full = f"{PREFIX}_{name}"
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} {kind}")
        for labels, value in rows:
            lab = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
            head = f"{full}{{{lab}}}" if lab else full
            lines.append(f"{head} {format_value(float(value))}")
    return "\n".join(lines) + "\n"


class MetricsExporter:
    """A ``Deps.tick_hooks`` entry: rewrites the metrics file after every tick; never raises.

    ``dropped`` returns the serial lines dropped so far; ``memory`` the memory monitor's latest
    ``{gauge: bytes}`` (None: no memory monitor); ``clock`` the wall clock (Unix seconds);
    ``dry_run``: ``agent.action = "dry-run"`` (decisions go to their own counter, never to
    ``shutdowns_decided_total``, and ``armed`` is 0).
    """

    def __init__(
        self,
        metrics: MetricsSection,
        threshold: int,
        dropped: Callable[[], int],
        memory: Callable[[], Mapping[str, float]] | None = None,
        clock: Callable[[], float] = time.time,
        dry_run: bool = False,
        reopens: Callable[[], int] = lambda: 0,
    ) -> None:
        m = metrics
        self.enabled = m.enabled
        self.path = os.path.join(m.directory, m.filename)
        # Not *.prom: node_exporter must never read the file while it is being written.
        self.tmp_path = os.path.join(m.directory, f".{m.filename}.tmp")
        self.threshold = threshold  # agent.threshold: the ladder's top, a gauge of its own
        self.dropped = dropped
        self.reopens = reopens  # the serial port's reopen attempts (vm/console.py)
        self.memory = memory
        self.clock = clock
        self.dry_run = dry_run
        self.shutdowns = 0
        self.dry_runs = 0
        self.would_shutdowns = 0
        self.writes = 0
        self.errors = 0  # failed writes other than a missing directory
        self.missing_dir = 0  # writes skipped: the directory does not exist (no node_exporter)
        self.last_error = ""
        self._announced = False  # a wrap_shutdown() hook already counted this decision
        self.last: Snapshot | None = None

    # -- the tick hook -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: Config, *args: Any, **kw: Any) -> MetricsExporter:
        """An exporter for ``cfg.metrics``, the ladder's threshold and ``agent.action``."""
        kw.setdefault("dry_run", cfg.agent.action == "dry-run")
        return cls(cfg.metrics, cfg.agent.threshold, *args, **kw)

    def __call__(self, report: TickReport) -> None:
        if not self.enabled:
            return
        try:
            snap = self.snapshot(report)
        except Exception as e:  # a bug here must not cost the ladder anything
            self.errors += 1
            self.last_error = f"snapshot: {type(e).__name__}: {e}"
            return
        self.write(render(snap))

    def snapshot(self, report: TickReport) -> Snapshot:
        """Fold one tick report into the counters; returns what the file will say."""
        for a in report.actions:
            if isinstance(a, Shutdown):
                if self._announced:
                    self._announced = False
                else:
                    self.shutdowns += 1
            elif isinstance(a, WouldShutdown) and self.dry_run and report.armed:
                # A dry run is "disarmed" to the ladder, and the agent rehearses the chain.
                if self._announced:
                    self._announced = False
                else:
                    self.dry_runs += 1
            elif isinstance(a, WouldShutdown):
                self.would_shutdowns += 1
        snap = Snapshot(
            rung=report.state.rung,
            threshold=self.threshold,
            fired=report.state.fired,
            armed=report.armed,
            dry_run=self.dry_run,
            metadata=report.result.metadata,
            egress=report.result.egress,
            dns=report.result.dns,
            tick_duration=report.duration,
            last_tick=self.clock(),
            ticks=report.n,
            overruns=report.overruns,
            skipped=report.skipped,
            stalls=report.stalls,
            shutdowns=self.shutdowns,
            dry_runs=self.dry_runs,
            would_shutdowns=self.would_shutdowns,
            dropped=self._safe(self.dropped, 0),
            reopens=self._safe(self.reopens, 0),
            memory=self._safe(self.memory, {}) if self.memory is not None else {},
            write_errors=self.errors,
        )
        self.last = snap
        return snap

    def wrap_shutdown(self, hook: Callable[..., None]) -> Callable[..., None]:
        """Wrap ``Deps.on_shutdown`` so the file says "decided" before the chain runs.

        Tick hooks run after ``on_shutdown`` returns, and a real shutdown chain never returns (the
        power goes off): without this the last file would still show the rung below threshold.
        A dry run's rehearsal runs on a thread of its own, beside the ticks (issue 38): the
        decision tick's hook, on the loop's thread, counts it (never this wrapper, which runs on
        the rehearsal's thread and would race it).
        """

        def wrapped(reason: str, rung: int, threshold: int, **resume: Any) -> None:
            # A resumed chain (agent restarted, or a new power-off attempt) is the same decision.
            if self.enabled and resume.get("resume_at") is None and not self.dry_run:
                try:
                    self._announced = True
                    base = self.last or Snapshot(threshold=threshold, dry_run=self.dry_run)
                    self.shutdowns += 1
                    snap = replace(
                        base,
                        rung=rung,
                        threshold=threshold,
                        fired=True,
                        shutdowns=self.shutdowns,
                        write_errors=self.errors,
                    )
                    self.last = snap
                    self.write(render(snap))
                except Exception as e:
                    self.errors += 1
                    self.last_error = f"shutdown: {type(e).__name__}: {e}"
            hook(reason, rung, threshold, **resume)

        return wrapped

    # -- the file ------------------------------------------------------------------------------

    def write(self, text: str) -> bool:
        """Write ``text`` to the temporary name and rename it over the file. Never raises.

        No fsync: the file is rewritten every tick and rebuilt from scratch after a crash; the
        rename alone already guarantees a reader sees the old file or the new one, never a mix.
        """
        data = text.encode("utf-8", "replace")
        # The textfile directory often belongs to node_exporter's user: a symlink or hard link
        # planted at the temporary name must not make this root process write through it. So
        # remove whatever is there and create the file afresh (O_EXCL never follows a link).
        with contextlib.suppress(OSError):
            os.unlink(self.tmp_path)
        try:
            fd = os.open(
                self.tmp_path,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                FILE_MODE,
            )
        except FileNotFoundError:
            self.missing_dir += 1
            self.last_error = f"{os.path.dirname(self.path)} does not exist"
            return False
        except OSError as e:
            return self._failed(e)
        try:
            try:
                view = memoryview(data)
                while view:  # bounded: every pass writes at least one byte or raises
                    n = os.write(fd, view)
                    view = view[n:]
                os.fchmod(fd, FILE_MODE)  # the agent's umask must not hide it from node_exporter
            finally:
                os.close(fd)
            os.replace(self.tmp_path, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp_path)
            return self._failed(e)
        self.writes += 1
        return True

    def _failed(self, e: OSError) -> bool:
        self.errors += 1
        self.last_error = f"{self.path}: {e.strerror or e}"
        return False

    @staticmethod
    def _safe(fn: Callable[[], T] | None, default: T) -> T:
        if fn is None:
            return default
        try:
            return fn()
        except Exception:  # a broken gauge source loses its samples, not the file
            return default
