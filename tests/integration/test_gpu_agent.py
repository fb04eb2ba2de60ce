"""The real agent's GPU watch (gpu/service.py) with the scripted NVML stand-in on PYTHONPATH and a
kernel log it reads as ``/dev/kmsg``: a forged record decides nothing, an Xid confirmed on its GPU
is one ``gpu_fault``, a hung NVML call is one ``gpu_stall`` while the ladder keeps ticking, and
the agent stops at SIGTERM with the probe child stuck."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from gce_watchdog.testing.simgce import SimGCE
from kit.agent import agent_config, agent_process, stop_agent
from kit.events import read_events
from kit.nvml_state import write as write_state
from kit.wait import wait_for

pytestmark = pytest.mark.process

FAKE_DIR = Path(__file__).resolve().parents[1] / "kit" / "nvml_child"
GPU = {"used": 1 << 30, "total": 24 << 30, "remap": [0, 0, 0, 0], "ecc_uncorrected": 0,
       "recovery_action": 0, "procs": [], "util": 0}  # fmt: skip


def _state(path: Path, *, block: bool = False, **per_gpu: dict[str, object]) -> None:
    gpus = [{**GPU, "bus": f"00000000:00:0{4 + i}.0", **per_gpu.get(f"g{i}", {})} for i in range(2)]
    write_state(path, {"block": block, "gpus": gpus})  # the child reads it whole, never half


def _kmsg(path: Path, facility: int, seq: int, message: str) -> None:
    with path.open("a") as f:
        f.write(f"{facility * 8 + 4},{seq},{seq * 1000},-;{message}\n")


def test_the_agent_reads_gpu_faults_and_survives_a_hung_probe(tmp_path: Path) -> None:
    nvml, kmsg = tmp_path / "nvml.json", tmp_path / "kmsg"
    _state(nvml)
    kmsg.write_text("6,1,1,-;Linux version 6.1 (a record from before the agent)\n")
    env = {
        **os.environ,
        "GCEWD_FAKE_NVML": str(nvml),
        "PYTHONPATH": os.pathsep.join([str(FAKE_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    serial = tmp_path / "ttyS0"
    calls = Path(str(nvml) + ".calls")
    with SimGCE() as sim:
        cfg = agent_config(
            tmp_path, sim, gpu={"enabled": "on", "kmsg_path": str(kmsg), "period": 0.2,
                                "probe_timeout": 1.0}, watch={"enabled": False},
        )  # fmt: skip
        with agent_process(cfg, env=env) as p:
            # The child asks for the next sample only once the agent took the last: a second
            # count call means one healthy sample was processed.
            assert wait_for(
                lambda: (
                    calls.exists() and calls.read_text().split().count("nvmlDeviceGetCount") >= 2
                )
            )
            # A forged record (facility 1) of a hardware Xid on a GPU with a second signal ...
            _state(nvml, g0={"remap": [0, 1, 1, 0]}, g1={"lost": True})
            _kmsg(kmsg, 1, 2, "NVRM: Xid (PCI:0000:00:04): 48, pid=1, name=x, DBE")
            # ... then the kernel's own Xid 79 on GPU 1, which NVML reports lost.
            _kmsg(kmsg, 0, 3, "NVRM: Xid (PCI:0000:00:05): 79, pid=7, name=python, fallen off")

            def faults() -> list[dict[str, str]]:
                return [dict(e.fields) for e in read_events(serial) if e.event == "gpu_fault"]

            assert wait_for(lambda: any(f.get("xid") == "79" for f in faults()))
            assert not any(f.get("xid") == "48" for f in faults())
            _state(nvml, block=True)
            assert wait_for(lambda: any(e.event == "gpu_stall" for e in read_events(serial)))
            ticks = sum(e.event in ("tick", "heartbeat") for e in read_events(serial))
            assert wait_for(
                lambda: sum(e.event in ("tick", "heartbeat") for e in read_events(serial)) > ticks
            )  # the ladder goes on while the probe is stuck
            t0 = time.monotonic()
            assert stop_agent(p) == 0
            assert time.monotonic() - t0 < 10.0
    fault = next(f for f in faults() if f.get("xid") == "79")
    assert (fault["pci"], fault["gpu"], fault["sig"]) == ("0000:00:05", "1", "handle_lost")
    assert sum(e.event == "gpu_stall" for e in read_events(serial)) == 1


def test_no_driver_no_gpu_library_and_no_child(tmp_path: Path) -> None:
    with SimGCE() as sim:
        cfg = agent_config(
            tmp_path, sim, gpu={"driver_path": str(tmp_path / "no-driver")},
            memory={"period": 0.2}, watch={"enabled": False},
        )  # fmt: skip
        serial = tmp_path / "ttyS0"
        with agent_process(cfg) as p:
            assert wait_for(lambda: any(e.event == "memory_gpu" for e in read_events(serial)))
            kids = subprocess.run(
                ["ps", "-o", "args=", "--ppid", str(p.pid)], capture_output=True, text=True
            ).stdout
            maps = Path(f"/proc/{p.pid}/maps").read_text()
            assert stop_agent(p) == 0
    assert "probe_child" not in kids
    assert "pynvml" not in maps and "libnvidia-ml" not in maps
    gpu = next(e for e in read_events(serial) if e.event == "memory_gpu")
    assert gpu.get("st") == "absent" and "no NVIDIA driver" in gpu.text
