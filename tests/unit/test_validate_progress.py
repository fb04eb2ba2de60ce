"""``validate``'s progress (issue 39 item 9): a line per step with the time since the run began,
a spinner only on a terminal, and a line at least every QUIET_S elsewhere."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from gce_watchdog.validate import plan as P
from gce_watchdog.validate import run as R
from gce_watchdog.validate.progress import CLEAR, FRAMES, Progress, elapsed
from gce_watchdog.validate.scenarios import SCENARIOS
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@pytest.mark.parametrize(
    ("s", "text"),
    [(0, "0s"), (7.9, "7s"), (60, "1m00s"), (245, "4m05s"), (3723, "1h02m03s"), (-3, "0s")],
)
def test_elapsed_reads_like_a_duration(s: float, text: str) -> None:
    assert elapsed(s) == text


@given(st.floats(0, 10**6), st.floats(0, 10**6))
def test_elapsed_orders_like_the_seconds(a: float, b: float) -> None:
    def back(t: str) -> int:
        n = 0
        for unit, mult in (("h", 3600), ("m", 60), ("s", 1)):
            if unit in t:
                head, t = t.split(unit, 1)
                n += int(head) * mult
        return n

    assert back(elapsed(a)) == int(a) and (back(elapsed(a)) <= back(elapsed(b))) == (
        int(a) <= int(b)
    )


def test_off_a_terminal_only_step_lines() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress(out, clock)
    assert not p.tty
    clock.t += 65
    p.step("creating vm-a")
    p.waiting("vm-a booting")
    p.close()
    assert out.getvalue() == "gce-watchdog validate: [1m05s] creating vm-a\n"


def test_on_a_terminal_a_spinner_between_the_step_lines() -> None:
    out, clock = Tty(), Clock()
    p = Progress(out, clock)
    assert p.tty
    p.waiting("vm-a booting")
    p.waiting("vm-a booting")
    clock.t += 3
    p.step("vm-a: booted")
    p.waiting("vm-a workload")
    p.close()
    text = out.getvalue()
    assert text == (
        f"{CLEAR}{FRAMES[0]} [0s] vm-a booting{CLEAR}{FRAMES[1]} [0s] vm-a booting"
        f"{CLEAR}gce-watchdog validate: [3s] vm-a: booted\n"
        f"{CLEAR}{FRAMES[2]} [3s] vm-a workload{CLEAR}"
    )


def _run(tmp: Path, log: io.StringIO, clock: Clock) -> R.Run:
    plan = P.make_plan(
        "vprog1", "p", "us-central1-a", [SCENARIOS["wedge"]], P.AgentSource(image="img"),
        "#!/bin/bash\n",
    )  # fmt: skip
    return R.Run(plan, None, tmp, clock=clock, sleep=clock.sleep, log=log)  # type: ignore[arg-type]


def test_a_quiet_wait_still_says_what_it_waits_for(tmp_path: Path) -> None:
    log, clock = io.StringIO(), Clock()
    run = _run(tmp_path, log, clock)
    for _ in range(int(R.QUIET_S / 10) - 1):
        run._wait(10.0)
    assert log.getvalue() == ""
    run._wait(10.0)
    assert log.getvalue() == (
        f"gce-watchdog validate: [{elapsed(R.QUIET_S)}] still waiting for: wedge (waiting)\n"
    )


def test_on_a_terminal_the_wait_turns_the_spinner(tmp_path: Path) -> None:
    log, clock = Tty(), Clock()
    run = _run(tmp_path, log, clock)
    run._wait(1.0)
    assert log.getvalue().count(CLEAR) == int(1.0 / R.SPIN_S)
    assert clock.t == 1001.0 and "waiting for: wedge (waiting)" in log.getvalue()


def test_milestones_come_in_the_order_of_a_run(tmp_path: Path) -> None:
    run = _run(tmp_path, io.StringIO(), Clock())
    vm = run.vms[0]
    assert R.milestones(vm) == []
    o = vm.obs
    o.fault_at, o.first_rung_at, o.shutdown_at = 1.0, 2.0, 3.0
    o.decided_at, o.failovers, o.left_running_at, o.final_status = 4.0, 1, 5.0, "gone"
    vm.workload_at, vm.finished, o.verdict = 0.5, True, "self_shutdown"
    keys = [k for k, _ in R.milestones(vm)]
    assert keys == ["workload", "fault", "climb", "shutdown", "decided", "left", "finished"]
    assert R.milestones(vm)[-1][1] == "scenario finished (verdict self_shutdown)"
