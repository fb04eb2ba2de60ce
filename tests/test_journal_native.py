"""Structured journal entries: the native protocol's encoding (checked against a parser written
from the protocol's own description), the fallback to a plain line that never loses one, and the
fields as a REAL systemd-journald stores them (`journalctl -o json`), journald running in a
private mount and PID namespace with its own /run/systemd/journal."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gce_watchdog.vm import logs
from hypothesis import given
from hypothesis import strategies as st

JOURNALD = next(
    (
        p
        for p in ("/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald")
        if os.path.exists(p)
    ),
    None,
)


def parse_native(data: bytes) -> list[tuple[str, bytes]]:
    """The "Native Journal Protocol" (systemd.io/JOURNAL_NATIVE_PROTOCOL): a series of fields,
    each either ``NAME=value\\n`` (value without a newline) or ``NAME\\n`` followed by the value's
    length as a little-endian 64-bit integer, the value, and ``\\n``."""
    out: list[tuple[str, bytes]] = []
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            i = nl + 1
        else:
            name = line
            (n,) = struct.unpack("<Q", data[nl + 1 : nl + 9])
            value = data[nl + 9 : nl + 9 + n]
            assert data[nl + 9 + n : nl + 10 + n] == b"\n", "a binary value ends with a newline"
            i = nl + 10 + n
        assert name and all(c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_" for c in name), name
        assert not name.startswith(b"_") and len(name) <= 64, name
        out.append((name.decode(), value))
    return out


names = st.from_regex(r"[A-Z][A-Z0-9_]{0,20}", fullmatch=True)


@given(st.lists(st.tuples(names, st.binary(max_size=40)), max_size=8))
def test_encoding_is_what_the_protocol_reads_back_binary_safe(
    fields: list[tuple[str, bytes]],
) -> None:
    assert parse_native(logs.encode_native(list(fields))) == fields  # type: ignore[arg-type]


def test_field_names_are_ones_journald_takes() -> None:
    assert logs.field_name("from") == "GCEWD_FROM"
    assert logs.field_name("a-b.c d") == "GCEWD_A_B_C_D"
    assert logs.field_name("ünï") == "GCEWD_ÜNÏ".encode("ascii", "replace").decode().replace(
        "?", "_"
    )
    assert len(logs.field_name("x" * 100)) == 64


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

CHILD = textwrap.dedent(
    """
    import os, socket, sys
    if os.environ.get("STREAM_TO"):
        # What systemd does for a service with StandardError=journal: a stream connection to
        # journald's stdout socket with the header sd_journal_stream_fd(3) sends (identifier,
        # unit id, priority, level prefix, forward to syslog, kmsg, console; one per line), as
        # fd 2, and JOURNAL_STREAM naming it (systemd.exec(5)).
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(os.environ["STREAM_TO"])
        s.sendall(b"gce-watchdog\\n\\n6\\n1\\n0\\n0\\n0\\n")
        os.dup2(s.fileno(), 2)
    st = os.fstat(2)
    os.environ["JOURNAL_STREAM"] = "%d:%d" % (st.st_dev, st.st_ino)
    from gce_watchdog.vm import logs
    logs.setup()
    m = logs.mirror(logs.get())
    tag = os.environ["TAG"]
    m("tick", rung="3/10", md="fail/timeout/5000", tag=tag, text="BOTH failed\\nsecond line")
    m("heartbeat", rung="0/10", tag=tag)
    m("dry_run_shutdown", rung="10/10", tag=tag)
    """
)


def _child(env: dict[str, str], stderr: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD], env={**os.environ, **env}, stderr=stderr,  # type: ignore[arg-type]
        stdout=subprocess.PIPE, text=True, timeout=60,
    )  # fmt: skip


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
    assert dry["PRIORITY"] == b"2" and dry["GCEWD_RUNG"] == b"10/10"


def test_no_socket_means_the_prefixed_line_on_stderr_never_a_lost_one(tmp_path: Path) -> None:
    with (tmp_path / "err").open("w") as err:
        p = _child({"GCEWD_JOURNAL_SOCKET": str(tmp_path / "absent"), "TAG": "t2"}, err)
    assert p.returncode == 0
    lines = (tmp_path / "err").read_text().splitlines()
    assert [ln[:3] for ln in lines] == ["<4>", "<6>", "<2>"]
    assert "event='tick'" in lines[0] and "event='dry_run_shutdown'" in lines[2]


# -- a real journald ------------------------------------------------------------------------------

REAL = textwrap.dedent(
    """
    set -eu
    # Private mounts (this is a new mount namespace): journald's sockets and journal files live
    # in tmpfs here and nowhere else; the host's /run/systemd and logs are never touched.
    mount -t tmpfs tmpfs /run/systemd
    mkdir -p /run/systemd/journal /run/log
    mount -t tmpfs tmpfs /run/log
    if [ -d /var/log/journal ]; then mount -t tmpfs tmpfs /var/log/journal; fi
    "$JOURNALD" &
    jd=$!
    trap 'kill $jd 2>/dev/null || true' EXIT
    n=0
    until [ -S /run/systemd/journal/socket ] && [ -S /run/systemd/journal/stdout ]; do
        n=$((n + 1)); [ $n -lt 300 ] || { echo "journald did not start" >&2; exit 97; }
        sleep 0.1
    done
    export STREAM_TO=/run/systemd/journal/stdout
    TAG=native "$PY" -c "$CHILD"
    TAG=fallback GCEWD_JOURNAL_SOCKET=/run/absent "$PY" -c "$CHILD"
    # Wait (bounded) until journald has stored all six entries, then print them.
    n=0
    while :; do
        set -- /run/log/journal/*
        out=$(journalctl -q -D "$1" -o json SYSLOG_IDENTIFIER=gce-watchdog 2>&1 || true)
        [ "$(printf '%s' "$out" | grep -c . || true)" -ge 6 ] && break
        n=$((n + 1)); [ $n -lt 300 ] || { echo "journal: $out" >&2; exit 98; }
        sleep 0.1
    done
    printf '%s\\n' "$out"
    """
)


@pytest.mark.skipif(
    os.geteuid() != 0
    or JOURNALD is None
    or not shutil.which("unshare")
    or not shutil.which("journalctl"),
    reason="needs root, unshare, systemd-journald and journalctl",
)
def test_a_real_journald_stores_our_fields() -> None:
    p = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
         "bash", "-c", REAL],
        env={**os.environ, "JOURNALD": str(JOURNALD), "PY": sys.executable, "CHILD": CHILD},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if p.returncode != 0 and "unshare failed" in p.stderr:
        pytest.skip(f"no namespaces here: {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    entries = [json.loads(ln) for ln in p.stdout.splitlines() if ln.strip()]
    native = [e for e in entries if e.get("GCEWD_TAG") == "native"]
    assert [e["GCEWD_EVENT"] for e in native] == ["tick", "heartbeat", "dry_run_shutdown"]
    tick = native[0]
    assert tick["PRIORITY"] == "4" and tick["GCEWD_RUNG"] == "3/10"
    assert tick["GCEWD_MD"] == "fail/timeout/5000" and tick["GCEWD_LEVEL"] == "warning"
    assert tick["GCEWD_TEXT"] == "BOTH failed\nsecond line"  # the length-encoded value, intact
    assert tick["MESSAGE"].startswith("tick rung=3/10 md=fail/timeout/5000")
    assert tick["_TRANSPORT"] == "journal"  # journald's own word: the native protocol
    assert native[2]["PRIORITY"] == "2"
    # No native socket: the prefixed lines through the stream, priorities read by journald.
    plain = [e for e in entries if e.get("_TRANSPORT") == "stdout"]
    assert len(plain) == 3, entries
    assert [e["PRIORITY"] for e in plain] == ["4", "6", "2"]
    assert all("GCEWD_EVENT" not in e for e in plain)
    assert "event='tick'" in plain[0]["MESSAGE"] and "tag='fallback'" in plain[0]["MESSAGE"]


def test_an_entry_the_socket_refuses_is_written_as_a_line(tmp_path: Path) -> None:
    import io

    sock_path = tmp_path / "socket"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(sock_path))
    try:
        out = io.StringIO()
        lg = logs.JournalLogger(out, logs.JournalSender(str(sock_path)))
        lg.msg("<6>small", entry=logs.encode_native([("MESSAGE", "small")]))
        assert out.getvalue() == "" and parse_native(srv.recv(65536)) == [("MESSAGE", b"small")]
        huge = logs.encode_native([("MESSAGE", "x" * (16 << 20))])  # over any datagram limit
        lg.msg("<4>huge, as a line", entry=huge)
        assert out.getvalue() == "<4>huge, as a line\n"
        assert lg.sender.failures == 1
    finally:
        srv.close()
    lg.msg("<3>journald gone", entry=b"MESSAGE=x\n")  # the socket's file is there, no reader
    assert out.getvalue().endswith("<3>journald gone\n")
