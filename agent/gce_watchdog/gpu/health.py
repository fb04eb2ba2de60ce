"""GPU health from the probe's samples: per-GPU second signals and NVML-only faults. Pure.

A sample is the probe child's JSON answer (gpu/probe_child.py): ``{"count": n, "gpus": [{"index",
"bus", "lost", "remap": [corrected, uncorrected, pending, failure], "ecc_uncorrected",
"recovery_action", ...}]}``. What counts (NVML API reference; GPU-REFERENCES.md):
- a GPU whose calls fail with ``NVML_ERROR_GPU_IS_LOST``, or a device count below the boot's: a
  fault on its own (the GPU is gone);
- ``failureOccurred`` of ``nvmlDeviceGetRemappedRows`` (no spare rows left): a fault;
- a recovery action that needs a reset or a reboot (GPU reset 1, node reboot 2, drain and reset 4,
  bus reset 6, system reboot 7): a fault, the driver itself says the GPU cannot go on;
- a pending remap, uncorrected volatile ECC above the previous sample, the other recovery actions
  (drain P2P 3, recover IMEX domain 5): a second signal for an Xid on the same GPU, never alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gce_watchdog.gpu.episode import SecondSignal

RESET_ACTIONS = frozenset({1, 2, 4, 6, 7})


def pci_key(text: str) -> str:
    """``00000000:00:04.0`` (NVML) and ``0000:00:04`` (the driver's Xid line) as one key:
    ``domain:bus:device`` with a 4-digit domain, lower case; '' when it is not a PCI id."""
    parts = text.strip().lower().split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return ""
    dom, bus, dev = parts[0], parts[1], parts[2].split(".")[0]
    try:
        return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}"
    except ValueError:
        return ""


@dataclass(frozen=True, slots=True)
class GpuFinding:
    """One GPU's state in a sample: a fault NVML shows alone, or a second signal, or neither."""

    index: int
    bus: str  # pci_key form, '' when NVML gave none
    fault: str  # '' or why NVML alone says the GPU is broken
    signal: SecondSignal


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def assess(
    sample: dict[str, Any], boot_count: int | None, prev_ecc: dict[int, int]
) -> list[GpuFinding]:
    """Each GPU's finding, plus one for GPUs missing against the boot's count (index -1)."""
    out: list[GpuFinding] = []
    gpus = sample.get("gpus")
    gpus = gpus if isinstance(gpus, list) else []
    for g in gpus:
        if not isinstance(g, dict):
            continue
        idx = _int(g.get("index"))
        if idx is None:
            continue
        bus = pci_key(str(g.get("bus", "")))
        remap = g.get("remap")
        remap_l = [_int(x) for x in remap] if isinstance(remap, list) and len(remap) == 4 else None
        action = _int(g.get("recovery_action"))
        ecc = _int(g.get("ecc_uncorrected"))
        fault, signal = "", SecondSignal.NONE
        if g.get("lost") is True:
            fault, signal = "lost", SecondSignal.HANDLE_LOST
        elif remap_l is not None and remap_l[3]:
            fault, signal = "remap_failed", SecondSignal.REMAP_FAILED
        elif action is not None and action in RESET_ACTIONS:
            fault, signal = f"recovery_action={action}", SecondSignal.RECOVERY_ACTION
        elif remap_l is not None and remap_l[2]:
            signal = SecondSignal.REMAP_PENDING
        elif ecc is not None and idx in prev_ecc and ecc > prev_ecc[idx]:
            signal = SecondSignal.ECC_RISING
        elif action is not None and action != 0:
            signal = SecondSignal.RECOVERY_ACTION
        out.append(GpuFinding(idx, bus, fault, signal))
    count = _int(sample.get("count"))
    if boot_count is not None and count is not None and count < boot_count:
        out.append(GpuFinding(-1, "", f"count={count}<boot={boot_count}", SecondSignal.HANDLE_LOST))
    return out


def ecc_counts(sample: dict[str, Any]) -> dict[int, int]:
    """Uncorrected volatile ECC per GPU index, for the next sample's comparison."""
    out: dict[int, int] = {}
    gpus = sample.get("gpus")
    for g in gpus if isinstance(gpus, list) else []:
        if isinstance(g, dict):
            idx, ecc = _int(g.get("index")), _int(g.get("ecc_uncorrected"))
            if idx is not None and ecc is not None:
                out[idx] = ecc
    return out
