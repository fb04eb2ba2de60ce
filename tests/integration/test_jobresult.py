"""The job's own result (issue 24, item 4): ``gce-watchdog result``, the stdlib helper
``gce_watchdog.jobresult``, and ``exec --expect-result``'s ``result=reported|missing``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gce_watchdog import jobresult
from gce_watchdog.wire import protocol
from kit.cli import main_rc
from kit.events import read_events
from kit.paths import REPO

AGENT = str(Path(sys.executable).parent / "gce-watchdog")


def _config(tmp_path: Path) -> str:
    cfg = tmp_path / "config.toml"
    (tmp_path / "serial.log").touch()
    cfg.write_text(
        f'[agent]\nstate_dir = "{tmp_path}/state"\nrun_dir = "{tmp_path}/run"\n'
        f'[serial]\ndevice = "{tmp_path / "serial.log"}"\n'
        f'fallback_file = "{tmp_path / "fallback.log"}"\n'
    )
    return str(cfg)


def _events(tmp_path: Path) -> list[protocol.Event]:
    # every line is signed by our key
    return read_events(tmp_path / "serial.log", forged_ok=False, rejected_ok=False)


def _exit(tmp_path: Path) -> protocol.Event:
    return next(e for e in reversed(_events(tmp_path)) if e.event == "exit")


@pytest.mark.pure
def test_result_writes_a_signed_line_with_its_detail(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert main_rc(["result", "ok", "--detail", "step=1000", "--detail", "loss=0.31",
                 "--config", cfg]) == 0  # fmt: skip
    (ev,) = _events(tmp_path)
    assert ev.event == "result"
    assert ev.fields_dict == {"status": "ok", "detail": "step:1000,loss:0.31", "bc": "1"}
    assert ev.text == "job result: ok step=1000 loss=0.31"
    assert main_rc(["result", "fail", "--config", cfg]) == 0
    assert _events(tmp_path)[-1].fields_dict == {"status": "fail", "bc": "1"}


@pytest.mark.pure
@pytest.mark.parametrize(
    "argv",
    [["result", "maybe"], ["result", "ok", "--detail", "novalue"], ["result"]],
)
def test_result_usage_errors_write_nothing(tmp_path: Path, argv: list[str]) -> None:
    assert main_rc([*argv, "--config", _config(tmp_path)]) == 64
    assert _events(tmp_path) == []


@pytest.mark.pure
def test_a_long_or_hostile_detail_stays_one_valid_line(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    hostile = "x=" + "GCEWD2 0 0 forged | " * 20 + "\n#\x00"
    assert main_rc(["result", "ok", "--detail", hostile, "--config", cfg]) == 0
    (ev,) = _events(tmp_path)
    assert ev.event == "result" and len(ev.get("detail") or "") <= 64


def _exec(tmp_path: Path, code: str, *flags: str) -> int:
    cfg = _config(tmp_path)
    env = dict(os.environ)
    env["GCEWD_AGENT"] = AGENT  # under pytest, argv[0] is not gce-watchdog
    env["PYTHONPATH"] = str(REPO / "agent")
    p = subprocess.run(
        [AGENT, "exec", *flags, "--config", cfg, "--", sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode


REPORTS = "from gce_watchdog import jobresult; jobresult.report(True, step=7)"


@pytest.mark.process
def test_a_job_that_reports_gets_result_reported(tmp_path: Path) -> None:
    assert _exec(tmp_path, REPORTS, "--expect-result") == 0
    evs = _events(tmp_path)
    names = [e.event for e in evs]
    assert names == ["phase", "result", "exit"]
    assert evs[1].fields_dict == {"status": "ok", "detail": "step:7", "bc": "1"}
    ex = evs[2]
    assert (ex.get("rc"), ex.get("result")) == ("0", "reported")
    assert not list((tmp_path / "run").glob("result.*")), "the run's record is consumed"


@pytest.mark.process
def test_a_job_that_exits_0_without_reporting_gets_result_missing(tmp_path: Path) -> None:
    assert _exec(tmp_path, "print('done, I think')", "--expect-result") == 0
    ex = _exit(tmp_path)
    assert (ex.get("rc"), ex.get("result")) == ("0", "missing")
    assert "without its result" in ex.text


@pytest.mark.process
def test_a_result_outside_this_run_does_not_count(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert main_rc(["result", "ok", "--config", cfg]) == 0  # before exec, no run of its own
    assert _exec(tmp_path, "pass", "--expect-result") == 0
    assert _exit(tmp_path).get("result") == "missing"


@pytest.mark.process
def test_without_expect_result_the_exit_line_has_no_result_field(tmp_path: Path) -> None:
    assert _exec(tmp_path, REPORTS) == 0
    ex = _exit(tmp_path)
    assert ex.get("result") is None and ex.get("rc") == "0"


@pytest.mark.process
def test_the_helper_fails_loudly_when_the_line_cannot_be_written(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["GCEWD_AGENT"] = str(tmp_path / "no-such-gce-watchdog")
    helper = REPO / "agent" / "gce_watchdog" / "jobresult.py"
    p = subprocess.run(
        [sys.executable, str(helper), "fail", "--detail", "step=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 74 and "no-such-gce-watchdog" in p.stderr
    assert subprocess.run([sys.executable, str(helper), "perhaps"], timeout=60).returncode == 64
    assert jobresult.command(True, a=1)[1:] == ["result", "ok", "--detail", "a=1"]


@pytest.mark.pure
def test_the_helper_imports_nothing_but_the_standard_library() -> None:
    src = (REPO / "agent" / "gce_watchdog" / "jobresult.py").read_text()
    imports = {
        line.split()[1].split(".")[0]
        for line in src.splitlines()
        if line.startswith(("import ", "from "))
    }
    assert imports <= {"__future__", "os", "shutil", "subprocess", "sys"}, imports
