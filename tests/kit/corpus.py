"""Realistic serial logs built on the vendored corpus (tests/data/serial-corpus): real GCE console
output with our lines, some of them damaged, woven in."""

from __future__ import annotations

from gce_watchdog.testing.synth import (
    KERNEL_MSG,
    Writer,
    crlf,
    splice,
    truncate,
    with_nuls,
)
from gce_watchdog.wire.protocol import Event

from kit.paths import CORPUS


def file_lines(name: str) -> list[bytes]:
    return (CORPUS / name).read_bytes().splitlines(keepends=True)


def weave(console: list[bytes], inserts: dict[int, bytes]) -> bytes:
    """Console lines with our (possibly damaged) bytes inserted after the given line numbers."""
    out = bytearray()
    for i, ln in enumerate(console):
        out += ln
        if i in inserts:
            out += inserts[i]
    return bytes(out)


def scenario_one_boot_with_damage() -> tuple[bytes, list[Event], Writer]:
    """A Debian 11 boot (CRLF, ANSI) with our lines, five of them damaged."""
    console = file_lines("debian11-uefi-boot-startup-script-ops-agent.log")
    w = Writer(boot="aaaa0001")
    keep: list[Event] = []

    def ok(line: bytes) -> bytes:
        keep.append(w.written[-1])
        return line

    first = crlf(w.line("phase", {"ph": "bootstrap"}, step_ms=1000))
    keep.extend(w.written)  # the boot's key announcement (seq 0) and that phase line
    ins = {
        40: first,
        300: ok(w.line("start", {"v": "0.1.0", "inst": "-", "cfg": "abc123", "pid": 812})),
        # a kernel message spliced into the middle: rejected, counted
        400: splice(w.line("heartbeat", {"rung": "0/10", "ph": "bootstrap", "ticks": 10})),
        # NUL bytes in front: only the part from the marker matters
        600: ok(with_nuls(w.line("phase", {"ph": "workload"}))),
        # the VM died mid-write; the next console output lands on the same line
        800: truncate(w.line("tick", {"rung": "1/10", "md": "fail", "eg": "fail"})).rstrip(b"\n"),
        # intact, then a kernel message glued after it before the newline: accepted
        1000: ok(
            w.line("tick", {"rung": "2/10", "md": "fail", "eg": "fail"}).rstrip(b"\n")
            + KERNEL_MSG
            + b"\r\n"
        ),
        1100: ok(
            crlf(
                w.line(
                    "tick",
                    {"rung": "3/10", "md": "fail", "eg": "fail"},
                    "BOTH reachability probes FAILED (3/10)",
                )
            )
        ),
    }
    dup = w.line("tick", {"rung": "4/10", "md": "fail", "eg": "fail"})
    keep.append(w.written[-1])
    ins[1200] = dup
    ins[1201] = b"Nov 17 04:05:01 debian gce-watchdog[812]: " + dup  # journald copy: seen once
    ins[1300] = b"\x00" * 16 + b"\xff\xfe garbage GCEWD1 not a line\r\n"  # marker, no line
    ins[1500] = ok(
        w.line(
            "shutdown",
            {"reason": "ladder", "rung": "10/10", "action": "poweroff"},
            "10/10: shutting down",
        )
    )
    return weave(console, ins), keep, w
