"""The GPU probe child: NVML calls run here, never in the agent (``python -m`` this module).

NVML and ``nvidia-smi`` have been seen stuck in uninterruptible sleep after GPU faults
(gpu-monitoring-tools issue 46; gpud and NVSentinel moved their probes behind deadlines), and a
thread in that state cannot be killed. So the agent runs this child, asks for one sample at a
time over stdin (one line per request) and reads one JSON line per answer on stdout, with a
deadline on its side (gpu/probe.py). The child holds no key and returns numbers only.

NVML calls used (NVML API reference; nvidia-ml-py's ``pynvml`` names): ``nvmlInit``,
``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetPciInfo`` (``busId``),
``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetRemappedRows`` -> (corrected, uncorrected, pending,
failure), ``nvmlDeviceGetTotalEccErrors(h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
NVML_VOLATILE_ECC=0)``, ``nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=230])``
(``value.uiVal``: 0 None, 1 GPU reset, 2 node reboot, ...), ``nvmlDeviceGetComputeRunningProcesses``
(``.pid``), ``nvmlDeviceGetUtilizationRates`` (``.gpu``). A call that fails with
``NVML_ERROR_GPU_IS_LOST`` (15) marks the GPU lost; ``NOT_SUPPORTED`` (3) leaves the field null.
"""

from __future__ import annotations

import json
import sys
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230


def _code(e: BaseException) -> int:
    value = getattr(e, "value", None)
    return value if isinstance(value, int) else -1


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _field(nv: Any, h: Any, gpu: dict[str, Any], name: str, call: Any) -> None:
    """Run one NVML call for ``gpu[name]``; a lost GPU marks ``lost``; unsupported stays None."""
    try:
        gpu[name] = call(nv, h)
    except Exception as e:  # NVMLError subclasses; anything else is a broken library: say so
        code = _code(e)
        if code == NVML_ERROR_GPU_IS_LOST:
            gpu["lost"] = True
        elif code != NVML_ERROR_NOT_SUPPORTED:
            gpu.setdefault("errors", []).append(f"{name}: {_text(e)[:80]}")


def _recovery(nv: Any, h: Any) -> int | None:
    vals = nv.nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    v = vals[0]
    if int(getattr(v, "nvmlReturn", 0)) != 0:
        return None
    return int(v.value.uiVal)


def sample(nv: Any) -> dict[str, Any]:
    """One sample of every GPU as plain JSON values."""
    count = int(nv.nvmlDeviceGetCount())
    gpus: list[dict[str, Any]] = []
    for i in range(count):
        gpu: dict[str, Any] = {"index": i, "lost": False}
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
        except Exception as e:
            gpu["lost"] = _code(e) == NVML_ERROR_GPU_IS_LOST
            gpu["errors"] = [f"handle: {_text(e)[:80]}"]
            gpus.append(gpu)
            continue
        _field(nv, h, gpu, "bus", lambda nv, h: _text(nv.nvmlDeviceGetPciInfo(h).busId))
        _field(nv, h, gpu, "used", lambda nv, h: int(nv.nvmlDeviceGetMemoryInfo(h).used))
        _field(nv, h, gpu, "total", lambda nv, h: int(nv.nvmlDeviceGetMemoryInfo(h).total))
        _field(nv, h, gpu, "remap", lambda nv, h: [int(x) for x in nv.nvmlDeviceGetRemappedRows(h)])
        _field(
            nv,
            h,
            gpu,
            "ecc_uncorrected",
            lambda nv, h: int(
                nv.nvmlDeviceGetTotalEccErrors(
                    h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC
                )
            ),
        )
        _field(nv, h, gpu, "recovery_action", _recovery)
        _field(
            nv,
            h,
            gpu,
            "procs",
            lambda nv, h: sorted(int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)),
        )
        _field(nv, h, gpu, "util", lambda nv, h: int(nv.nvmlDeviceGetUtilizationRates(h).gpu))
        gpus.append(gpu)
    return {"count": count, "gpus": gpus}


def main() -> int:
    try:
        import pynvml as nv  # the only place a GPU library is imported
    except ImportError as e:
        print(json.dumps({"error": f"nvidia-ml-py not importable: {e}"}), flush=True)
        return 0
    try:
        nv.nvmlInit()
    except Exception as e:
        print(
            json.dumps({"error": f"NVML init failed: {_text(e)[:120]}", "code": _code(e)}),
            flush=True,
        )
        return 0
    for _request in sys.stdin:
        try:
            answer = sample(nv)
        except Exception as e:
            answer = {"error": f"NVML sample failed: {_text(e)[:120]}", "code": _code(e)}
        print(json.dumps(answer, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
