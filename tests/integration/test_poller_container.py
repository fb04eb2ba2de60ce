"""The container's entry point, without building an image (issue 26): the Dockerfile's
ENTRYPOINT and ENV, run here as they are written there. ``--version`` answers through the
``poll --json`` entry point; with ``GCE_WATCHDOG_SHARED_LEDGER=required`` (the image's ENV) a
poll without a postgresql:// ledger is a usage error (64), whatever the mode."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from gce_watchdog import __version__
from kit.paths import REPO
from kit.ports import free_port

SUB = "projects/test-project/subscriptions/serial"


def image() -> tuple[list[str], dict[str, str]]:
    """The final stage's ENTRYPOINT (argv) and ENV (name -> value) of the Dockerfile."""
    text = (REPO / "Dockerfile").read_text()
    final = text.rsplit("\nFROM ", 1)[1].replace("\\\n", " ")
    m = re.search(r"^ENTRYPOINT (\[.*\])$", final, re.M)
    assert m is not None, "no ENTRYPOINT in the final stage"
    entry = json.loads(m.group(1))
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.*)$", final, re.M):
        for kv in shlex.split(line):
            k, _, v = kv.partition("=")
            env[k] = v
    return entry, env


def run_image(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``docker run IMAGE ARGS...`` without docker: the ENTRYPOINT's program is this tree's
    ``gce-watchdog`` (``python -m gce_watchdog``), under the image's ENV (its PATH and state
    directory replaced by this machine's and a temp dir)."""
    entry, image_env = image()
    assert entry[0] == "gce-watchdog"
    full = {**os.environ, **image_env, "PATH": os.environ["PATH"],
            "XDG_STATE_HOME": str(tmp / "state"), "PYTHONPATH": str(REPO / "agent")}  # fmt: skip
    full.pop("PORT", None)
    full.pop("GCE_WATCHDOG_LEDGER", None)
    full.update(env)
    argv = [sys.executable, "-m", "gce_watchdog", *entry[1:], *args]
    return subprocess.run(argv, capture_output=True, text=True, env=full, timeout=60, check=False)


@pytest.mark.pure
def test_the_image_requires_a_shared_ledger_and_its_entry_point_has_a_version() -> None:
    entry, env = image()
    assert entry == ["gce-watchdog", "poll", "--json"]
    assert env["GCE_WATCHDOG_SHARED_LEDGER"] == "required"


@pytest.mark.process
def test_version_through_the_entry_point(tmp_path: Path) -> None:
    r = run_image(tmp_path, "--version")
    assert (r.returncode, r.stdout) == (0, f"gce-watchdog {__version__}\n"), r.stderr


@pytest.mark.process
@pytest.mark.parametrize(
    "args",
    [
        ("--pubsub", SUB),
        ("--pubsub", SUB, "--ledger", "/var/lib/gce-watchdog/ledger.sqlite"),
        ("--label", "gce-watchdog=on", "--project", "test-project", "--once"),
        ("--project", "test-project", "--zone", "us-central1-a", "vm-1", "--ledger", "l.sqlite"),
    ],
)
def test_without_a_postgresql_ledger_the_image_refuses_to_start(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    r = run_image(tmp_path, *args)
    assert r.returncode == 64, r.stderr
    assert "GCE_WATCHDOG_SHARED_LEDGER=required" in r.stderr and "postgresql://" in r.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was opened


@pytest.mark.process
@pytest.mark.parametrize("where", ["--ledger", "GCE_WATCHDOG_LEDGER"])
def test_with_a_postgresql_ledger_the_image_starts(tmp_path: Path, where: str) -> None:
    """Past the settings: nothing listens on the URL's port, so the ledger cannot be opened
    (74), which is the next step of a start, not a usage error."""
    url = f"postgresql://poller@127.0.0.1:{free_port()}/watchdog?connect_timeout=5"
    (tmp_path / "tok").write_text("tok\n")
    args = ["--label", "gce-watchdog=on", "--project", "test-project", "--once",
            "--access-token-file", str(tmp_path / "tok")]  # fmt: skip
    if where == "--ledger":
        r = run_image(tmp_path, *args, "--ledger", url)
    else:
        r = run_image(tmp_path, *args, GCE_WATCHDOG_LEDGER=url)
    assert r.returncode == 74 and "cannot open the ledger" in r.stderr, r.stderr
    assert "SHARED_LEDGER" not in r.stderr


@pytest.mark.process
def test_one_replica_with_a_durable_volume_opts_out(tmp_path: Path) -> None:
    """GCE_WATCHDOG_SHARED_LEDGER= (empty): a SQLite ledger is accepted again; the run gets
    past the settings and fails on the (unreachable) Compute API instead: 69."""
    (tmp_path / "tok").write_text("tok\n")
    r = run_image(
        tmp_path, "--label", "gce-watchdog=on", "--project", "test-project", "--once",
        "--access-token-file", str(tmp_path / "tok"), "--api-attempts", "1",
        "--api-base", f"http://127.0.0.1:{free_port()}/compute/v1",
        "--ledger", str(tmp_path / "l.sqlite"), GCE_WATCHDOG_SHARED_LEDGER="",
    )  # fmt: skip
    assert r.returncode == 69, r.stderr
    assert (tmp_path / "l.sqlite").exists()
    bogus = run_image(tmp_path, "--pubsub", SUB, GCE_WATCHDOG_SHARED_LEDGER="yes")
    assert bogus.returncode == 64 and "want `required` or empty" in bogus.stderr
