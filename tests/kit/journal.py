"""journald's native protocol, read back (for tests), and a child that logs as the agent does."""

from __future__ import annotations

import struct
import textwrap


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
    m("tick", {"rung": "3/10", "md": "fail/timeout/5000", "tag": tag,
               "text": "BOTH failed\\nsecond line"})
    m("heartbeat", {"rung": "0/10", "tag": tag})
    m("dry_run_shutdown", {"rung": "10/10", "tag": tag})
    """
)
