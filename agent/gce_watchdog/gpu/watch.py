"""The agent's GPU watch: kernel Xid records and NVML samples in, ``gpu_*`` lines out.

Every ``step(now)`` (the agent calls it once per tick; it never blocks) drains new kernel records
(gpu/kmsg.py), polls the probe child (gpu/probe.py) and says, through the injected ``say``:
- ``gpu_event`` for each new (GPU, Xid) episode that does not decide (application Xids, Xid 45,
  hardware Xids not yet confirmed);
- ``gpu_fault`` for a hardware Xid confirmed by a second signal on the same GPU (gpu/episode.py),
  for a fault NVML shows alone (gpu/health.py), and for NVML unable to answer past
  ``unanswered_window`` (a stall or a broken library), once per GPU and cause;
- ``gpu_stall`` once per stall of the probe child past ``probe_timeout``.
Records not written by the kernel (facility != 0: ``logger``, the workload) are counted in
``forged`` and never said. Times are the caller's monotonic seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from gce_watchdog.gpu import episode, health
from gce_watchdog.gpu.episode import Episodes, GpuDecision, SecondSignal
from gce_watchdog.gpu.kmsg import ReadBatch
from gce_watchdog.gpu.probe import ProbeResult
from gce_watchdog.gpu.xid import XidClass, parse_xid

Say = Callable[[str, dict[str, str], str], None]


class RecordSource(Protocol):
    """gpu/kmsg.py's KmsgReader, or a test's scripted records."""

    def drain(self) -> ReadBatch: ...
    def close(self) -> None: ...


class Prober(Protocol):
    """gpu/probe.py's GpuProbe, or a test's scripted answers."""

    def poll(self, now: float) -> ProbeResult: ...
    def close(self) -> None: ...


MAX_PENDING = episode.MAX_EPISODES


@dataclass(frozen=True, slots=True)
class GpuWatchConfig:
    episode_quiet: float = 600.0  # an Xid flood is one episode until this long without a record
    unanswered_window: float = 300.0  # NVML unable to answer this long counts as a fault


class GpuWatch:
    def __init__(
        self, cfg: GpuWatchConfig, say: Say, kmsg: RecordSource | None, probe: Prober | None
    ) -> None:
        self.cfg = cfg
        self._say = say
        self._kmsg = kmsg
        self._probe = probe
        self._episodes = Episodes()
        self._signals: dict[str, SecondSignal] = {}  # pci key -> the latest second signal
        self._index: dict[str, int] = {}  # pci key -> GPU index
        self._bus_of: dict[int, str] = {}  # GPU index -> pci key, as last seen
        self._pending: dict[tuple[str, int], int] = {}  # unconfirmed hardware Xids
        self._said: set[tuple[str, str]] = set()  # (gpu, cause) faults already said
        self._boot_count: int | None = None
        self._prev_ecc: dict[int, int] = {}
        self._unanswered_since: float | None = None
        self.forged = 0
        self.latest_sample: dict[str, object] | None = None  # the last good NVML answer

    def step(self, now: float, progress_stopped: bool = False) -> None:
        if self._kmsg is not None:
            self._read_kmsg(now, progress_stopped)
        if self._probe is not None:
            self._poll_probe(now)
        self._confirm_pending(now, progress_stopped)
        self._check_unanswered(now)

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
        if self._kmsg is not None:
            self._kmsg.close()

    def _read_kmsg(self, now: float, progress_stopped: bool) -> None:
        assert self._kmsg is not None
        batch = self._kmsg.drain()
        for rec in batch.records:
            xr = parse_xid(rec.message)
            if xr is None:
                continue
            if not rec.from_kernel:
                self.forged += 1
                continue
            self._episodes, new = episode.observe(self._episodes, xr, now, self.cfg.episode_quiet)
            if not new:
                continue
            pci = health.pci_key(xr.pci) or xr.pci
            cls = xr.xid_class
            sig = self._signal(pci, progress_stopped)
            decision = episode.decide(cls, sig, self._unanswered(now), self.cfg.unanswered_window)
            fields = {"xid": str(xr.xid), "pci": pci, "gpu": self._gpu(pci)}
            if decision is GpuDecision.FAULT:
                self._fault(pci, f"xid{xr.xid}", {**fields, "sig": sig.value}, xr.text)
                continue
            self._say("gpu_event", {**fields, "cls": cls.value}, xr.text)
            if cls is XidClass.HARDWARE and len(self._pending) < MAX_PENDING:
                self._pending[(pci, xr.xid)] = 1

    def _poll_probe(self, now: float) -> None:
        assert self._probe is not None
        r = self._probe.poll(now)
        if r.stalled_for is not None:
            self._unanswered_since = self._unanswered_since or now - r.stalled_for
            self._say("gpu_stall", {"waited": f"{r.stalled_for:.1f}s"}, "GPU probe did not answer")
        if r.sample is None:
            return
        if "error" in r.sample:
            if self._unanswered_since is None:
                self._unanswered_since = now
            return
        self._unanswered_since = None
        self.latest_sample = r.sample
        findings = health.assess(r.sample, self._boot_count, self._prev_ecc)
        count = r.sample.get("count")
        if self._boot_count is None and isinstance(count, int):
            self._boot_count = count
        self._prev_ecc = health.ecc_counts(r.sample)
        for f in findings:
            # A GPU that fell off the bus cannot tell NVML its PCI id any more: use the one an
            # earlier sample gave for its index, so the Xid that names it still finds its signal.
            bus = f.bus or self._bus_of.get(f.index, "")
            if bus:
                self._index[bus] = f.index
                self._bus_of[f.index] = bus
                self._signals[bus] = f.signal
                f = replace(f, bus=bus)
            if f.fault:
                gpu = str(f.index) if f.index >= 0 else "-"
                self._fault(
                    f.bus or gpu,
                    f.fault,
                    {"xid": "0", "pci": f.bus or "-", "gpu": gpu, "sig": f.signal.value},
                    f"NVML: {f.fault}",
                )

    def _confirm_pending(self, now: float, progress_stopped: bool) -> None:
        for pci, xid in list(self._pending):
            sig = self._signal(pci, progress_stopped)
            d = episode.decide(
                XidClass.HARDWARE, sig, self._unanswered(now), self.cfg.unanswered_window
            )
            if d is GpuDecision.FAULT:
                del self._pending[(pci, xid)]
                fields = {"xid": str(xid), "pci": pci, "gpu": self._gpu(pci), "sig": sig.value}
                self._fault(pci, f"xid{xid}", fields, "confirmed by a second signal")

    def _check_unanswered(self, now: float) -> None:
        waited = self._unanswered(now)
        if self._unanswered_since is not None and waited >= self.cfg.unanswered_window:
            self._fault(
                "-",
                "nvml_unanswered",
                {"xid": "0", "pci": "-", "gpu": "-", "sig": SecondSignal.NVML_UNANSWERED.value},
                f"NVML has not answered for {waited:.0f}s",
            )

    def _signal(self, pci: str, progress_stopped: bool) -> SecondSignal:
        sig = self._signals.get(pci, SecondSignal.NONE)
        if sig is SecondSignal.NONE and self._unanswered_since is not None:
            return SecondSignal.NVML_UNANSWERED
        if sig is SecondSignal.NONE and progress_stopped:
            return SecondSignal.PROGRESS_STOPPED
        return sig

    def _unanswered(self, now: float) -> float:
        return 0.0 if self._unanswered_since is None else max(0.0, now - self._unanswered_since)

    def _gpu(self, pci: str) -> str:
        i = self._index.get(pci)
        return "-" if i is None else str(i)

    def _fault(self, gpu: str, cause: str, fields: dict[str, str], text: str) -> None:
        if (gpu, cause) in self._said or len(self._said) >= MAX_PENDING:
            return
        self._said.add((gpu, cause))
        self._say("gpu_fault", fields, text)
