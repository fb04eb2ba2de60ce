"""A SIGTERM to pytest (what `timeout` sends) runs the fixtures' teardown (kit/sigterm.py): a
server a fixture started must not outlive the run. Checked on a real pytest process: without
the handler its teardown never runs (the control), with it the teardown runs and pytest says
it was interrupted."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from kit.paths import REPO
from kit.procs import running, terminate, wait_alive

pytestmark = pytest.mark.process

CONFTEST = """
import threading
import pytest
{install}

@pytest.fixture
def server(tmp_path_factory):
    yield
    open({done!r}, "w").write("torn down")

def test_runs_until_killed(server):
    open({started!r}, "w").write("started")
    threading.Event().wait(120)  # bounded: the outer test kills it long before
"""


def _run(tmp_path: Path, install: bool) -> tuple[int, bool, str]:
    started, done = tmp_path / "started", tmp_path / "done"
    suite = tmp_path / "suite"
    suite.mkdir()
    code = "from kit import sigterm\nsigterm.install()" if install else ""
    (suite / "test_x.py").write_text(
        CONFTEST.format(install=code, done=str(done), started=str(started))
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)]
    with running(argv, env, cwd=suite) as p:
        wait_alive(p, started.exists, 60, "the inner test never started")
        out, err = terminate(p)
    return p.returncode, done.exists(), (out + err).decode()


def test_sigterm_runs_the_fixtures_teardown(tmp_path: Path) -> None:
    rc, torn_down, out = _run(tmp_path, install=True)
    assert torn_down, out
    assert rc == pytest.ExitCode.INTERRUPTED, (rc, out)


def test_without_the_handler_the_teardown_is_lost(tmp_path: Path) -> None:
    """The control: the default SIGTERM action skips every teardown (why the handler exists)."""
    rc, torn_down, out = _run(tmp_path, install=False)
    assert not torn_down and rc == -signal.SIGTERM, (rc, out)
