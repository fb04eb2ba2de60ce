"""A scripted stand-in for ``pynvml`` (nvidia-ml-py) for the GPU probe child (gpu/probe_child.py).

Put this directory on ``PYTHONPATH`` (the child inherits the agent's environment) and name a JSON
state file in ``GCEWD_FAKE_NVML``; every call reads the file again, so a test changes the GPUs
by rewriting it (no patching). State: ``{"init_error": code|null, "block": bool, "gpus": [{"bus":
"00000000:00:04.0", "used": int, "total": int, "lost": bool, "remap": [c, u, pending, failure],
"ecc_uncorrected": int, "recovery_action": int, "procs": [pid, ...], "util": int}]}``.
``"block": true`` makes every call after ``nvmlInit`` block (the hang seen after GPU faults) until
the file says otherwise; each call appends its name to ``<state>.calls`` so tests wait on events.

Names, constants and return shapes follow nvidia-ml-py's ``pynvml`` and the NVML API reference
(tests/unit/test_gpu_probe.py checks each name and constant used here against the real module):
``NVMLError.value`` holds an ``NVML_ERROR_*`` code (GPU_IS_LOST 15, NOT_SUPPORTED 3),
``nvmlDeviceGetRemappedRows`` returns ``(corrRows, uncRows, isPending, failureOccurred)``,
``nvmlDeviceGetFieldValues`` returns ``c_nvmlFieldValue_t`` items with ``nvmlReturn`` and
``value.uiVal``, ``nvmlDeviceGetComputeRunningProcesses`` items with ``.pid``.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
# A blocked call gives up after this long so a forgotten test child cannot live forever.
BLOCK_LIMIT_S = 600.0


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"NVML error {self.value}"


def _path() -> str:
    return os.environ["GCEWD_FAKE_NVML"]


def _state() -> dict[str, Any]:
    with open(_path()) as f:
        state: dict[str, Any] = json.load(f)
    return state


def _call(name: str) -> dict[str, Any]:
    with open(_path() + ".calls", "a") as f:
        f.write(name + "\n")
    state = _state()
    deadline = time.monotonic() + BLOCK_LIMIT_S
    while state.get("block") and time.monotonic() < deadline:
        time.sleep(0.05)
        state = _state()
    return state


def _gpu(handle: int, name: str) -> dict[str, Any]:
    gpus = _call(name).get("gpus", [])
    if handle >= len(gpus):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    g: dict[str, Any] = gpus[handle]
    if g.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return g


def nvmlInit() -> None:
    code = _state().get("init_error")
    if code is not None:
        raise NVMLError(int(code))


def nvmlShutdown() -> None:
    return None


def nvmlDeviceGetCount() -> int:
    return len(_call("nvmlDeviceGetCount").get("gpus", []))


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    _call("nvmlDeviceGetHandleByIndex")
    return index


def nvmlDeviceGetPciInfo(handle: int) -> Any:
    return SimpleNamespace(busId=_gpu(handle, "nvmlDeviceGetPciInfo")["bus"].encode())


def nvmlDeviceGetMemoryInfo(handle: int) -> Any:
    g = _gpu(handle, "nvmlDeviceGetMemoryInfo")
    return SimpleNamespace(total=g["total"], used=g["used"], free=g["total"] - g["used"])


def nvmlDeviceGetRemappedRows(handle: int) -> tuple[int, int, int, int]:
    r = _gpu(handle, "nvmlDeviceGetRemappedRows").get("remap")
    if r is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return (int(r[0]), int(r[1]), int(r[2]), int(r[3]))


def nvmlDeviceGetTotalEccErrors(handle: int, error_type: int, counter_type: int) -> int:
    g = _gpu(handle, "nvmlDeviceGetTotalEccErrors")
    assert (error_type, counter_type) == (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
    if g.get("ecc_uncorrected") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return int(g["ecc_uncorrected"])


def nvmlDeviceGetFieldValues(handle: int, field_ids: list[int]) -> list[Any]:
    g = _gpu(handle, "nvmlDeviceGetFieldValues")
    assert field_ids == [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
    action = g.get("recovery_action")
    ret = 0 if action is not None else NVML_ERROR_NOT_SUPPORTED
    return [SimpleNamespace(nvmlReturn=ret, value=SimpleNamespace(uiVal=action or 0))]


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[Any]:
    g = _gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
    return [SimpleNamespace(pid=p, usedGpuMemory=0) for p in g.get("procs", [])]


def nvmlDeviceGetUtilizationRates(handle: int) -> Any:
    g = _gpu(handle, "nvmlDeviceGetUtilizationRates")
    return SimpleNamespace(gpu=g.get("util", 0), memory=0)
