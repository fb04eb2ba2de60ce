"""Structured journal entries: the native protocol's encoding (checked against a parser written
from the protocol's own description) and the fallback to a plain line that never loses one.
tests/root/test_journald.py runs the same child under a REAL systemd-journald."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from gce_watchdog.vm import logs
from hypothesis import given
from hypothesis import strategies as st
from kit.journal import CHILD, parse_native

names = st.from_regex(r"[A-Z][A-Z0-9_]{0,20}", fullmatch=True)


@pytest.mark.pure
@given(st.lists(st.tuples(names, st.binary(max_size=40)), max_size=8))
def test_encoding_is_what_the_protocol_reads_back_binary_safe(
    fields: list[tuple[str, bytes]],
) -> None:
    assert parse_native(logs.encode_native(list(fields))) == fields  # type: ignore[arg-type]


@pytest.mark.pure
def test_field_names_are_ones_journald_takes() -> None:
    assert logs.field_name("from") == "GCEWD_FROM"
    assert logs.field_name("a-b.c d") == "GCEWD_A_B_C_D"
    assert logs.field_name("ünï") == "GCEWD_ÜNÏ".encode("ascii", "replace").decode().replace(
        "?", "_"
    )
    assert len(logs.field_name("x" * 100)) == 64


@pytest.mark.pure
def test_the_entry_has_readable_message_priority_and_our_fields() -> None:
    ed = {"event": "tick", "timestamp": "2026-12-01T00:00:00Z", "rung": "3/10", "seq": 7,
          "serial_ok": True, "text": "BOTH failed\nsecond line", "gone": None}  # fmt: skip
    got = dict(logs.journal_fields(ed, logs.WARNING))
    assert got["MESSAGE"] == "tick rung=3/10 seq=7 serial_ok=True | BOTH failed\nsecond line"
    assert "2026-12-01" not in str(got["MESSAGE"])  # the journal has its own timestamp
    assert got["PRIORITY"] == "4" and got["SYSLOG_IDENTIFIER"] == "gce-watchdog"
    assert got["GCEWD_EVENT"] == "tick" and got["GCEWD_RUNG"] == "3/10"
    assert got["GCEWD_SEQ"] == "7" and got["GCEWD_LEVEL"] == "warning"
    assert got["GCEWD_TEXT"] == "BOTH failed\nsecond line"
    assert "GCEWD_GONE" not in got and "GCEWD_TIMESTAMP" not in got


# -- a child that logs as the agent does, with stderr as the "journal stream" ---------------------


def _child(env: dict[str, str], stderr: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD], env={**os.environ, **env}, stderr=stderr,  # type: ignore[arg-type]
        stdout=subprocess.PIPE, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.process
def test_entries_go_to_the_native_socket_as_datagrams(tmp_path: Path) -> None:
    sock_path = tmp_path / "socket"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(sock_path))
    srv.settimeout(30)
    try:
        with (tmp_path / "err").open("w") as err:
            p = _child({"GCEWD_JOURNAL_SOCKET": str(sock_path), "TAG": "t1"}, err)
        assert p.returncode == 0
        entries = [dict(parse_native(srv.recv(65536))) for _ in range(3)]
    finally:
        srv.close()
    assert (tmp_path / "err").read_text() == ""  # sent, so not written twice
    tick, hb, dry = entries
    assert (
        tick[b"MESSAGE".decode()]
        == b"tick rung=3/10 md=fail/timeout/5000 tag=t1 | BOTH failed\nsecond line"
    )
    assert tick["PRIORITY"] == b"4" and tick["GCEWD_TEXT"] == b"BOTH failed\nsecond line"
    assert hb["PRIORITY"] == b"6" and hb["GCEWD_EVENT"] == b"heartbeat"
    assert dry["PRIORITY"] == b"4" and dry["GCEWD_RUNG"] == b"10/10"


@pytest.mark.process
def test_no_socket_means_the_prefixed_line_on_stderr_never_a_lost_one(tmp_path: Path) -> None:
    with (tmp_path / "err").open("w") as err:
        p = _child({"GCEWD_JOURNAL_SOCKET": str(tmp_path / "absent"), "TAG": "t2"}, err)
    assert p.returncode == 0
    lines = (tmp_path / "err").read_text().splitlines()
    assert [ln[:3] for ln in lines] == ["<4>", "<6>", "<4>"]
    assert "event='tick'" in lines[0] and "event='dry_run_shutdown'" in lines[2]


@pytest.mark.process
def test_an_entry_the_socket_refuses_is_written_as_a_line(tmp_path: Path) -> None:
    import io

    sock_path = tmp_path / "socket"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(sock_path))
    try:
        out = io.StringIO()
        sender = logs.JournalSender(str(sock_path))
        lg = logging.getLogger("gce-watchdog-test-native")
        lg.addHandler(logs.EventHandler(out, sender, True))
        lg.setLevel(logging.INFO)
        log = logs.EventLog(lg)
        log.event("small", {}, logs.INFO)
        got = dict(parse_native(srv.recv(65536)))
        assert out.getvalue() == "" and got["MESSAGE"] == b"small"
        log.event("huge", {"text": "x" * (16 << 20)}, logs.WARNING)  # over any datagram limit
        assert out.getvalue().startswith("<4>level='warning' event='huge' text='xxx")
        assert sender.failures == 1
    finally:
        srv.close()
    log.event("gone", {}, logs.ERR)  # the socket's file is there, no reader
    assert out.getvalue().endswith("<3>level='err' event='gone'\n")
