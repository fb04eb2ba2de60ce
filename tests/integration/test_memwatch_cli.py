"""`gce-watchdog memwatch` end to end: real commands, real signals, JSON checked as data."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gce_watchdog.lib.cli import EX_FAIL, EX_NOTFOUND, EX_OK
from gce_watchdog.memory import GIB, MIB
from gce_watchdog.memory.detector import DetectorParams
from gce_watchdog.memory.memwatch import (
    EXIT_NOT_ENOUGH_DATA,
    Run,
    collect,
    judge,
    parse_size,
)
from kit import fake_pynvml
from kit.cli import gcewd
from kit.paths import REPO
from kit.wait import wait_for

# Scaled for seconds: 50 ms samples, 2 warm-up, 30 judged, a 64 MiB band.
FAST = ["--interval", "50ms", "--warmup", "2", "--min-samples", "30", "--band", "64MiB", "--no-gpu"]

_GROW = (
    "import time\n"
    "keep = []\n"
    "for _ in range(50):\n"  # +5 MiB every 50 ms for 2.5 s: 250 MiB
    "    keep.append(bytearray(b'\\x01' * (5 << 20)))\n"
    "    time.sleep(0.05)\n"
)


def _hold(ready: Path, seconds: float) -> str:
    """A child that takes 32 MiB, touches every page in place (no temporary copy: its footprint
    never goes above interpreter + 32 MiB, well under the 64 MiB band), says so by creating
    ``ready``, then holds it for ``seconds``."""
    return (
        "import pathlib, time\n"
        "keep = bytearray(32 << 20)\n"
        "keep[::4096] = b'\\x01' * len(range(0, len(keep), 4096))\n"
        f"pathlib.Path({str(ready)!r}).write_text('ready')\n"
        f"time.sleep({seconds})\n"
    )


def _memwatch(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return gcewd("memwatch", *args, timeout=timeout)


@pytest.mark.process
def test_growing_command_fails_with_a_climb(tmp_path: Path) -> None:
    out = tmp_path / "memory_log.json"
    r = _memwatch(*FAST, "--out", str(out), "--", sys.executable, "-c", _GROW)
    assert r.returncode == EX_FAIL, r.stdout + r.stderr
    assert r.stdout.strip().endswith("FAIL")
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "FAIL"
    tree = doc["gauges"]["tree_rss"]
    assert tree["status"] == "climb" and tree["gated"] is True
    assert tree["slope_gib_per_min"] > 1.0  # ~5.9 GiB/min nominal
    assert doc["gauges"]["host_used"]["gated"] is False
    assert doc["target"]["rc"] == 0
    assert doc["stopped_by"] == "exit"
    assert doc["gpu"] == {"available": False, "reason": "disabled (--no-gpu)", "names": []}
    assert len(doc["samples"]) >= 32
    assert {"t", "host_used", "tree_rss"} <= set(doc["samples"][0])


@pytest.mark.process
def test_steady_command_passes(tmp_path: Path) -> None:
    """memwatch starts the command, so some samples after the warm-up can fall before the child
    is ready. They cannot fail it: the child never holds more than interpreter + 32 MiB and
    never a temporary copy (the old child's bytes literal briefly doubled it to ~64 MiB, over
    the band on a loaded machine), so the range of any samples stays under the 64 MiB band.
    Its ready file proves the 32 MiB were really taken before it held them."""
    out = tmp_path / "m.json"
    ready = tmp_path / "ready"
    r = _memwatch(*FAST, "--out", str(out), "--", sys.executable, "-c", _hold(ready, 2.2))
    assert r.returncode == EX_OK, r.stdout + r.stderr
    assert ready.read_text() == "ready"
    doc = json.loads(out.read_text())
    tree = doc["gauges"]["tree_rss"]
    assert tree["status"] == "pass"
    assert tree["samples_used"] >= 30
    assert tree["range_bytes"] < 64 * MIB
    assert tree["max_bytes"] > 32 * MIB


@pytest.mark.process
def test_short_command_is_not_enough_data() -> None:
    r = _memwatch(*FAST, "--", sys.executable, "-c", "pass")
    assert r.returncode == EXIT_NOT_ENOUGH_DATA, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "NOT ENOUGH DATA"
    assert "rc=0" in r.stdout


@pytest.mark.process
@pytest.mark.parametrize("rc", [1, 3, 7, 42])
def test_a_command_that_exits_non_zero_is_its_own_exit_code_never_pass(
    rc: int, tmp_path: Path
) -> None:
    # A job that fails at once (the gauges have too few samples) and one that runs long enough
    # for flat gauges that would PASS on their own: neither is ever PASS.
    out = tmp_path / "m.json"
    quick = _memwatch(*FAST, "--", sys.executable, "-c", f"import sys; sys.exit({rc})")
    assert quick.returncode == rc, quick.stdout + quick.stderr
    assert quick.stdout.splitlines()[-1] == f"COMMAND FAILED (rc={rc}; memory: NOT ENOUGH DATA)"
    flat = _memwatch(
        *FAST,
        "--warmup",
        "2",
        "--min-samples",
        "10",
        "--out",
        str(out),
        "--",
        sys.executable,
        "-c",
        f"import sys, time; time.sleep(2.5); sys.exit({rc})",
    )
    assert flat.returncode == rc, flat.stdout + flat.stderr
    assert flat.stdout.splitlines()[-1].startswith(f"COMMAND FAILED (rc={rc}; memory: ")
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "COMMAND_FAILED" and doc["target"]["rc"] == rc
    assert doc["memory_verdict"] in ("PASS", "NOT_ENOUGH_DATA")


@pytest.mark.process
def test_missing_command_and_bad_options_are_clear() -> None:
    r = _memwatch("--", "/nonexistent/trainer")
    assert r.returncode == EX_NOTFOUND
    assert "cannot run '/nonexistent/trainer'" in r.stderr
    r = _memwatch("--band", "lots")
    assert r.returncode == 64 and "expected a size like '512MiB'" in r.stderr
    r = _memwatch("--band", "1.5")  # was read as 1.5 bytes
    assert r.returncode == 64 and "a size needs a unit: '1.5' (e.g. 1.5GiB)" in r.stderr
    r = _memwatch("--min-samples", "3")
    assert r.returncode == 64 and "must be an integer >= 10" in r.stderr
    r = _memwatch("--pid", "1", "--", "true")
    assert r.returncode == 64 and "not both" in r.stderr


@pytest.mark.process
def test_sigterm_is_forwarded_to_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "got-term"
    ready = tmp_path / "ready"
    child = (
        "import pathlib, signal, sys, time\n"
        f"def h(s, f): pathlib.Path({str(marker)!r}).write_text('TERM'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, h)\n"
        f"pathlib.Path({str(ready)!r}).write_text('1')\n"
        "time.sleep(30)\n"
    )
    out = tmp_path / "m.json"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gce_watchdog",
            "memwatch",
            *FAST,
            "--out",
            str(out),
            "--",
            sys.executable,
            "-c",
            child,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 15
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists()
        p.send_signal(signal.SIGTERM)
        stdout, _ = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    assert marker.read_text() == "TERM"
    doc = json.loads(out.read_text())
    assert doc["target"]["forwarded_signals"] == ["SIGTERM"]
    assert doc["target"]["rc"] == 0
    assert p.returncode in (EX_OK, EXIT_NOT_ENOUGH_DATA), stdout


@pytest.mark.process
def test_pid_mode_with_duration(tmp_path: Path) -> None:
    """The child says it is ready (its 32 MiB taken) before memwatch starts: every sample, the
    warm-up's included, is of the steady child."""
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", _hold(ready, 60)])
    try:
        assert wait_for(ready.exists, timeout=30), "the child never became ready"
        out = tmp_path / "m.json"
        r = _memwatch(
            *FAST,
            "--min-samples",
            "10",
            "--pid",
            str(child.pid),
            "--duration",
            "1s",
            "--out",
            str(out),
        )
        doc = json.loads(out.read_text())
        assert doc["stopped_by"] == "duration"
        assert doc["target"]["pid"] == child.pid
        assert doc["gauges"]["tree_rss"]["status"] == "pass", r.stdout
        assert r.returncode == EX_OK
    finally:
        child.kill()
        child.wait(5)


@pytest.mark.pure
def test_collect_reads_gpus_through_nvml(tmp_path: Path) -> None:
    devs = [fake_pynvml.Device("NVIDIA H100 80GB HBM3", 80 * GIB, 22 * GIB)]
    nv = fake_pynvml.make(devs)
    run = collect(
        interval=0.01, duration=0.3, pid=None, argv=None, gpu=True, nvml=nv, out=lambda s: None
    )
    assert run.gpu_available and run.gpu_names == ["NVIDIA H100 80GB HBM3"]
    assert all(row["gpu0_used"] == 22 * GIB for row in run.samples)
    assert nv.state.initialized == 0  # nvmlShutdown was called
    overall, per = judge(run, DetectorParams(warmup=0, window=10), ("gpu",))
    assert "gpu0_used" in per and per["gpu0_used"][1] is True
    assert overall in ("PASS", "NOT_ENOUGH_DATA")


def _run_of(series: dict[str, list[float]]) -> Run:
    n = len(next(iter(series.values())))
    rows = [
        {"t": float(i), "host_total": 64.0 * GIB, **{k: v[i] for k, v in series.items()}}
        for i in range(n)
    ]
    return Run(interval=1.0, samples=rows)


@pytest.mark.pure
def test_judge_gates() -> None:
    params = DetectorParams(warmup=0, window=30)
    climb = [20 * GIB + i * 0.1 * GIB for i in range(40)]
    flat = [8.0 * GIB] * 40
    run = _run_of({"host_used": climb, "tree_rss": flat, "gpu0_used": flat, "gpu0_total": flat})
    overall, per = judge(run, params, ("tree", "gpu"))
    assert overall == "PASS"
    assert per["host_used"][0].status == "climb" and per["host_used"][1] is False
    overall, _ = judge(run, params, ("host", "tree", "gpu"))
    assert overall == "FAIL"
    overall, per = judge(_run_of({"host_used": flat[:20]}), params, ("host",))
    assert overall == "NOT_ENOUGH_DATA"
    assert judge(_run_of({"host_used": flat}), params, ("gpu",))[0] == "NOT_ENOUGH_DATA"


@pytest.mark.pure
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("1GiB", GIB),
        ("512MiB", 512 * MIB),
        ("1.5G", int(1.5 * GIB)),
        ("2GB", 2 * 10**9),
        ("4096B", 4096),
        ("64 mib", 64 * MIB),
    ],
)
def test_parse_size(text: str, want: int) -> None:
    assert parse_size(text) == want


@pytest.mark.pure
@pytest.mark.parametrize("text", ["", "1XB", "-1GiB", "0", "GiB", "1 GiB GiB", "4096", "1.5"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


@pytest.mark.process
def test_memwatch_is_registered_and_cheap() -> None:
    # The CLI imports every module at start-up; memwatch must not pull psutil/pynvml at import.
    code = (
        "import sys; import gce_watchdog.memory.cli; "
        "print('psutil' in sys.modules, 'pynvml' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "agent")},
    )
    assert r.stdout.split() == ["False", "False"]
    r = _memwatch("--help")
    assert r.returncode == 0 and "--min-samples" in r.stdout
