"""The e2e harness's serial console (e2e/vm.py): qemu's argv and the login session, against a
scripted getty on a socketpair (no qemu, no VM: `make e2e` runs the real one)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.paths import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from e2e import vm

AGENT_LINE = b"GCEWD3 0123abcd 7 2026-12-01T00:00:00.000Z heartbeat ph=workload #sig\r\n"


def _argv(tmp_path: Path) -> list[str]:
    image = vm.Image(tmp_path / "disk.img", tmp_path / "vmlinuz", tmp_path / "initrd", "3.11")
    spec = vm.VmSpec(name="t", startup_script="true")
    return vm.qemu_argv(spec, image, tmp_path / "console.sock", {}, {})


@pytest.mark.pure
def test_serial_port_is_a_socket_client_without_qemus_logfile(tmp_path: Path) -> None:
    argv = _argv(tmp_path)
    chardev = argv[argv.index("-chardev") + 1]
    # no logfile=: it doubles a byte whenever the socket is full for a moment (vm.qemu_argv)
    assert chardev == f"socket,id=s0,path={tmp_path / 'console.sock'},server=off"
    assert argv[argv.index("-serial") + 1] == "chardev:s0"
    assert argv.count("-chardev") == 1, "one chardev: ttyS0's"


@pytest.mark.pure
def test_build_image_creates_the_console_user_the_harness_logs_in_as() -> None:
    script = (REPO / "e2e" / "build-image.sh").read_text()
    assert f"console_user={vm.CONSOLE_USER}\n" in script
    assert f"console_password={vm.CONSOLE_PASSWORD}\n" in script
    hook = (REPO / "e2e" / "guest" / "usr" / "local" / "sbin" / "e2e-console-login").read_text()
    assert f"user={vm.CONSOLE_USER}\n" in hook


class FakeGetty:
    """agetty + login + bash as the harness sees them through the socket, one line of input at a
    time, with agent lines written in between (as on the real port). ``prompt_after`` Enters are
    ignored before the first login prompt (a getty still starting)."""

    def __init__(self, sock: socket.socket, prompt_after: int = 0, password: str = "") -> None:
        self.sock = sock
        self.prompt_after = prompt_after
        self.password = password or vm.CONSOLE_PASSWORD
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _lines(self) -> Iterator[bytes]:
        buf = b""
        while True:
            while b"\r" not in buf:
                chunk = self.sock.recv(4096)
                if not chunk:
                    return
                buf += chunk
            line, _, buf = buf.partition(b"\r")
            self.received.append(line)
            yield line

    def _serve(self) -> None:
        w = self.sock.sendall
        state = "getty"
        enters = 0
        w(b"[    1.0] Linux version 6.1\r\n" + AGENT_LINE)
        for line in self._lines():
            w(AGENT_LINE)
            if state == "getty" and line == b"":
                enters += 1
                if enters > self.prompt_after:
                    w(b"\r\nDebian GNU/Linux 12 gce-e2e ttyS0\r\n\r\n" + vm.LOGIN_PROMPT)
            elif state == "getty":
                w(line + b"\r\nPassword: ")
                state = "password"
            elif state == "password":
                if line.decode() != self.password:
                    w(b"\r\nLogin incorrect\r\n" + vm.LOGIN_PROMPT)
                    state = "getty"
                    continue
                w(b"\r\nLinux gce-e2e 6.1.0\r\n" + AGENT_LINE + vm.SHELL_PROMPT)
                state = "shell"
            elif line == b"exit":
                w(b"exit\r\nlogout\r\n" + AGENT_LINE + b"\r\nDebian GNU/Linux 12\r\n")
                w(vm.LOGIN_PROMPT)
                state = "getty"
            else:
                w(line + b"\r\n" + b"out-" + line[-2:] + b"\r\n" + vm.SHELL_PROMPT)


@pytest.fixture
def pair() -> Iterator[tuple[vm.SerialConsole, socket.socket]]:
    host, guest = socket.socketpair()
    con = vm.SerialConsole(host)
    yield con, guest
    # shutdown, not only close: it wakes the fake getty's recv and is the host side's EOF
    guest.shutdown(socket.SHUT_RDWR)
    guest.close()
    con.close()


@pytest.mark.process
def test_login_session_logs_in_runs_the_command_and_logs_out(
    pair: tuple[vm.SerialConsole, socket.socket],
) -> None:
    con, guest = pair
    getty = FakeGetty(guest, prompt_after=2)
    end = vm.login_session(con, "run xy", b"out-xy", prompt_wait=0.5)
    data = con.data()
    assert data[:end].endswith(vm.LOGIN_PROMPT)
    assert data.rfind(b"logout") < end and data.find(b"out-xy") < data.rfind(b"logout")
    # three Enters (two ignored), the user, the password, the command, exit
    assert getty.received == [
        b"",
        b"",
        b"",
        vm.CONSOLE_USER.encode(),
        vm.CONSOLE_PASSWORD.encode(),
        b"run xy",
        b"exit",
    ]
    log = "\n".join(con.transcript)
    assert vm.CONSOLE_PASSWORD not in log and "<password>" in log


@pytest.mark.process
def test_a_wrong_password_is_an_error_not_a_hang(
    pair: tuple[vm.SerialConsole, socket.socket],
) -> None:
    con, guest = pair
    FakeGetty(guest, password="something-else")
    t0 = time.monotonic()
    with pytest.raises(vm.E2EError, match="no b'gcewd-e2e@gce-e2e:~\\$ '"):
        vm.login_session(con, "run xy", b"out-xy", login_wait=0.5)
    assert time.monotonic() - t0 < 10


@pytest.mark.process
def test_expect_ends_at_eof_at_once(pair: tuple[vm.SerialConsole, socket.socket]) -> None:
    con, guest = pair
    guest.sendall(b"some output\r\n")
    assert con.expect(b"output", 0, 5.0) == len(b"some output")
    guest.shutdown(socket.SHUT_WR)
    t0 = time.monotonic()
    with pytest.raises(vm.E2EError, match="EOF"):
        con.expect(vm.LOGIN_PROMPT, 0, 60.0)
    assert time.monotonic() - t0 < 10, "EOF wakes the wait, not its 60 s bound"


@pytest.mark.process
def test_expect_looks_only_after_since(pair: tuple[vm.SerialConsole, socket.socket]) -> None:
    con, guest = pair
    guest.sendall(b"login: old\r\n")
    first = con.expect(b"login: ", 0, 5.0)
    with pytest.raises(vm.E2EError, match="0s"):
        con.expect(b"login: ", first, 0.2)


@pytest.mark.process
def test_the_log_gets_every_byte_once_in_order(tmp_path: Path) -> None:
    """serial.log is the socket stream as read: a writer far ahead of the reader (a full socket
    buffer, what made qemu's logfile double a byte) loses and repeats nothing."""
    host, guest = socket.socketpair()
    host.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    payload = b"".join(b"GCEWD3 line %06d xyz\r\n" % i for i in range(20000))
    with open(tmp_path / "serial.log", "wb") as log:
        con = vm.SerialConsole(host, log)
        guest.sendall(payload)
        guest.shutdown(socket.SHUT_WR)
        with pytest.raises(vm.E2EError, match="EOF"):
            con.expect(b"never written", 0, 60.0)
        con.close()
    guest.close()
    assert (tmp_path / "serial.log").read_bytes() == payload
    assert con.data() == payload


@pytest.mark.pure
def test_first_agent_line_milestone_is_the_wire_formats_marker() -> None:
    # the report's first_gcewd time is the first line the agent signs; a stale marker
    # (GCEWD2 after the v3 bump) left it out of every report without failing anything
    needle = vm.MILESTONES["first_gcewd"]
    assert AGENT_LINE.startswith(needle)
    seen: dict[str, float] = {}
    vm._milestones(b"noise\r\n" + AGENT_LINE, seen, 12.5)
    assert seen.get("first_gcewd") == 12.5
