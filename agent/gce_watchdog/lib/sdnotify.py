"""Minimal sd_notify(3): datagrams to $NOTIFY_SOCKET. Best effort: failures are counted."""

from __future__ import annotations

import os
import socket


class Notifier:
    """Sends READY=1, WATCHDOG=1, STATUS=... to systemd when run under it; a no-op otherwise."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        e = os.environ if env is None else env
        addr = e.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        self.address = addr
        self.failures = 0
        try:
            usec = int(e.get("WATCHDOG_USEC", "0"))
            pid = int(e.get("WATCHDOG_PID", str(os.getpid())))
        except ValueError:
            usec, pid = 0, 0
        # Only honour the watchdog when it is meant for this process.
        self.watchdog_interval = usec / 1e6 if usec > 0 and pid == os.getpid() else 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, *assignments: str) -> bool:
        if not self.address:
            return False
        msg = "\n".join(assignments).encode("utf-8", "replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(self.address)
                s.sendall(msg)
            return True
        except OSError:
            self.failures += 1
            return False
