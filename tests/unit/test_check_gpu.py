"""``gce-watchdog check`` says whether GPU memory gauges are available, and why not (issue 27):
the same :class:`GpuSampler` memwatch and the agent use, with the hand-written NVML fake
(tests/kit/fake_pynvml.py). The installed package's real nvidia-ml-py on a machine with no driver:
tests/root/test_deb_releases.py."""

from __future__ import annotations

import types

import pytest
from gce_watchdog.daemon.app import gpu_line
from gce_watchdog.memory.samplers import GpuSampler
from kit import fake_pynvml

pytestmark = pytest.mark.pure

GIB = 1 << 30


def test_gpu_present_names_the_devices() -> None:
    nv = fake_pynvml.make([fake_pynvml.Device("NVIDIA L4", 24 * GIB, 2 * GIB)])
    present, why = gpu_line(GpuSampler(nvml=nv))
    assert present and why == "1 GPU(s) via NVML (NVIDIA L4)"
    assert nv.state.shutdown_calls == 1, "check closes NVML again"


def test_no_driver_is_no_gpu_with_nvml_reason() -> None:
    nv = fake_pynvml.make(init_error=fake_pynvml.NVMLError_LibraryNotFound())
    present, why = gpu_line(GpuSampler(nvml=nv))
    assert not present and why == "NVML init failed: NVML Shared Library Not Found"


def test_package_missing_is_no_gpu_with_reason() -> None:
    def importer(name: str) -> types.ModuleType:
        raise ImportError(name)

    present, why = gpu_line(GpuSampler(importer=importer))
    assert not present and "nvidia-ml-py not installed" in why
