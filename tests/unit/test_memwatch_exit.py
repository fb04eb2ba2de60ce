"""memwatch's exit status: a command's own non-zero exit is memwatch's, never PASS (pure: the
verdict and the exit code from a collected run)."""

from __future__ import annotations

import pytest
from gce_watchdog.memory.detector import DetectorParams
from gce_watchdog.memory.memwatch import Run, exit_code, judge, memory_verdict

pytestmark = pytest.mark.pure


def _flat_run(rc: int | None, signal_name: str | None = None) -> Run:
    rows = [
        {"t": i * 1.0, "host_used": 4.0 * 2**30, "host_total": 64.0 * 2**30, "tree_rss": 2.0**30}
        for i in range(60)
    ]
    return Run(interval=1.0, samples=rows, rc=rc, signal_name=signal_name, stopped_by="exit")


@pytest.mark.parametrize("rc", [0, 1, 2, 3, 64, 127, 255])
def test_the_exit_code_is_the_commands_own_when_it_failed(rc: int) -> None:
    params = DetectorParams(warmup=5, window=30, band=2.0**30, alpha=0.01)
    run = _flat_run(rc)
    overall, _ = judge(run, params, ["tree"])
    assert memory_verdict(run, judge(run, params, ["tree"])[1]) == "PASS"  # flat gauges ...
    if rc == 0:
        assert (overall, exit_code(run, overall)) == ("PASS", 0)
    else:  # ... never make a failed job pass
        assert (overall, exit_code(run, overall)) == ("COMMAND_FAILED", rc)


def test_a_pid_or_a_signal_has_no_exit_status_to_pass_on() -> None:
    params = DetectorParams(warmup=5, window=30, band=2.0**30, alpha=0.01)
    run = _flat_run(None)  # --pid: memwatch cannot read a non-child's status
    assert exit_code(run, judge(run, params, ["tree"])[0]) == 0
    killed = _flat_run(None, "SIGKILL")
    overall, _ = judge(killed, params, ["tree"])
    assert (overall, exit_code(killed, overall)) == ("FAIL", 1)
