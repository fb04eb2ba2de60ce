"""The in-agent monitor: serial lines through MemorySink, a fake clock, fake NVML, scripted host."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from gce_watchdog.memory import GIB
from gce_watchdog.memory.monitor import MemoryMonitor
from gce_watchdog.memory.samplers import GpuSampler, TopProcess
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire.protocol import MAX_LINE, Event
from gce_watchdog.wire.vocab import pack_fields as _pack
from kit import fake_pynvml
from kit.clocks import ManualClock
from kit.events import sink_events


class Host:
    """Scripted host gauges: ``used`` is changed by the test between ticks."""

    def __init__(self, used: float = 8 * GIB) -> None:
        self.used = used

    def __call__(self) -> dict[str, int]:
        return {
            "host_total": 64 * GIB,
            "host_used": int(self.used),
            "host_available": int(64 * GIB - self.used),
            "swap_total": 0,
            "swap_used": 0,
        }


def _top() -> list[TopProcess]:
    return [TopProcess(4242, "python3", 6 * GIB)]


def _cfg(**memory: object) -> cfgmod.Config:
    base: dict[str, object] = {"period": 30.0, "warmup": 60.0, "serial_every": 600.0}
    base.update(memory)
    return cfgmod.replace(cfgmod.Config(), memory=base)


def _monitor(
    tmp_path: Path,
    clock: ManualClock,
    host: Host,
    gpus: list[fake_pynvml.Device] | None,
    **mem: object,
) -> tuple[MemoryMonitor, MemorySink, list[tuple[Sequence[str], Mapping[str, str], float]]]:
    sink = MemorySink()
    em = Emitter(
        sink, SeqAllocator(tmp_path, "deadbeef"), "deadbeef", wall=lambda: 1.8e9, key=SYNTH_KEY
    )
    calls: list[tuple[Sequence[str], Mapping[str, str], float]] = []

    def runner(argv: Sequence[str], env: Mapping[str, str], timeout: float) -> int:
        calls.append((argv, env, timeout))
        return 0

    gpu = (
        GpuSampler(nvml=fake_pynvml.make(gpus))
        if gpus is not None
        else GpuSampler(nvml=fake_pynvml.make(init_error=fake_pynvml.NVMLError_LibraryNotFound()))
    )
    mon = MemoryMonitor.from_config(
        _cfg(**mem), em, clock, host=host, top=_top, gpu=gpu, run_command=runner
    )
    return mon, sink, calls


def _events(sink: MemorySink) -> list[Event]:
    assert all(len(line) <= MAX_LINE for line in sink.lines)
    return sink_events(sink)


def _run(mon: MemoryMonitor, clock: ManualClock, n: int, each: object = None) -> None:
    for i in range(n):
        if callable(each):
            each(i)
        mon.tick()
        clock.advance(30.0)


@pytest.mark.pure
def test_no_gpu_one_line_saying_why_then_flat_host_is_quiet(tmp_path: Path) -> None:
    clock, host = ManualClock(), Host()
    mon, sink, _ = _monitor(tmp_path, clock, host, None)
    mon.open()
    _run(mon, clock, 100)  # 50 min
    ev = _events(sink)
    names = [e.event for e in ev]
    assert names.count("memory_gpu") == 1
    gpu_line = ev[0]
    assert gpu_line.get("st") == "absent"
    assert "NVML Shared Library Not Found" in gpu_line.text
    # 50 minutes at one `mem` line per 10 minutes: 5 lines, nothing else.
    assert names.count("mem") == 5
    assert set(names) == {"memory_gpu", "mem"}
    assert ev[1].get("hu") == "8.00" and ev[1].get("top") == "python3:6.00"
    assert not any(k.startswith("gpu") for k in mon.latest)
    assert mon.verdicts["host"].status == "pass"


@pytest.mark.pure
def test_gpu_climb_then_ok(tmp_path: Path) -> None:
    clock, host = ManualClock(), Host()
    devs = [
        fake_pynvml.Device("NVIDIA L4", 24 * GIB, 2 * GIB),
        fake_pynvml.Device("NVIDIA L4", 24 * GIB, 2 * GIB),
    ]
    mon, sink, calls = _monitor(tmp_path, clock, host, devs)
    mon.open()

    def leak(i: int) -> None:  # gpu1 leaks 0.05 GiB per 30 s sample from the start
        devs[1].used = int(2 * GIB + i * 0.05 * GIB)

    _run(mon, clock, 60, leak)
    ev = _events(sink)
    climbs = [e for e in ev if e.event == "memory_climb"]
    assert len(climbs) == 1  # a transition, not a line per tick
    c = climbs[0]
    assert c.get("g") == "gpu1"
    assert c.get("cap") == "24.00"
    assert float(c.get("slope") or 0) == pytest.approx(0.1, rel=0.05)  # 0.05 GiB / 30 s
    assert int(c.get("eta") or 0) > 0
    assert "gpu1 memory climbing" in c.text
    assert calls == []  # report only by default
    assert mon.latest["gpu1_used"] == devs[1].used
    mem_lines = [e for e in ev if e.event == "mem"]
    assert mem_lines[-1].get("climb") == "gpu1"
    assert mem_lines[0].get("g0") == "2.00"
    # The job restarts: memory drops and holds. Once the climb leaves the 240-sample history,
    # the gauge is back in band.
    devs[1].used = 3 * GIB
    _run(mon, clock, 240)
    oks = [e for e in _events(sink) if e.event == "memory_ok"]
    assert len(oks) == 1
    assert oks[0].get("g") == "gpu1"
    assert oks[0].get("st") in {"unstable", "step", "pass"}


@pytest.mark.pure
def test_warmup_samples_are_not_judged(tmp_path: Path) -> None:
    clock, host = ManualClock(), Host()
    mon, _, _ = _monitor(tmp_path, clock, host, None, warmup=600.0)
    mon.open()
    _run(mon, clock, 20, lambda i: setattr(host, "used", 8 * GIB + i * 0.5 * GIB))  # 10 min
    v = mon.verdicts["host"]
    assert v.status == "not_enough_data"
    assert v.samples == 0


@pytest.mark.pure
def test_host_climb_names_top_process_and_runs_opt_in_command(tmp_path: Path) -> None:
    clock, host = ManualClock(), Host()
    mon, sink, calls = _monitor(
        tmp_path, clock, host, [], on_climb="command", climb_command=["/usr/bin/true", "x"]
    )
    mon.open()
    _run(mon, clock, 50, lambda i: setattr(host, "used", 8 * GIB + i * 0.1 * GIB))
    ev = _events(sink)
    gpu_line = next(e for e in ev if e.event == "memory_gpu")
    assert gpu_line.get("st") == "absent" and "no GPU" in gpu_line.text
    climb = next(e for e in ev if e.event == "memory_climb")
    assert climb.get("g") == "host" and climb.get("top") == "python3:6.00"
    assert len(calls) == 1
    argv, env, timeout = calls[0]
    assert list(argv) == ["/usr/bin/true", "x"]
    assert env["GCEWD_MEM_GAUGE"] == "host"
    assert timeout == 60.0
    act = next(e for e in ev if e.event == "memory_action")
    assert act.get("rc") == "0"


@pytest.mark.pure
def test_lost_gpu_is_one_line_and_recovery_another(tmp_path: Path) -> None:
    clock, host = ManualClock(), Host()
    devs = [fake_pynvml.Device("NVIDIA A100-SXM4-80GB", 80 * GIB, 10 * GIB)]
    mon, sink, _ = _monitor(tmp_path, clock, host, devs)
    mon.open()
    _run(mon, clock, 3)
    devs[0].lost = True
    _run(mon, clock, 10)
    devs[0].lost = False
    _run(mon, clock, 3)
    gpu = [e for e in _events(sink) if e.event == "memory_gpu"]
    assert [e.get("st") for e in gpu] == ["ok", "lost", "ok"]
    assert "GPU is lost" in gpu[1].text


@pytest.mark.pure
def test_mem_lines_split_for_sixteen_gpus(tmp_path: Path) -> None:
    clock, host = ManualClock(), Host()
    devs = [fake_pynvml.Device("NVIDIA A100-SXM4-40GB", 40 * GIB, 39 * GIB) for _ in range(16)]
    mon, sink, _ = _monitor(tmp_path, clock, host, devs)
    mon.open()
    mon.tick()
    mem = [e for e in _events(sink) if e.event == "mem"]
    assert len(mem) >= 2
    keys = [k for e in mem for k, _ in e.fields if k.startswith("g")]
    assert keys == [f"g{i}" for i in range(16)]


@pytest.mark.pure
def test_pack_never_exceeds_line_budget() -> None:
    fields = [(f"g{i}", "123.45") for i in range(64)]
    for line in _pack([("hu", "1.00")], fields):
        assert sum(len(k) + len(str(v)) + 2 for k, v in line) <= MAX_LINE - 60


@pytest.mark.pure
def test_disabled_monitor_does_not_start(tmp_path: Path) -> None:
    clock, host = ManualClock(), Host()
    mon, sink, _ = _monitor(tmp_path, clock, host, None, enabled=False)
    mon.start()
    assert mon.stop(1.0) is True
    assert sink.lines == []


@pytest.mark.process
def test_thread_start_stop_is_bounded(tmp_path: Path) -> None:
    # Real thread, real time, tiny period: poll for the first sample with a deadline.
    host = Host()
    mon, _sink, _ = _monitor(tmp_path, ManualClock(), host, None, period=0.05)
    mon = MemoryMonitor.from_config(
        _cfg(period=0.05), mon.emitter, time.monotonic, host=host, top=_top, gpu=mon._gpu
    )
    mon.start()
    try:
        deadline = time.monotonic() + 5
        while mon.ticks < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mon.ticks >= 3
        assert mon.latest["host_used"] == 8 * GIB
    finally:
        assert mon.stop(2.0) is True
    ticks = mon.ticks
    time.sleep(0.15)
    assert mon.ticks == ticks  # really stopped


@pytest.mark.process
def test_a_failing_reader_does_not_kill_the_thread(tmp_path: Path) -> None:
    n = {"calls": 0}

    def flaky() -> dict[str, int]:
        n["calls"] += 1
        if n["calls"] % 2:
            raise OSError("proc read failed")
        return Host()()

    mon0, _, _ = _monitor(tmp_path, ManualClock(), Host(), None)
    mon = MemoryMonitor.from_config(
        _cfg(period=0.02), mon0.emitter, host=flaky, top=_top, gpu=mon0._gpu
    )
    mon.start()
    try:
        deadline = time.monotonic() + 5
        while (mon.errors < 2 or mon.ticks < 4) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mon.errors >= 2 and mon.ticks >= 4
    finally:
        assert mon.stop(2.0)


@pytest.mark.pure
def test_climb_that_wobbles_is_one_climb_line(tmp_path: Path) -> None:
    from gce_watchdog.memory.detector import ClimbVerdict, Status
    from gce_watchdog.memory.monitor import OK_AFTER

    mon, sink, _ = _monitor(tmp_path, ManualClock(), Host(), None)
    climb = ClimbVerdict(Status.CLIMB, 40, "c", range_bytes=2 * GIB, slope_bytes_per_s=1e6)
    other = ClimbVerdict(Status.UNSTABLE, 40, "u", range_bytes=2 * GIB)
    # climb, then below the significance level for fewer than OK_AFTER periods, then climb again
    for v in [climb, other, other, climb, other] + [other] * OK_AFTER:
        mon._transition("gpu0", v)
    names = [e.event for e in _events(sink)]
    assert names == ["memory_climb", "memory_ok"]
