"""The GPU watch as a service of the agent: a thread that steps gpu/watch.py every ``period``.

``[gpu] enabled = auto`` turns it on only where the NVIDIA driver is loaded (``driver_path``
exists): elsewhere nothing starts and no GPU library is imported, in the agent or a child. The
kernel log that cannot be opened (no ``/dev/kmsg`` in a container, say) leaves the NVML side on
and says why in ``reason``. Lines go out through the agent's emitter (signed, numbered); a
``gpu_fault`` is written synchronously, as every decisive line is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from gce_watchdog.gpu.kmsg import KmsgReader
from gce_watchdog.gpu.probe import CHILD_ARGV, GpuProbe
from gce_watchdog.gpu.watch import GpuWatch, GpuWatchConfig
from gce_watchdog.lib.loop import Loop
from gce_watchdog.vm.config import GpuSection
from gce_watchdog.vm.console import Emitter

# vocab.GPU_FAULT once the poller's GPU verdict lands in wire/vocab.py.
GPU_FAULT = "gpu_fault"


def gpu_enabled(cfg: GpuSection) -> bool:
    if cfg.enabled == "auto":
        return os.path.exists(cfg.driver_path)
    return cfg.enabled == "on"


class GpuService:
    def __init__(
        self,
        cfg: GpuSection,
        emitter: Emitter,
        *,
        progress_stopped: Callable[[], bool] = lambda: False,
        probe_argv: Sequence[str] = CHILD_ARGV,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.emitter = emitter
        self.progress_stopped = progress_stopped
        self.probe_argv = tuple(probe_argv)
        self.monotonic = monotonic
        self.reason = "not started"
        self._watch: GpuWatch | None = None
        self._loop = Loop("gpuwatch")

    def start(self) -> None:
        if not gpu_enabled(self.cfg):
            self.reason = (
                f"off ([gpu] enabled = {self.cfg.enabled}, driver: {self.cfg.driver_path})"
            )
            return
        kmsg: KmsgReader | None = KmsgReader(self.cfg.kmsg_path)
        assert kmsg is not None
        try:
            kmsg.open()
            self.reason = "kernel log and NVML probe"
        except OSError as e:
            kmsg = None
            self.reason = f"NVML probe only: cannot read {self.cfg.kmsg_path}: {e.strerror}"
        probe = GpuProbe(self.cfg.probe_timeout, argv=self.probe_argv)
        wcfg = GpuWatchConfig(
            episode_quiet=self.cfg.episode_quiet, unanswered_window=self.cfg.unanswered_window
        )
        self._watch = GpuWatch(wcfg, self._say, kmsg, probe)
        self._loop.every(self.cfg.period, self._step)

    def stop(self, timeout: float = 5.0) -> bool:
        ended = self._loop.stop(timeout)
        if self._watch is not None:
            self._watch.close()  # kills a probe child even while it is stuck in NVML
        return ended

    def latest_sample(self) -> dict[str, object] | None:
        """The watch's last good NVML answer (None: not started, or no answer yet)."""
        return self._watch.latest_sample if self._watch is not None else None

    def _step(self) -> None:
        assert self._watch is not None
        self._watch.step(self.monotonic(), self.progress_stopped())

    def _say(self, event: str, fields: dict[str, str], text: str) -> None:
        self.emitter.emit(event, fields, text, sync=event == GPU_FAULT)


class ProbeGauges:
    """GPU memory gauges for the memory monitor from the service's latest probe sample, so the
    memory watch never calls NVML itself (a hung call would stop it) and imports no GPU library
    where there is no driver. Implements memory/samplers.py's ``GpuGauges``."""

    def __init__(self, service: GpuService) -> None:
        self._svc = service
        self.reason = "not opened"
        self.names: list[str] = []
        self.last_error = ""

    def open(self) -> bool:
        if not gpu_enabled(self._svc.cfg):
            self.reason = f"no NVIDIA driver ({self._svc.cfg.driver_path} absent) or [gpu] off"
            return False
        self.reason = "GPU(s) via the probe child"
        return True

    @property
    def count(self) -> int:
        latest = self._svc.latest_sample()
        gpus = latest.get("gpus") if latest is not None else None
        return len(gpus) if isinstance(gpus, list) else 0

    def sample(self) -> dict[str, int] | None:
        latest = self._svc.latest_sample()
        if latest is None:
            return None  # the child has not answered yet: no news, not a lost GPU
        out: dict[str, int] = {}
        gpus = latest.get("gpus")
        for g in gpus if isinstance(gpus, list) else []:
            if not isinstance(g, dict) or g.get("lost") is True:
                continue
            i, used, total = g.get("index"), g.get("used"), g.get("total")
            if isinstance(i, int) and isinstance(used, int) and isinstance(total, int):
                out[f"gpu{i}_used"], out[f"gpu{i}_total"] = used, total
        if not out:
            self.last_error = "the probe's last sample has no GPU memory"
        return out

    def close(self) -> None:
        return None
