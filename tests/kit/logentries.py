"""Serial console lines as a Cloud Logging sink publishes them to Pub/Sub (LogEntry JSON), and a
fleet's worth of them, for the Pub/Sub worker's tests and bench/bench_fleet.py."""

from __future__ import annotations

import random

from gce_watchdog.testing.synth import Writer

from kit.pubsub_service import exported_entry

PROJECT = "test-project"


def log_entry(iid: str, name: str, text: str, zone: str = "us-central1-a") -> bytes:
    """A LogEntry as a Cloud Logging sink publishes it for a serial port 1 line."""
    return exported_entry(PROJECT, iid, name, text, zone)


def lines_of(w: Writer, *events: tuple[str, dict[str, str]]) -> list[str]:
    """One console line per entry (a boot's first also gives its key announcement before it)."""
    return [ln for name, fields in events for ln in w.line(name, fields).decode().splitlines()]


def fleet_messages(rnd: random.Random, vms: int) -> tuple[list[bytes], set[str], set[str]]:
    """Every VM runs, then shuts down (ladder), except the last: its job exits 0 just before.
    Noise lines, duplicates of a third of the lines, and the whole stream shuffled."""
    msgs: list[bytes] = []
    wedged, finished = set(), set()
    for i in range(vms):
        iid, name = f"{4_000_000_000 + i}", f"vm-{i:03d}"
        w = Writer(boot=f"{i:08x}")
        evs: list[tuple[str, dict[str, str]]] = [
            ("start", {"v": "1"}),
            ("phase", {"ph": "workload"}),
        ]
        evs += [("tick", {"rung": f"{r}/10", "md": "fail", "eg": "fail"}) for r in range(1, 6)]
        if i == vms - 1:
            evs.append(("exit", {"rc": "0"}))
            finished.add(iid)
        else:
            wedged.add(iid)
        evs.append(("shutdown", {"reason": "ladder", "rung": "10/10"}))
        for text in lines_of(w, *evs):
            msgs.append(log_entry(iid, name, text))
        msgs.append(log_entry(iid, name, "[  12.3] systemd[1]: Started foo.service"))
    msgs += [rnd.choice(msgs) for _ in range(len(msgs) // 3)]  # duplicates
    rnd.shuffle(msgs)
    return msgs, wedged, finished
