"""The e2e guest's start-up script output relay reads lines as GCE's runners do: a default
``bufio.Scanner`` (64 KiB buffer, line plus newline), reading stops at a longer line and the
pipe is closed (guest-agent ``google_metadata_script_runner/main.go`` ``runCmd``;
google-guest-agent ``internal/run/run.go`` ``scanPipe``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kit.paths import REPO

pytestmark = pytest.mark.process

RELAY = REPO / "e2e" / "guest" / "usr" / "local" / "sbin" / "gce-startup-relay"
MAX = 64 * 1024


def relay(data: bytes) -> tuple[int, list[bytes]]:
    p = subprocess.run(
        [sys.executable, str(RELAY), "startup-script"], input=data, capture_output=True, timeout=30
    )
    return p.returncode, p.stdout.split(b"\n")[:-1]


def test_lines_up_to_the_buffer_are_relayed_with_the_prefix() -> None:
    longest = b"x" * (MAX - 1)  # with its newline it fills the 64 KiB buffer exactly
    rc, out = relay(b"one\r\n\n" + longest + b"\nlast without newline")
    assert rc == 0
    assert out == [
        b"startup-script: one",  # ScanLines drops a trailing \r
        b"startup-script: ",
        b"startup-script: " + longest,
        b"startup-script: last without newline",
    ]


def test_a_longer_line_stops_the_reading() -> None:
    rc, out = relay(b"before\n" + b"y" * MAX + b"\nafter\n")
    assert rc == 1
    assert out == [
        b"startup-script: before",
        b'gce-startup: error while communicating with "startup-script" script: '
        b"bufio.Scanner: token too long",
    ]


def test_after_a_long_line_the_scripts_next_write_fails() -> None:
    """As on GCE the read end is closed: the writer's next write is EPIPE (bash: SIGPIPE)."""
    writer = textwrap.dedent(
        f"""
        import os, signal, sys, time
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.write(1, b"a\\n" + b"z" * {MAX} + b"\\n")
        while True:  # until the relay is gone: EPIPE (SIGPIPE kills us)
            os.write(1, b"more\\n")
        """
    )
    w = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE)
    assert w.stdout is not None
    r = subprocess.run(
        [sys.executable, str(RELAY)], stdin=w.stdout, capture_output=True, timeout=30
    )
    w.stdout.close()
    assert w.wait(timeout=30) == -13  # SIGPIPE
    assert r.returncode == 1 and b"more" not in r.stdout


@given(st.lists(st.binary(max_size=200).filter(lambda b: b"\n" not in b), max_size=20))
def test_short_lines_are_relayed_one_for_one(lines: list[bytes]) -> None:
    rc, out = relay(b"".join(x + b"\n" for x in lines))
    assert rc == 0
    assert out == [b"startup-script: " + (x[:-1] if x.endswith(b"\r") else x) for x in lines]
