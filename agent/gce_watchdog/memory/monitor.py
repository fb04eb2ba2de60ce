"""The in-agent memory monitor: samples on its own period, judges each gauge, writes serial lines.

Wiring (the daemon does this)::

    mon = MemoryMonitor(cfg.memory, emitter)   # stores values only
    mon.start()                          # own daemon thread; returns at once
    ...
    mon.latest                           # read-only {gauge: bytes} for the metrics exporter
    mon.stop(timeout=5.0)                # bounded; True when the thread ended

Lines (``docs/serial-protocol.md``, memory section): ``memory_gpu`` once at start (and when GPU
reads are lost or come back), ``mem`` at most once per ``memory.serial_every``, ``memory_climb``
when a gauge starts climbing, ``memory_ok`` when it stops, ``memory_action`` when the opt-in
``on_climb = "command"`` ran. Transitions only: a climb that lasts hours is one line, plus a
``climb=`` field on the rate-limited ``mem`` lines so a reader that lost it still sees it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from gce_watchdog.lib import proc
from gce_watchdog.memory import GIB
from gce_watchdog.memory.detector import ClimbVerdict, DetectorParams, Status, detect
from gce_watchdog.memory.samplers import (
    GpuGauges,
    GpuSampler,
    TopProcess,
    host_gauges,
    top_processes,
)
from gce_watchdog.vm.config import Config, MemorySection
from gce_watchdog.vm.console import Emitter
from gce_watchdog.wire import vocab

HostReader = Callable[[], dict[str, int]]
TopReader = Callable[[], list[TopProcess]]
# (argv, extra environment, timeout seconds) -> exit code, or a short error token
CommandRunner = Callable[[Sequence[str], Mapping[str, str], float], "int | str"]

# A climb is over only after this many consecutive periods without one: a leak whose test statistic
# wobbles around the significance level must not write a climb/ok pair every period.
OK_AFTER = 3


def _gib(v: float) -> str:
    return f"{v / GIB:.2f}"


def _eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "capacity unknown"
    m = int(seconds // 60)
    return f"full in ~{m // 60}h{m % 60:02d}m" if m >= 60 else f"full in ~{m}m"


def run_argv(argv: Sequence[str], env: Mapping[str, str], timeout: float) -> int | str:
    """Run an operator-configured argv (never a shell), bounded by ``timeout``."""
    r = proc.run(argv, timeout, env=env)
    if r.timed_out:
        return "timeout"
    if r.rc is None:
        return f"oserror_{r.error.errno if r.error else None}"
    return r.rc


class MemoryMonitor:
    """Samples host and GPU memory every ``memory.period`` and reports climbs on the serial port."""

    def __init__(
        self,
        memory: MemorySection,
        emitter: Emitter,
        clock: Callable[[], float] = time.monotonic,
        *,
        host: HostReader = host_gauges,
        top: TopReader = top_processes,
        gpu: GpuGauges | None = None,
        run_command: CommandRunner = run_argv,
        log: Callable[..., object] | None = None,
    ) -> None:
        self.cfg = memory
        self.emitter = emitter
        self.clock = clock
        self._host = host
        self._top = top
        self._gpu: GpuGauges = gpu if gpu is not None else GpuSampler()
        self._run_command = run_command
        self._log = log
        self.params = DetectorParams(
            warmup=0,  # warm-up is by time here: samples before start + memory.warmup are dropped
            window=self.cfg.window,
            band=self.cfg.band_gib * GIB,
            alpha=self.cfg.alpha,
            max_points=max(self.cfg.max_window, 2 * self.cfg.window),
        )
        self._hist: dict[str, deque[tuple[float, float]]] = {}
        self._verdicts: dict[str, ClimbVerdict] = {}
        self._climbing: dict[str, int] = {}  # gauge -> periods without a climb since it climbed
        self._latest: Mapping[str, int] = MappingProxyType({})
        self._started_at: float | None = None
        self._last_mem: float | None = None
        self._gpu_on = False
        self._gpu_lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0
        self.errors = 0

    # --- read-only views (any thread) ------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: Config, emitter: Emitter, *args: Any, **kw: Any) -> MemoryMonitor:
        """A monitor for ``cfg.memory`` (the rest of the config is not its business)."""
        return cls(cfg.memory, emitter, *args, **kw)

    @property
    def latest(self) -> Mapping[str, int]:
        """The last sample: gauge name -> bytes (``host_used``, ``gpu0_used``, ...)."""
        return self._latest

    @property
    def verdicts(self) -> Mapping[str, ClimbVerdict]:
        """The last verdict per judged gauge (``host``, ``gpu0``, ...)."""
        return MappingProxyType(dict(self._verdicts))

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sampling thread (no-op when ``memory.enabled`` is false or already running)."""
        if not self.cfg.enabled or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memwatch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Ask the thread to end and wait at most ``timeout``; True when it has ended."""
        self._stop.set()
        t = self._thread
        if t is None:
            return True
        t.join(timeout)
        if t.is_alive():
            return False
        self._thread = None
        return True

    def _run(self) -> None:
        self.open()
        try:
            while not self._stop.is_set():
                began = self.clock()
                try:
                    self.tick()
                except Exception as e:  # never take the agent down over a memory gauge
                    self.errors += 1
                    self._note("memwatch_error", error=repr(e))
                spent = self.clock() - began
                self._stop.wait(max(0.0, self.cfg.period - spent))
        finally:
            self.close()

    def open(self) -> None:
        """Open NVML (when configured) and say in one ``memory_gpu`` line what GPU gauges exist."""
        self._started_at = self.clock()
        if not self.cfg.gpu:
            self._emit_gpu("off", "GPU sampling disabled (memory.gpu = false)")
            return
        self._gpu_on = self._gpu.open()
        if self._gpu_on:
            self._emit_gpu("ok", self._gpu.reason + ": " + ",".join(self._gpu.names))
        else:
            self._emit_gpu("absent", "GPU gauges absent: " + self._gpu.reason)

    def close(self) -> None:
        if self._gpu_on:
            self._gpu.close()
            self._gpu_on = False

    # --- one period ------------------------------------------------------------------------------

    def tick(self) -> dict[str, ClimbVerdict]:
        """Take one sample, judge every gauge, write the lines due. Returns the verdicts."""
        if self._started_at is None:
            self.open()
        now = self.clock()
        self.ticks += 1
        gauges = dict(self._host())
        if self._gpu_on:
            g = self._gpu.sample()
            if g is not None:  # None: no news yet (the probe child has not answered once)
                self._gpu_health(bool(g))
                gauges.update(g)
        self._latest = MappingProxyType(gauges)
        started = self._started_at if self._started_at is not None else now
        judge = now >= started + self.cfg.warmup
        verdicts: dict[str, ClimbVerdict] = {}
        for name, (gauge, cap_gauge) in self._judged(gauges).items():
            hist = self._hist.setdefault(name, deque(maxlen=self.cfg.max_window))
            if judge:
                hist.append((now, float(gauges[gauge])))
            v = detect(hist, self.params, capacity=gauges.get(cap_gauge))
            self._verdicts[name] = verdicts[name] = v
            self._transition(name, v)
        self._maybe_mem_line(now, gauges)
        return verdicts

    def _judged(self, gauges: Mapping[str, int]) -> dict[str, tuple[str, str]]:
        out = {"host": ("host_used", "host_total")} if "host_used" in gauges else {}
        for key in sorted(gauges):
            if key.startswith("gpu") and key.endswith("_used"):
                dev = key[: -len("_used")]
                out[dev] = (key, f"{dev}_total")
        return out

    def _transition(self, name: str, v: ClimbVerdict) -> None:
        quiet = self._climbing.get(name)
        if v.status is Status.CLIMB:
            self._climbing[name] = 0
            if quiet is None:
                self._climb_line(name, v)
            return
        if quiet is None or v.status is Status.NOT_ENOUGH_DATA:
            return
        self._climbing[name] = quiet + 1
        if quiet + 1 >= OK_AFTER:
            del self._climbing[name]
            self.emitter.emit(
                vocab.MEMORY_OK,
                {"g": name, "st": str(v.status), "rng": _gib(v.range_bytes), "n": v.samples},
                f"{name} memory no longer climbing ({v.status})",
            )

    def _climb_line(self, name: str, v: ClimbVerdict) -> None:
        fields: dict[str, object] = {
            "g": name,
            "slope": f"{v.slope_gib_per_min:.3f}",
            "rng": _gib(v.range_bytes),
            "cur": _gib(v.last_bytes),
            "cap": _gib(v.capacity_bytes) if v.capacity_bytes else "-",
            "eta": "-" if v.seconds_to_full is None else int(v.seconds_to_full),
            "n": v.samples,
            "p": f"{v.p_value:.1e}",
        }
        if name == "host":
            top = self._top_field()
            if top:
                fields["top"] = top
        text = (
            f"{name} memory climbing {v.slope_gib_per_min:.3f} GiB/min, "
            f"{_eta_text(v.seconds_to_full)}"
        )
        self.emitter.emit(vocab.MEMORY_CLIMB, fields, text)
        if self.cfg.on_climb == "command":
            self._act(name, v)

    def _act(self, name: str, v: ClimbVerdict) -> None:
        env = {
            "GCEWD_MEM_GAUGE": name,
            "GCEWD_MEM_SLOPE_GIB_MIN": f"{v.slope_gib_per_min:.4f}",
            "GCEWD_MEM_CURRENT_BYTES": str(int(v.last_bytes)),
            "GCEWD_MEM_ETA_S": "" if v.seconds_to_full is None else str(int(v.seconds_to_full)),
        }
        res = self._run_command(self.cfg.climb_command, env, self.cfg.climb_command_timeout)
        ok = isinstance(res, int) and res == 0
        self.emitter.emit(
            vocab.MEMORY_ACTION,
            {
                "g": name,
                "act": "command",
                "rc": res if isinstance(res, int) else "-",
                "err": "-" if isinstance(res, int) else res,
            },
            f"on_climb command {'ran' if ok else 'FAILED'} for {name}",
        )

    def _gpu_health(self, any_read: bool) -> None:
        if not any_read and not self._gpu_lost:
            self._gpu_lost = True
            self._emit_gpu("lost", "GPU memory reads failing: " + self._gpu.last_error)
        elif any_read and self._gpu_lost:
            self._gpu_lost = False
            self._emit_gpu("ok", "GPU memory reads are back")

    def _emit_gpu(self, st: str, text: str) -> None:
        fields: dict[str, object] = {"st": st, "n": self._gpu.count if st == "ok" else 0}
        self.emitter.emit(vocab.MEMORY_GPU, fields, text)

    def _maybe_mem_line(self, now: float, gauges: Mapping[str, int]) -> None:
        every = self.cfg.serial_every
        if every <= 0 or (self._last_mem is not None and now - self._last_mem < every):
            return
        self._last_mem = now
        head: list[tuple[str, object]] = []
        if "host_used" in gauges:
            head.append(("hu", _gib(gauges["host_used"])))
        if "host_available" in gauges:
            head.append(("ha", _gib(gauges["host_available"])))
        if gauges.get("swap_total"):
            head.append(("sw", _gib(gauges.get("swap_used", 0))))
        top = self._top_field()
        if top:
            head.append(("top", top))
        climbing = sorted(self._climbing)
        if climbing:
            head.append(("climb", ",".join(climbing)))
        gpus = [
            (k[: -len("_used")].replace("gpu", "g"), _gib(v))
            for k, v in sorted(gauges.items(), key=lambda kv: _gpu_index(kv[0]))
            if k.startswith("gpu") and k.endswith("_used")
        ]
        for fields in vocab.pack_fields(head, gpus):
            self.emitter.emit(vocab.MEM, fields)

    def _top_field(self) -> str:
        try:
            tops = self._top()
        except Exception:  # /proc races; the top process is a hint, not a gauge
            return ""
        if not tops:
            return ""
        t = tops[0]
        return f"{t.name[:20]}:{_gib(t.rss)}"

    def _note(self, event: str, **kw: Any) -> None:
        if self._log is not None:
            self._log(event, **kw)


def _gpu_index(key: str) -> int:
    digits = "".join(c for c in key[3:] if c.isdigit())
    return int(digits) if digits else -1
