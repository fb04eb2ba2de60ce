"""``python -m e2e.shards`` (make e2e's runner) on real pytest processes: every shard runs with
its GCEWD_E2E_SHARD, its output is kept and printed, one shard's failure fails the run, an
empty shard beside one that ran does not, and a SIGTERM reaches every shard, whose teardown
runs (tests/kit/sigterm.py) before the runner exits."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from kit.paths import REPO
from kit.procs import running, terminate, wait_alive

pytestmark = pytest.mark.process

CONFTEST = """
import os
import pytest
from kit import sigterm
sigterm.install()

SHARD = os.environ["GCEWD_E2E_SHARD"].replace("/", "-of-")

@pytest.fixture
def server():
    yield
    open(os.path.join({out!r}, "torn-down-" + SHARD), "w").write("torn down")
"""

SUITE = """
import os, threading
from conftest import SHARD

def test_records_its_shard(server):
    open(os.path.join({out!r}, "ran-" + SHARD), "w").write(SHARD)
    {body}
"""


def _suite(tmp_path: Path, body: str = "pass") -> tuple[Path, Path]:
    out = tmp_path / "out"
    suite = tmp_path / "suite"
    out.mkdir()
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST.format(out=str(out)))
    (suite / "test_x.py").write_text(SUITE.format(out=str(out), body=body))
    return suite, out


def _argv(tmp_path: Path, suite: Path, n: int = 2) -> list[str]:
    logs = tmp_path / "logs"
    return [sys.executable, "-m", "e2e.shards", "--logs", str(logs), str(n),
            "-q", "-p", "no:cacheprovider", str(suite)]  # fmt: skip


def _named(out: Path, prefix: str) -> list[str]:
    """The marker files the shards wrote (``ran-I-of-N``, ``torn-down-I-of-N``), sorted."""
    return sorted(f.name for f in out.iterdir() if f.name.startswith(prefix))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GCEWD_E2E", "GCEWD_E2E_SHARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    return env


def test_each_shard_runs_with_its_own_number_and_its_output_is_printed(tmp_path: Path) -> None:
    suite, out = _suite(tmp_path)
    with running(_argv(tmp_path, suite), _env(), cwd=REPO) as p:
        stdout, stderr = p.communicate(timeout=120)
    text = stdout.decode()
    assert p.returncode == 0, text + stderr.decode()
    assert _named(out, "ran-") == ["ran-1-of-2", "ran-2-of-2"]
    for i in (1, 2):
        assert f"===== e2e shard {i}/2: rc=0" in text
        assert (tmp_path / "logs" / f"shard-{i}.log").read_text() in text
    assert text.count("1 passed") == 2
    assert "failed: none" in text


def test_one_failing_shard_fails_the_run_and_says_which(tmp_path: Path) -> None:
    suite, _ = _suite(tmp_path, body='assert SHARD != "2-of-2", "the second shard fails"')
    with running(_argv(tmp_path, suite), _env(), cwd=REPO) as p:
        stdout, _ = p.communicate(timeout=120)
    text = stdout.decode()
    assert p.returncode == 1, text
    assert "failed: {2: 1}" in text
    assert "the second shard fails" in text


ONLY_FIRST = """
import os
from conftest import SHARD

if SHARD == "1-of-2":  # the second shard collects nothing: pytest's rc 5, as a -k may leave it

    def test_records_its_shard(server):
        open(os.path.join({out!r}, "ran-" + SHARD), "w").write(SHARD)
"""


def test_an_empty_shard_beside_one_that_ran_is_not_a_failure(tmp_path: Path) -> None:
    suite, out = _suite(tmp_path)
    (suite / "test_x.py").write_text(ONLY_FIRST.format(out=str(out)))
    with running(_argv(tmp_path, suite), _env(), cwd=REPO) as p:
        stdout, _ = p.communicate(timeout=120)
    text = stdout.decode()
    assert "e2e shard 2/2: rc=5" in text, text
    assert p.returncode == 0, text
    assert _named(out, "ran-") == ["ran-1-of-2"]


def test_a_sigterm_reaches_every_shard_and_their_teardown_runs(tmp_path: Path) -> None:
    suite, out = _suite(tmp_path, body="threading.Event().wait(120)  # until the SIGTERM")
    with running(_argv(tmp_path, suite), _env(), cwd=REPO) as p:
        wait_alive(p, lambda: len(_named(out, "ran-")) == 2, 60, "the shards' tests never started")
        stdout, _ = terminate(p, timeout_s=120)
    text = stdout.decode()
    assert p.returncode == 1, text
    assert _named(out, "torn-down-") == ["torn-down-1-of-2", "torn-down-2-of-2"], text
    assert "rc=2" in text  # pytest's "interrupted", in both shards
