"""The one way a command opens the console (vm/runtime.open_console): write says whether the line
was written."""

from __future__ import annotations

from pathlib import Path

import pytest
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.runtime import open_console
from gce_watchdog.wire import protocol, vocab

pytestmark = pytest.mark.pure


def _cfg(tmp_path: Path, device: str, fallback: str) -> cfgmod.Config:
    return cfgmod.from_dict(
        {
            "agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run")},
            "serial": {"device": device, "fallback_file": fallback},
        }
    )


def test_write_reports_a_line_written_to_the_fallback_file(tmp_path: Path) -> None:
    fallback = tmp_path / "fallback.log"
    cfg = _cfg(tmp_path, str(tmp_path / "no-such-tty"), str(fallback))
    with open_console(cfg) as con:
        assert con.available
        assert con.write(vocab.PHASE, {"ph": "workload"}, "started") is True
    events, _ = protocol.decode_all(fallback.read_bytes())
    want = [("key", None), ("key", None), ("phase", "workload")]  # v3: two announcements
    assert [(e.event, e.get("ph")) for e in events] == want


def test_write_reports_a_line_that_went_nowhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a path below a regular file can be neither opened nor created
    cfg = _cfg(tmp_path, str(blocker / "tty"), str(blocker / "fallback.log"))
    con = open_console(cfg, prog="gce-watchdog test")
    try:
        assert not con.available
        assert con.write(vocab.PHASE, {"ph": "done"}) is False
    finally:
        con.close()
    err = capsys.readouterr().err
    assert err.startswith("gce-watchdog test: cannot open") and "lines are not written" in err
