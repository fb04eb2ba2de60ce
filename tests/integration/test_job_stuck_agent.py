"""The real agent's job watch (job/service.py) with a real ``gce-watchdog exec --stuck-after``:
a job that reports steps and then stops itself (SIGSTOP) gets a signed ``progress`` line and one
signed ``job_stuck rule=idle``; a ``job_stuck`` line the job prints itself is defused. Events
are awaited (kit/wait.py), never slept for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gce_watchdog.testing.simgce import SimGCE
from kit.agent import agent_config, agent_process, stop_agent
from kit.cli import gcewd_argv
from kit.events import read_events
from kit.paths import REPO
from kit.wait import wait_for

pytestmark = pytest.mark.process

JOB = textwrap.dedent("""
    import os, signal
    from gce_watchdog import jobprogress as jp
    for step in (1, 2, 3):
        assert jp.progress(step)
    assert not jp.progress(3)
    print("GCEWD3 job_stuck rule=idle step=9 quiet=1 act=end", flush=True)  # forged, defused
    os.kill(os.getpid(), signal.SIGSTOP)
""")


def test_a_job_that_stops_itself_gets_job_stuck_from_the_agent(tmp_path: Path) -> None:
    serial = tmp_path / "ttyS0"
    with SimGCE() as sim:
        cfg = agent_config(
            tmp_path, sim, watch={"enabled": False}, memory={"enabled": False},
            job={"on_stuck": "alert"},  # the chain itself is tested without powering anything off
        )  # fmt: skip
        with agent_process(cfg) as agent:
            assert wait_for(lambda: (tmp_path / "run" / "progress.sock").exists())
            job = subprocess.Popen(
                gcewd_argv("exec", "--config", str(cfg), "--stuck-after", "2s", "--",
                           sys.executable, "-c", JOB),
                cwd=REPO, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:

                def stuck() -> list[dict[str, str]]:
                    return [dict(e.fields) for e in read_events(serial) if e.event == "job_stuck"]

                assert wait_for(lambda: stuck(), timeout=30.0)
                (line,) = stuck()
                assert line["rule"] == "idle" and line["step"] == "3" and line["act"] == "alert"
                assert float(line["quiet"]) >= 2.0
                progress = [dict(e.fields) for e in read_events(serial) if e.event == "progress"]
                assert progress and progress[-1]["step"] == "3"
                rec = json.loads((tmp_path / "run" / "job.json").read_text())
                assert rec["windows"]["after"] == 2.0
                os.kill(rec["pid"], signal.SIGKILL)
                out, _ = job.communicate(timeout=30)
                assert "GCEWd3 job_stuck" in out  # what the job printed is defused
                exits = [dict(e.fields) for e in read_events(serial) if e.event == "exit"]
                assert exits and exits[-1]["sig"] == "SIGKILL"
                assert len(stuck()) == 1  # once per job
            finally:
                if job.poll() is None:
                    job.kill()
                    job.wait()
            assert stop_agent(agent) == 0
