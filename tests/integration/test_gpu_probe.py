"""The GPU probe child (gpu/probe_child.py) driven by the agent's side (gpu/probe.py), with the
scripted NVML stand-in (tests/kit/nvml_child/pynvml.py) found on PYTHONPATH as the real one would
be: answers, a hung call (a stall said once, no second child), a stuck child killed on close, and
no GPU library in the agent's own process."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.gpu.probe import GpuProbe, ProbeResult
from kit.nvml_state import write as write_state

pytestmark = pytest.mark.process

FAKE_DIR = Path(__file__).resolve().parents[1] / "kit" / "nvml_child"
GPU = {
    "bus": "00000000:00:04.0",
    "used": 1 << 30,
    "total": 24 << 30,
    "remap": [0, 0, 0, 0],
    "ecc_uncorrected": 0,
    "recovery_action": 0,
    "procs": [],
    "util": 0,
}
EVENT_WAIT_S = 30.0  # a bound on waiting for the child's answer (an event), never a sleep


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    state = tmp_path / "nvml.json"
    write_state(state, {"gpus": [GPU, {**GPU, "bus": "00000000:00:05.0"}]})
    # The child inherits the environment: this is how the real agent's child finds the fake.
    monkeypatch.setenv("GCEWD_FAKE_NVML", str(state))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(FAKE_DIR), os.environ.get("PYTHONPATH", "")])
    )
    yield state


def _answer(probe: GpuProbe, now: float) -> ProbeResult:
    """Poll until the child answers: waits on the child's stdout becoming readable."""
    deadline = time.monotonic() + EVENT_WAIT_S
    while time.monotonic() < deadline:
        r = probe.poll(now)
        if r.sample is not None or r.ended:
            return r
        child = probe._child  # the pipe to wait on; reading stays the probe's
        if child is not None and child.stdout is not None:
            select.select([child.stdout.fileno()], [], [], 1.0)
    raise AssertionError("the probe child never answered")


def _wait_for_call(state: Path, name: str) -> None:
    calls = Path(str(state) + ".calls")
    deadline = time.monotonic() + EVENT_WAIT_S
    while time.monotonic() < deadline:
        if calls.exists() and name in calls.read_text().split():
            return
        time.sleep(0.02)
    raise AssertionError(f"NVML call {name} never made")


def _one_sample() -> dict[str, Any]:
    probe = GpuProbe(timeout=5.0)
    try:
        r = _answer(probe, 0.0)
    finally:
        probe.close()
    assert r.sample is not None
    return r.sample


def test_a_sample_has_every_gpu(nvml: Path) -> None:
    s = _one_sample()
    assert s["count"] == 2
    assert [g["bus"] for g in s["gpus"]] == ["00000000:00:04.0", "00000000:00:05.0"]
    assert s["gpus"][0]["remap"] == [0, 0, 0, 0] and s["gpus"][0]["lost"] is False


def test_the_agents_process_never_imports_a_gpu_library(nvml: Path) -> None:
    code = (
        "import sys, select\n"
        "from gce_watchdog.gpu.probe import GpuProbe\n"
        "p = GpuProbe(timeout=5.0)\n"
        "for _ in range(300):\n"
        "    r = p.poll(0.0)\n"
        "    if r.sample is not None: break\n"
        "    select.select([p._child.stdout], [], [], 0.1)\n"
        "p.close()\n"
        "print(r.sample['count'], 'pynvml' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False"], out.stderr


def test_a_lost_gpu_is_marked_lost(nvml: Path) -> None:
    write_state(nvml, {"gpus": [GPU, {**GPU, "lost": True}]})
    assert [g["lost"] for g in _one_sample()["gpus"]] == [False, True]


def test_a_hung_call_is_one_stall_and_no_second_child(nvml: Path) -> None:
    probe = GpuProbe(timeout=5.0)
    try:
        assert _answer(probe, 0.0).sample is not None
        write_state(nvml, {"block": True, "gpus": [GPU]})
        Path(str(nvml) + ".calls").unlink()
        assert probe.poll(10.0) == ProbeResult()  # request sent at t=10
        _wait_for_call(nvml, "nvmlDeviceGetCount")  # the child is inside NVML, blocked
        assert probe.poll(14.0) == ProbeResult()  # inside its deadline
        stalled = probe.poll(15.5)
        assert stalled.stalled_for == pytest.approx(5.5)
        for t in (16.0, 100.0, 1000.0):
            assert probe.poll(t) == ProbeResult()  # said once; no second child while it lives
        assert probe.children_started == 1
        write_state(nvml, {"block": False, "gpus": [GPU]})
        r = _answer(probe, 1001.0)
        assert r.sample is not None and r.sample["count"] == 1
        assert probe.children_started == 1
    finally:
        probe.close()


def test_close_while_stuck_kills_the_child(nvml: Path) -> None:
    write_state(nvml, {"block": True, "gpus": [GPU]})
    probe = GpuProbe(timeout=1.0)
    probe.poll(0.0)
    _wait_for_call(nvml, "nvmlDeviceGetCount")
    pid = probe.child_pid
    assert pid is not None
    t0 = time.monotonic()
    probe.close()
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped


def test_a_child_gone_before_the_next_request_is_said_exited_with_its_status(nvml: Path) -> None:
    """The flaky run of the test below, made certain: the child that cannot start NVML has
    ended (and is reaped) before the next request is written, so the write finds its input
    closed. What is said is its exit and status, as when the write lands first: a closed input
    is the child ending, not a reason of its own."""
    write_state(nvml, {"init_error": 9, "gpus": []})
    probe = GpuProbe(timeout=5.0, respawn_after=300.0)
    try:
        assert _answer(probe, 0.0).sample is not None
        child = probe._child
        assert child is not None
        child.wait(timeout=EVENT_WAIT_S)  # gone: the next write meets a closed pipe
        ended = _answer(probe, 1.0)
        assert ended.ended.startswith("probe child exited rc="), ended
    finally:
        probe.close()


CLOSES_INPUT = (
    "import os, sys, time\n"
    "sys.stdin.readline()\n"
    "os.close(0)\n"  # its input closed before it answers: closed when the answer is read
    "print('{\"ok\": 1}', flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_child_that_closes_its_input_and_lives_on_is_ended_after_the_timeout() -> None:
    probe = GpuProbe(timeout=5.0, respawn_after=300.0, argv=[sys.executable, "-c", CLOSES_INPUT])
    try:
        assert _answer(probe, 0.0).sample == {"ok": 1}
        pid = probe.child_pid
        assert pid is not None
        assert probe.poll(1.0) == ProbeResult()  # the write fails; it may be ending
        assert probe.poll(5.9) == ProbeResult()  # within the timeout: no verdict yet
        assert probe.poll(6.1) == ProbeResult(ended="probe child closed its input")
        assert probe.child_pid is None
    finally:
        probe.close()


def test_no_nvml_ends_the_child_and_waits_before_the_next(nvml: Path) -> None:
    write_state(nvml, {"init_error": 9, "gpus": []})  # NVML_ERROR_DRIVER_NOT_LOADED
    probe = GpuProbe(timeout=5.0, respawn_after=300.0)
    try:
        r = _answer(probe, 0.0)
        assert r.sample is not None and "NVML init failed" in r.sample["error"]
        ended = _answer(probe, 1.0)
        assert ended.ended.startswith("probe child exited")
        assert probe.poll(2.0) == ProbeResult() and probe.children_started == 1
        assert probe.poll(301.5) == ProbeResult() and probe.children_started == 2
    finally:
        probe.close()
