"""GPU findings from probe samples (gpu/health.py, pure), and the NVML fakes checked against the
real ``pynvml`` (nvidia-ml-py, the reference both fakes model)."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gce_watchdog.gpu import health, probe_child
from gce_watchdog.gpu.episode import SecondSignal
from gce_watchdog.gpu.health import GpuFinding
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

FAKE = Path(__file__).resolve().parents[1] / "kit" / "nvml_child" / "pynvml.py"


def _fake() -> Any:
    spec = importlib.util.spec_from_file_location("fake_child_pynvml", FAKE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "name",
    [
        "NVML_ERROR_NOT_SUPPORTED",
        "NVML_ERROR_GPU_IS_LOST",
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
        "NVML_VOLATILE_ECC",
        "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
    ],
)
def test_constants_match_the_real_pynvml(name: str) -> None:
    assert getattr(probe_child, name) == getattr(pynvml, name)
    assert getattr(_fake(), name) == getattr(pynvml, name)


def test_every_nvml_function_the_fake_models_exists_with_its_arity() -> None:
    fake = _fake()
    for name, fn in inspect.getmembers(fake, inspect.isfunction):
        if not name.startswith("nvml"):
            continue
        real = inspect.signature(getattr(pynvml, name)).parameters.values()
        required = [p for p in real if p.default is inspect.Parameter.empty]
        assert len(inspect.signature(fn).parameters) == len(required), name
    source = Path(probe_child.__file__).read_text()
    for name, _ in inspect.getmembers(fake, inspect.isfunction):
        if name.startswith("nvml") and name not in ("nvmlShutdown",):
            assert f"nv.{name}(" in source, f"the fake models {name} but the child never calls it"


def test_recovery_action_reset_values_match_the_real_enum() -> None:
    resets = {
        pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
        pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
        pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET,
        pynvml.NVML_GPU_RECOVERY_ACTION_BUS_RESET,
        pynvml.NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT,
    }
    assert resets == health.RESET_ACTIONS
    assert pynvml.NVML_GPU_RECOVERY_ACTION_NONE == 0


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("00000000:00:04.0", "0000:00:04"),
        ("0000:00:04", "0000:00:04"),
        ("0000:CB:00", "0000:cb:00"),
        ("03:00", "0000:03:00"),
        ("", ""),
        ("zz:00:00", ""),
        ("1:2:3:4", ""),
    ],
)
def test_pci_key_joins_nvml_and_driver_forms(text: str, key: str) -> None:
    assert health.pci_key(text) == key


def _gpu(i: int, **kw: Any) -> dict[str, Any]:
    return {
        "index": i,
        "bus": f"00000000:00:0{4 + i}.0",
        "lost": False,
        "remap": [0, 0, 0, 0],
        "ecc_uncorrected": 0,
        "recovery_action": 0,
        **kw,
    }


@pytest.mark.parametrize(
    ("kw", "fault", "signal"),
    [
        ({}, "", SecondSignal.NONE),
        ({"lost": True}, "lost", SecondSignal.HANDLE_LOST),
        ({"remap": [0, 1, 0, 1]}, "remap_failed", SecondSignal.REMAP_FAILED),
        ({"remap": [0, 1, 1, 0]}, "", SecondSignal.REMAP_PENDING),
        ({"recovery_action": 1}, "recovery_action=1", SecondSignal.RECOVERY_ACTION),
        ({"recovery_action": 3}, "", SecondSignal.RECOVERY_ACTION),
        ({"ecc_uncorrected": 5}, "", SecondSignal.ECC_RISING),
        ({"remap": None, "recovery_action": None, "ecc_uncorrected": None}, "", SecondSignal.NONE),
    ],
)
def test_assess_one_gpu(kw: dict[str, Any], fault: str, signal: SecondSignal) -> None:
    got = health.assess({"count": 1, "gpus": [_gpu(0, **kw)]}, 1, {0: 2})
    assert got == [GpuFinding(0, "0000:00:04", fault, signal)]


def test_a_gpu_fewer_than_at_boot_is_a_fault() -> None:
    got = health.assess({"count": 7, "gpus": [_gpu(i) for i in range(7)]}, 8, {})
    assert got[-1] == GpuFinding(-1, "", "count=7<boot=8", SecondSignal.HANDLE_LOST)
    assert all(f.fault == "" for f in got[:-1])


def test_ecc_is_rising_only_against_a_previous_sample() -> None:
    s = {"count": 1, "gpus": [_gpu(0, ecc_uncorrected=5)]}
    assert health.assess(s, 1, {})[0].signal is SecondSignal.NONE
    assert health.assess(s, 1, {0: 5})[0].signal is SecondSignal.NONE
    assert health.ecc_counts(s) == {0: 5}


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)


@given(
    st.dictionaries(
        st.sampled_from(["count", "gpus", "x"]),
        _json
        | st.lists(
            st.dictionaries(
                st.sampled_from(
                    ["index", "bus", "lost", "remap", "ecc_uncorrected", "recovery_action"]
                ),
                _json,
            ),
            max_size=3,
        ),
    ),
    st.none() | st.integers(0, 8),
)
def test_assess_never_raises_on_any_answer(sample: dict[str, Any], boot: int | None) -> None:
    for f in health.assess(sample, boot, {}):
        assert isinstance(f.fault, str) and isinstance(f.signal, SecondSignal)
    health.ecc_counts(sample)
