"""``exec`` checks that the job released the GPUs (issue 37, item 3): one NVML sample through
the probe child before the job and one after it, the scripted NVML stand-in
(tests/kit/nvml_child/pynvml.py, checked against the real pynvml in test_gpu_health.py) on
PYTHONPATH. A leftover GPU process gives ``exit ... idle=busy``; a clean job ``idle=ok``; no
GPU watch (no driver) gives no ``idle`` field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kit.cli import gcewd_argv
from kit.events import read_events
from kit.paths import REPO

pytestmark = pytest.mark.process

FAKE_DIR = Path(__file__).resolve().parents[1] / "kit" / "nvml_child"
GPU = {"bus": "00000000:00:04.0", "used": 1 << 29, "total": 80 << 30, "remap": [0, 0, 0, 0],
       "ecc_uncorrected": 0, "recovery_action": 0, "procs": [], "util": 0}  # fmt: skip

# The job: leaves a GPU process behind (as a daemonised data-loader worker would) or not.
JOB = textwrap.dedent("""
    import json, os, sys
    path = os.environ["GCEWD_FAKE_NVML"]
    state = json.load(open(path))
    if sys.argv[1] == "leak":
        state["gpus"][0]["procs"] = [4242]
        state["gpus"][0]["used"] = 30 << 30
    tmp = path + ".tmp"
    json.dump(state, open(tmp, "w"))
    os.replace(tmp, path)
""")


def _exec(tmp: Path, mode: str, gpu: str) -> dict[str, str]:
    nvml = tmp / "nvml.json"
    nvml.write_text(json.dumps({"block": False, "gpus": [GPU]}))
    (tmp / "ttyS0").touch()
    cfg = tmp / "config.toml"
    cfg.write_text(
        f'[agent]\nstate_dir = "{tmp}/state"\nrun_dir = "{tmp}/run"\n'
        f'[serial]\ndevice = "{tmp}/ttyS0"\nfallback_file = "{tmp}/fallback.log"\n'
        f'[gpu]\nenabled = "{gpu}"\nprobe_timeout = "20s"\n'
    )
    env = {
        **os.environ,
        "GCEWD_FAKE_NVML": str(nvml),
        "PYTHONPATH": os.pathsep.join([str(FAKE_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        gcewd_argv("exec", "--config", str(cfg), "--", sys.executable, "-c", JOB, mode),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (exit_line,) = [e for e in read_events(tmp / "ttyS0") if e.event == "exit"]
    return {**dict(exit_line.fields), "text": exit_line.text}


@pytest.mark.parametrize(("mode", "idle"), [("leak", "busy"), ("clean", "ok")])
def test_the_exit_line_says_whether_the_gpus_were_released(
    tmp_path: Path, mode: str, idle: str
) -> None:
    line = _exec(tmp_path, mode, "on")
    assert line["idle"] == idle
    if idle == "busy":
        assert "gpu0 held by pid 4242" in line["text"]


def test_no_gpu_watch_no_idle_field(tmp_path: Path) -> None:
    line = _exec(tmp_path, "leak", "off")
    assert "idle" not in line and line["rc"] == "0"
