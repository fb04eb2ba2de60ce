"""A hand-written stand-in for ``pynvml`` (package nvidia-ml-py): the only fake in memwatch tests.

It keeps NVML's real names and return shapes: ``nvmlInit``/``nvmlShutdown``, ``nvmlDeviceGetCount``
(int), ``nvmlDeviceGetHandleByIndex`` (an opaque handle), ``nvmlDeviceGetName`` (str in current
releases), ``nvmlDeviceGetMemoryInfo`` (an object with ``.total``, ``.free``, ``.used`` in bytes,
like ``c_nvmlMemory_t``), and ``NVMLError`` carrying ``.value``, a ``NVML_ERROR_*`` code, with
subclasses such as ``NVMLError_LibraryNotFound``. Build one with :func:`make` and pass the module
object to ``GpuSampler(nvml=...)``; tests change its state directly, no patching.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15

_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _TEXT.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_LIBRARY_NOT_FOUND)


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_DRIVER_NOT_LOADED)


class NVMLError_GpuIsLost(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_GPU_IS_LOST)


@dataclass
class c_nvmlMemory_t:
    total: int
    free: int
    used: int


@dataclass
class Device:
    name: str
    total: int
    used: int
    lost: bool = False  # reads raise NVMLError_GpuIsLost (Xid 79, "fallen off the bus")


@dataclass
class _State:
    devices: list[Device] = field(default_factory=list)
    init_error: NVMLError | None = None
    initialized: int = 0
    init_calls: int = 0
    shutdown_calls: int = 0


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index


def make(
    devices: list[Device] | None = None, init_error: NVMLError | None = None
) -> types.ModuleType:
    """A fresh fake ``pynvml`` module; ``mod.state`` holds its devices and call counts."""
    mod = types.ModuleType("pynvml")
    state = _State(list(devices or []), init_error)

    def _need_init() -> None:
        if state.initialized <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _dev(handle: object) -> Device:
        _need_init()
        if not isinstance(handle, _Handle) or handle.index >= len(state.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        d = state.devices[handle.index]
        if d.lost:
            raise NVMLError_GpuIsLost()
        return d

    def nvmlInit() -> None:
        state.init_calls += 1
        if state.init_error is not None:
            raise state.init_error
        state.initialized += 1  # NVML reference-counts init/shutdown

    def nvmlShutdown() -> None:
        _need_init()
        state.shutdown_calls += 1
        state.initialized -= 1

    def nvmlDeviceGetCount() -> int:
        _need_init()
        return len(state.devices)

    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        _need_init()
        if not 0 <= index < len(state.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetName(handle: object) -> str:
        return _dev(handle).name

    def nvmlDeviceGetMemoryInfo(handle: object) -> c_nvmlMemory_t:
        d = _dev(handle)
        return c_nvmlMemory_t(total=d.total, free=d.total - d.used, used=d.used)

    for name, value in dict(locals()).items():
        if name.startswith("nvml"):
            setattr(mod, name, value)
    for name, value in globals().items():
        if name.startswith(("NVML", "c_nvml")):
            setattr(mod, name, value)
    mod.state = state  # type: ignore[attr-defined]
    return mod
