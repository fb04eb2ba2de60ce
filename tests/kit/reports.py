"""One report per verdict class (report.model.VERDICT_WORDS), built from signed dumps: for the
class tests and the screenshot test in a real browser."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gce_watchdog.report.model import Report, build_report
from gce_watchdog.testing.synth import Writer
from gce_watchdog.wire.protocol import LineKey


def _dump(
    lines: Sequence[tuple[str, Mapping[str, object], str]], key: LineKey | None = None
) -> bytes:
    w = Writer(boot="aaaa0001")
    out = w.line("phase", {"ph": "workload"})
    for name, fields, text in lines:
        out += w.line(name, fields, text)
    if key is not None:  # a line signed by another key after the boot's announcement: forged
        intruder = Writer(boot="aaaa0001", key=key, announce=False, seq=w.seq, ts_ms=w.ts_ms)
        out += intruder.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "fake")
    return out


def _at_last_line(data: bytes) -> Report:
    """The report judged when the dump was read: right after its last line."""
    first = build_report(data)
    last = max((e.ts_ms for e in first.events), default=0)
    return build_report(data, now=last / 1000 + 1, received=last / 1000 + 1)


def report_of(cls: str) -> Report:
    """A report whose verdict class is ``cls``."""
    tick = {"rung": "10/10", "md": "fail/timeout/5001", "eg": "fail/refused/0"}
    if cls == "failover":
        return _at_last_line(_dump([("shutdown", {"reason": "ladder", "rung": "10/10"}, "off")]))
    if cls == "alarm":
        return _at_last_line(
            _dump([("heartbeat", {"rung": "0/10"}, "")], key=LineKey(b"\x07" * 32))
        )
    if cls == "dry-run":
        dry = {"reason": "ladder", "rung": "10/10", "action": "dry-run"}
        return _at_last_line(_dump([("tick", tick, ""), ("dry_run_shutdown", dry, "rehearsal")]))
    if cls == "job-failed":
        failed = {"step": "deps", "cause": "job", "rc": "1"}
        return _at_last_line(_dump([("setup_failed", failed, "pip failed")]))
    if cls == "unknown":
        return build_report(b"")
    if cls == "healthy":
        return _at_last_line(_dump([("heartbeat", {"rung": "0/10"}, "")]))
    raise ValueError(cls)
