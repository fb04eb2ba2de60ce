"""Are the GPUs released when the job ends? Pure: two NVML samples in, ``ok``/``busy``/``unknown``.

``exec`` takes one sample from the GPU probe child (gpu/probe_child.py) before it starts the job
and one after the job ended; the ``exit`` line says ``idle=ok`` when no process holds a GPU and
every GPU's used memory is back near the first sample, ``idle=busy`` otherwise (a leftover
process keeps the GPU, and the next job on the VM, or the bill, pays), ``idle=unknown`` when a
sample is missing or says nothing. The Slurm epilogue this product grew out of ran the same
check after each job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
# "Near": the driver and a CUDA context that just exited can leave a few hundred MiB for a
# moment; a leftover process holds GiB. The larger of 256 MiB and 2 % of the GPU's memory.
SLACK_BYTES = 256 * MIB
SLACK_FRACTION = 0.02


@dataclass(frozen=True, slots=True)
class Release:
    state: str  # ok, busy, unknown
    why: str


def _gpus(sample: Mapping[str, Any] | None) -> dict[int, Mapping[str, Any]] | None:
    if not sample or "error" in sample or not isinstance(sample.get("gpus"), list):
        return None
    out = {}
    for g in sample["gpus"]:
        if isinstance(g, Mapping) and isinstance(g.get("index"), int):
            out[g["index"]] = g
    return out


def released(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> Release:
    """The GPUs' state after the job, against the sample taken before it."""
    a = _gpus(after)
    if a is None:
        return Release("unknown", "no GPU sample after the job")
    if not a:
        return Release("unknown", "the sample lists no GPU")
    b = _gpus(before) or {}
    busy: list[str] = []
    for i, g in sorted(a.items()):
        procs = g.get("procs")
        if isinstance(procs, list) and procs:
            busy.append(f"gpu{i} held by pid {','.join(str(p) for p in procs[:4])}")
            continue
        used, total = g.get("used"), g.get("total")
        base = b.get(i, {}).get("used")
        if isinstance(used, int) and isinstance(total, int) and isinstance(base, int):
            slack = max(SLACK_BYTES, int(SLACK_FRACTION * total))
            if used > base + slack:
                busy.append(f"gpu{i} {(used - base) // MIB} MiB above its start")
    if busy:
        return Release("busy", "; ".join(busy))
    return Release("ok", f"{len(a)} GPU(s) idle")
