"""Samplers: host gauges and process-tree RSS against REAL processes; NVML against the fake module.

No GPU is available where these tests run: the NVML path is exercised only against
``tests/kit/fake_pynvml.py`` (NVML's real function names and return shapes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator

import psutil
import pytest
from gce_watchdog.memory import GIB, MIB
from gce_watchdog.memory.detector import DetectorParams, Status, detect
from gce_watchdog.memory.samplers import GpuSampler, host_gauges, top_processes, tree_rss
from kit import fake_pynvml

# A child that grows by STEP_MIB every 50 ms (touching every page so it is resident), or holds.
_CHILD = r"""
import sys, time
step = int(sys.argv[1]) * (1 << 20)
grow = sys.argv[2] == "grow"
keep = [bytearray(b"\x01" * (32 << 20))]          # 32 MiB resident from the start
print("ready", flush=True)
deadline = time.monotonic() + 20                    # never outlives a broken test
while time.monotonic() < deadline:
    if grow and len(keep) < 120:                    # cap: at most 32 + 119 x step MiB
        keep.append(bytearray(b"\x01" * step))
    time.sleep(0.05)
"""
STEP_MIB = 5


@pytest.fixture
def child_factory() -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(mode: str, parent_of: bool = False) -> subprocess.Popen[bytes]:
        code = _CHILD
        if parent_of:  # a wrapper process whose CHILD does the growing: tests the recursion
            code = (
                "import subprocess, sys\n"
                f"argv = [sys.executable, '-c', {_CHILD!r}, '{STEP_MIB}', '{mode}']\n"
                "p = subprocess.Popen(argv)\n"
                "sys.exit(p.wait())\n"
            )
            p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        else:
            p = subprocess.Popen(
                [sys.executable, "-c", code, str(STEP_MIB), mode], stdout=subprocess.PIPE
            )
        procs.append(p)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == b"ready"
        return p

    yield start
    for p in procs:
        for c in psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []:
            c.kill()
        p.kill()
        p.wait(timeout=10)


def _sample_tree(pid: int, n: int, period: float = 0.05) -> list[tuple[float, float]]:
    # Sampling on a schedule is the code under test's own pace, not a wait for it.
    out: list[tuple[float, float]] = []
    t0 = time.monotonic()
    for i in range(n):
        v = tree_rss(pid)
        assert v is not None
        out.append((time.monotonic() - t0, float(v)))
        nxt = t0 + (i + 1) * period
        time.sleep(max(0.0, nxt - time.monotonic()))
    return out


# Scaled for a few seconds: 5 MiB per 50 ms is ~150 MiB per 30 samples; a 64 MiB band.
SMALL = DetectorParams(warmup=2, window=30, band=64 * MIB)


@pytest.mark.process
def test_growing_child_is_a_climb(child_factory: object) -> None:
    p = child_factory("grow", parent_of=True)  # type: ignore[operator]
    series = _sample_tree(p.pid, 40)
    v = detect(series, SMALL)
    assert v.status is Status.CLIMB, v.reason
    # 5 MiB / 50 ms = 6000 MiB/min; allow for scheduler noise on a shared 2-core machine
    assert 1500 < v.slope_bytes_per_s * 60 / MIB < 9000, v.slope_gib_per_min


@pytest.mark.process
def test_steady_child_is_not_a_climb(child_factory: object) -> None:
    p = child_factory("hold")  # type: ignore[operator]
    series = _sample_tree(p.pid, 40)
    v = detect(series, SMALL)
    assert v.status is Status.PASS, v.reason
    assert v.range_bytes < 4 * MIB
    assert series[-1][1] > 32 * MIB  # the 32 MiB buffer is resident: we measured the right thing


@pytest.mark.process
def test_tree_rss_of_a_gone_process_is_none() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=10)
    assert tree_rss(p.pid) is None


@pytest.mark.pure
def test_host_gauges_are_consistent() -> None:
    g = host_gauges()
    assert 0 < g["host_used"] < g["host_total"]
    assert 0 < g["host_available"] <= g["host_total"]
    assert g["swap_used"] <= g["swap_total"] or g["swap_total"] == 0


@pytest.mark.pure
def test_top_processes_are_sorted_and_include_us() -> None:
    tops = top_processes(n=500)
    assert tops == sorted(tops, key=lambda t: t.rss, reverse=True)
    assert os.getpid() in {t.pid for t in tops}


@pytest.mark.pure
def test_top_processes_agree_with_psutil_on_this_process() -> None:
    """The /proc reader against psutil (a reference someone else wrote) for a process whose
    memory holds still: the same name (as the kernel's comm) and the same resident set."""
    me = psutil.Process()
    tops = {t.pid: t for t in top_processes(n=100_000)}
    mine = tops[os.getpid()]
    assert mine.name == me.name()[:15]
    assert abs(mine.rss - me.memory_info().rss) < 4 * MIB


def _fake_proc(root: str, count: int) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in range(1, count + 1):
        d = os.path.join(root, str(pid))
        os.mkdir(d)
        with open(os.path.join(d, "statm"), "w") as f:
            f.write(f"{pid * 3} {pid} 7 1 0 9 0\n")
        with open(os.path.join(d, "comm"), "w") as f:
            f.write(f"p{pid}\n")
    assert page > 0


@pytest.mark.pure
def test_top_processes_skip_what_is_not_a_process_and_never_block(tmp_path: object) -> None:
    root = str(tmp_path)
    _fake_proc(root, 20)
    page = os.sysconf("SC_PAGE_SIZE")
    os.mkdir(os.path.join(root, "self"))  # not a pid
    fifo = os.path.join(root, "21")  # a FIFO as statm: an error, not a hang
    os.mkdir(fifo)
    os.mkfifo(os.path.join(fifo, "statm"))
    link = os.path.join(root, "22")  # a symlink as statm: not followed
    os.mkdir(link)
    os.symlink(os.path.join(root, "20", "statm"), os.path.join(link, "statm"))
    junk = os.path.join(root, "23")  # unparseable
    os.mkdir(junk)
    with open(os.path.join(junk, "statm"), "w") as f:
        f.write("x")
    os.mkdir(os.path.join(root, "24"))  # gone between listing and reading
    got = top_processes(n=3, proc_root=root)
    assert [(t.pid, t.name, t.rss) for t in got] == [
        (20, "p20", 20 * page),
        (19, "p19", 19 * page),
        (18, "p18", 18 * page),
    ]
    assert top_processes(n=3, proc_root=os.path.join(root, "missing")) == []


@pytest.mark.pure
def test_top_processes_keep_nothing_per_process(tmp_path: object) -> None:
    """Memory does not grow with the number of processes on the VM (issue 38: psutil's cache cost
    about 1.4 KiB of the agent's RSS per process): a pass over 2,000 keeps nothing after it and
    holds at most a few KiB during it."""
    root = str(tmp_path)
    _fake_proc(root, 2000)
    top_processes(n=3, proc_root=root)  # warm: first-call allocations (sysconf, codecs)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        got = top_processes(n=3, proc_root=root)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [t.pid for t in got] == [2000, 1999, 1998]
    assert after - before < 4096, after - before  # the three results, nothing per process
    assert peak - before < 64 * 1024, peak - before


# --- NVML, against the fake module -------------------------------------------------------------


@pytest.mark.pure
def test_nvml_two_gpus() -> None:
    nv = fake_pynvml.make(
        [
            fake_pynvml.Device("NVIDIA A100-SXM4-40GB", 40 * GIB, 22 * GIB),
            fake_pynvml.Device("NVIDIA A100-SXM4-40GB", 40 * GIB, 1 * GIB),
        ]
    )
    s = GpuSampler(nvml=nv)
    assert s.open() is True
    assert s.count == 2
    assert s.names == ["NVIDIA A100-SXM4-40GB"] * 2
    assert s.sample() == {
        "gpu0_used": 22 * GIB,
        "gpu0_total": 40 * GIB,
        "gpu1_used": 1 * GIB,
        "gpu1_total": 40 * GIB,
    }
    nv.state.devices[0].used = 30 * GIB
    assert s.sample()["gpu0_used"] == 30 * GIB
    s.close()
    assert nv.state.shutdown_calls == 1
    assert nv.state.initialized == 0


@pytest.mark.pure
@pytest.mark.parametrize(
    ("err", "want"),
    [
        (
            fake_pynvml.NVMLError_LibraryNotFound(),
            "NVML init failed: NVML Shared Library Not Found",
        ),
        (fake_pynvml.NVMLError_DriverNotLoaded(), "NVML init failed: Driver Not Loaded"),
    ],
)
def test_nvml_init_failure_is_one_reason(err: Exception, want: str) -> None:
    s = GpuSampler(nvml=fake_pynvml.make(init_error=err))  # type: ignore[arg-type]
    assert s.open() is False
    assert s.reason == want
    assert s.sample() == {}


@pytest.mark.pure
def test_nvml_no_device() -> None:
    nv = fake_pynvml.make([])
    s = GpuSampler(nvml=nv)
    assert s.open() is False
    assert s.reason == "NVML loaded but reports no GPU"
    assert nv.state.initialized == 0  # shut down again


@pytest.mark.pure
def test_pynvml_not_installed_is_one_reason() -> None:
    def importer(name: str) -> object:
        raise ModuleNotFoundError(f"No module named {name!r}")

    s = GpuSampler(importer=importer)  # type: ignore[arg-type]
    assert s.open() is False
    assert "nvidia-ml-py not installed" in s.reason


@pytest.mark.pure
def test_lost_gpu_drops_its_gauges_only() -> None:
    nv = fake_pynvml.make(
        [fake_pynvml.Device("g0", 80 * GIB, 10 * GIB), fake_pynvml.Device("g1", 80 * GIB, 5 * GIB)]
    )
    s = GpuSampler(nvml=nv)
    assert s.open()
    nv.state.devices[1].lost = True
    got = s.sample()
    assert set(got) == {"gpu0_used", "gpu0_total"}
    assert s.read_errors == 1
    assert s.last_error == "gpu1: GPU is lost"
