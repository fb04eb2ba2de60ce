"""Journal priorities: every line the agent logs carries its syslog priority as an sd-daemon
``<N>`` prefix when its stream is the journal's, and none on a terminal or pipe."""

from __future__ import annotations

import io
import os
import re
import signal
import time
from pathlib import Path

import pytest
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.vm import logs
from kit.agent import agent_config, agent_process, stop_agent
from kit.events import read_events
from kit.wait import wait_for

PREFIXED = re.compile(r"<([0-7])>(?:timestamp='[^']+' )?level='(\w+)' event='(\w+)'")


@pytest.mark.pure
@pytest.mark.parametrize(
    ("event", "fields", "want"),
    [
        ("shutdown", {"rung": "10/10", "action": "poweroff"}, logs.ALERT),
        ("shutdown", {"rung": "10/10", "action": "dry-run"}, logs.WARNING),
        ("dry_run_shutdown", {"rung": "10/10", "action": "dry-run"}, logs.WARNING),
        ("would_shutdown", {"rung": "10/10"}, logs.CRIT),
        ("memory_climb", {"g": "gpu0"}, logs.CRIT),
        ("setup_failed", {"step": "fetch"}, logs.ERR),
        ("error", {"where": "tick"}, logs.ERR),
        ("action", {"step": "poweroff", "status": "timeout"}, logs.ERR),
        ("action", {"step": "delete", "status": "fail"}, logs.ERR),
        ("action", {"step": "poweroff", "status": "ok"}, logs.INFO),
        ("action", {"step": "poweroff", "status": "dry_run"}, logs.INFO),
        ("stop", {"reason": "error"}, logs.ERR),
        ("stop", {"reason": "sigterm"}, logs.NOTICE),
        ("tick", {"rung": "3/10", "md": "fail/timeout/5000"}, logs.WARNING),
        ("fault", {"op": "inject"}, logs.WARNING),
        ("fault", {"op": "clear", "why": "install_failed"}, logs.ERR),
        ("fault", {"op": "expire"}, logs.NOTICE),
        ("disarm", {"src": "local"}, logs.WARNING),
        ("recovered", {"from": "9"}, logs.NOTICE),
        ("start", {}, logs.NOTICE),
        ("heartbeat", {"rung": "0/10"}, logs.INFO),
        ("mem", {"hu": "3.0"}, logs.INFO),
        ("something_new", {}, logs.INFO),
    ],
)
def test_priority_of_each_event(event: str, fields: dict[str, object], want: int) -> None:
    assert logs.priority_of(event, fields) == want


@pytest.mark.pure
def test_render_prefixes_only_when_asked() -> None:
    line = logs.render_line("shutdown", {"rung": "3/3", "gone": None}, logs.ALERT, True, "t")
    assert line == "<1>timestamp='t' level='alert' event='shutdown' rung='3/3'"
    plain = logs.render_line("shutdown", {"rung": "3/3"}, logs.ALERT, False, "t")
    assert plain.startswith("timestamp='t' level='alert'")
    assert logs.render_line("x", {}, logs.WARNING, True) == "<4>level='warning' event='x'"
    # a field named like the line's own keys is kept, renamed
    line = logs.render_line("maintenance", {"event": "TERMINATE"}, logs.WARNING, False)
    assert line == "level='warning' event='maintenance' event_='TERMINATE'"


@pytest.mark.pure
def test_a_level_without_a_priority_gets_its_own(tmp_path: Path) -> None:
    import logging

    out = io.StringIO()
    lg = logging.getLogger("gce-watchdog-test-levels")
    lg.addHandler(logs.EventHandler(out, None, True))
    lg.setLevel(logging.INFO)
    log = logs.EventLog(lg)
    log.error("serial_unavailable", device="/dev/ttyS0")
    log.debug("dropped at info")
    log.event("shutdown", {"rung": "3/3"}, logs.ALERT)
    lines = out.getvalue().splitlines()
    assert [ln[:3] for ln in lines] == ["<3>", "<1>"], lines
    assert "event='serial_unavailable' device='/dev/ttyS0'" in lines[0]


@pytest.mark.pure
def test_journal_stream_is_recognised_by_device_and_inode(tmp_path: Path) -> None:
    with (tmp_path / "err").open("w") as f:
        st = os.fstat(f.fileno())
        assert logs.journal_stream(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not logs.journal_stream(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert not logs.journal_stream(f, {})
    assert not logs.journal_stream(io.StringIO(), {"JOURNAL_STREAM": "1:2"})


def _run_agent(
    tmp_path: Path, journal: bool, stall: bool = False
) -> tuple[list[tuple[int, str, str]], str]:
    """The real agent through an outage to a (dry-run) shutdown, its stderr in a file that is
    the "journal stream" when ``journal`` (systemd names it in $JOURNAL_STREAM). ``stall``:
    stopped (SIGSTOP) for 1.5 s after its first heartbeat, as a loaded machine stalls it, so its
    ``stall`` line is always there, not only when the machine is busy."""
    err_path = tmp_path / "stderr"
    with SimGCE() as sim, err_path.open("w") as err:
        cfg = agent_config(tmp_path, sim)
        serial = tmp_path / "ttyS0"
        env = dict(os.environ)
        env.pop("JOURNAL_STREAM", None)
        # No native journal socket (a host under systemd has one): the entries fall back to
        # the prefixed lines on the stream, which is what this test reads.
        # tests/root/test_journald.py checks the native entries under a real journald.
        env["GCEWD_JOURNAL_SOCKET"] = str(tmp_path / "no-journal-socket")
        if journal:
            st = os.fstat(err.fileno())
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        with agent_process(cfg, stderr=err, env=env) as p:
            assert wait_for(lambda: any(e.event == "heartbeat" for e in read_events(serial)))
            if stall:
                p.send_signal(signal.SIGSTOP)
                time.sleep(1.5)  # the stall itself (> 2 intervals of 0.4 s), not a wait for luck
                p.send_signal(signal.SIGCONT)
                assert wait_for(lambda: any(e.event == "stall" for e in read_events(serial)))
            sim.outage(True)
            assert wait_for(
                lambda: any(
                    e.event == "action" and e.get("step") == "kernel" for e in read_events(serial)
                )
            )
            assert stop_agent(p) == 0
    text = err_path.read_text()
    found = [(int(m[1]), m[2], m[3]) for m in PREFIXED.finditer(text)]
    return found, text


@pytest.mark.process
def test_the_agents_journal_lines_carry_their_priorities(tmp_path: Path) -> None:
    found, text = _run_agent(tmp_path, journal=True, stall=True)
    lines = text.splitlines()
    assert lines and all(re.match(r"<[0-7]>", ln) for ln in lines), lines[:3]
    pri = {}
    for p, level, event in found:
        assert logs.NAMES[p] == level
        pri.setdefault(event, set()).add(p)
    # a dry run (its own event since protocol v2); a real shutdown is alert
    assert pri.get("dry_run_shutdown") == {logs.WARNING}, text[-3000:]
    assert pri["tick"] == {logs.WARNING}
    assert pri["heartbeat"] == {logs.INFO}
    assert pri["start"] == pri["stop"] == {logs.NOTICE}
    assert {logs.INFO} == pri["action"]
    # A stalled loop (more than two 0.4 s intervals between two ticks: here a SIGSTOP, under
    # load the machine itself) is a `stall` line, a warning as it should be, not a routine line.
    assert pri["stall"] == {logs.WARNING}
    # what `journalctl -p warning` would show: the decision and the climb, not the routine
    shown = {e for p, _, e in found if p <= logs.WARNING}
    # SIGTERM while the chain still holds the loop writes a `signal` line (warning) too
    most = {"dry_run_shutdown", "tick", "signal", "stall"}
    assert {"dry_run_shutdown", "tick"} <= shown <= most, text[-3000:]


@pytest.mark.process
def test_no_prefix_when_stderr_is_not_the_journal(tmp_path: Path) -> None:
    found, text = _run_agent(tmp_path, journal=False)
    assert found == []
    assert "level='warning' event='dry_run_shutdown'" in text
    assert not re.search(r"^<\d>", text, re.M)
