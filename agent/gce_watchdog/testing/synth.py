"""Realistic serial dumps for tests, the e2e test and the benchmarks.

Real GCE serial output (a corpus of console dumps: kernel, systemd, guest agent, start-up script
lines, CRLF endings, ANSI escapes) interleaved with our protocol lines, plus the damage a real
console does to them. Every builder returns the bytes and the events a correct decoder must
return, so tests can compare exactly.

The package ships no corpus and never looks outside itself for one: the caller names the
directory (the repository vendors one in ``tests/data/serial-corpus``, with its SOURCES.md;
``$GCE_WATCHDOG_SERIAL_CORPUS`` names one for ``corpus_dir``). The line builders (``Writer``,
``crlf``, ``splice``...) need no corpus.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gce_watchdog.wire.protocol import (
    KEY_EVENT,
    Event,
    LineKey,
    announce_event,
    encode,
    make_event,
    needs_announcement,
)

CORPUS_ENV = "GCE_WATCHDOG_SERIAL_CORPUS"
KERNEL_MSG = b'[  123.456789] audit: type=1400 audit(1700000000.123:42): apparmor="DENIED"'
T0_MS = 1_764_475_094_000  # 2025-11-30T03:58:14Z: a fixed, realistic start time
# The line key of synthetic dumps (a real instance's key is random, see vm/state.py).
SYNTH_SEED = bytes(range(32))
SYNTH_KEY = LineKey(SYNTH_SEED)


def corpus_dir(default: Path | None = None) -> Path | None:
    """The corpus directory: ``$GCE_WATCHDOG_SERIAL_CORPUS`` if set, else ``default``; None when
    that is not a directory holding ``*.log`` files."""
    env = os.environ.get(CORPUS_ENV)
    d = Path(env) if env else default
    return d if d is not None and d.is_dir() and any(d.glob("*.log")) else None


def corpus_files(directory: Path) -> list[Path]:
    """The corpus's dumps (``*.log`` in ``directory``), sorted; none when it is absent."""
    return sorted(directory.glob("*.log")) if directory.is_dir() else []


def corpus_lines(directory: Path) -> list[bytes]:
    """Every line of every corpus file, line endings kept (CRLF stays CRLF)."""
    out: list[bytes] = []
    for p in corpus_files(directory):
        out.extend(p.read_bytes().splitlines(keepends=True))
    return out


@dataclass
class Writer:
    """Numbers, timestamps and signs our lines like the agent does: the key announcement takes
    seq 0 and 1 and every multiple of ANNOUNCE_EVERY, written before the event (its shown form
    is in ``written`` too)."""

    boot: str = "3f2a9c1e"
    key: LineKey = SYNTH_KEY
    announce: bool = True  # False: no key line (a reader given the key; pure decoding tests)
    inst: str = "-"  # the instance id the announcements name
    seq: int = 0
    ts_ms: int = T0_MS
    step_ms: int = 30_000  # one tick interval between lines by default
    written: list[Event] = field(default_factory=list)

    def event(
        self,
        name: str,
        fields: Mapping[str, object] | Iterable[tuple[str, object]] = (),
        text: str = "",
        step_ms: int | None = None,
    ) -> Event:
        ev = make_event(name, self.boot, self.seq, self.ts_ms, fields, text)
        self.seq += 1
        self.ts_ms += self.step_ms if step_ms is None else step_ms
        self.written.append(ev)
        return ev

    def line(self, *args: object, **kwargs: object) -> bytes:
        head = b""
        while self.announce and needs_announcement(self.seq):
            ann = announce_event(self.boot, self.seq, self.ts_ms, self.key, self.inst)
            head += encode(ann, self.key).encode() + b"\n"
            self.written.append(shown_announcement(ann))
            self.seq += 1
        ev = self.event(*args, **kwargs)  # type: ignore[arg-type]
        return head + encode(ev, self.key).encode() + b"\n"

    def reboot(self, boot: str, gap_ms: int = 60_000) -> None:
        """A new incarnation: new boot id, the counter restarts at 0."""
        self.boot = boot
        self.seq = 0
        self.ts_ms += gap_ms


def shown_announcement(ann: Event) -> Event:
    """How readers show an announcement: the fingerprint instead of the public key."""
    from gce_watchdog.wire.protocol import pk_fingerprint, unb64

    fields = [("kid", pk_fingerprint(unb64(ann.get("pk") or "")))]
    fields += [(k, v) for k, v in ann.fields if k != "pk"]
    return Event(KEY_EVENT, ann.boot, ann.seq, ann.ts_ms, tuple(fields))


def splice(line: bytes, insert: bytes = KERNEL_MSG, at: int | None = None) -> bytes:
    """A kernel printk landing in the middle of our line (as on a real console)."""
    body = line.rstrip(b"\n")
    i = len(body) // 2 if at is None else at
    return body[:i] + insert + body[i:] + b"\n"


def truncate(line: bytes, keep: int | None = None) -> bytes:
    """Our line cut short (the VM died mid-write); the newline comes from the next output."""
    body = line.rstrip(b"\n")
    return body[: len(body) * 2 // 3 if keep is None else keep] + b"\n"


def crlf(line: bytes) -> bytes:
    return line.rstrip(b"\n") + b"\r\n"


def with_nuls(line: bytes) -> bytes:
    """NUL padding before our line (a console that lost power for a moment)."""
    return b"\x00\x00\x00" + line


def interleave(console: list[bytes], ours: list[bytes], every: int) -> bytes:
    """Our lines, one after every ``every`` console lines (the rest appended at the end)."""
    out = bytearray()
    it = iter(ours)
    for i, ln in enumerate(console, 1):
        out += ln if ln.endswith(b"\n") else ln + b"\n"
        if i % every == 0:
            nxt = next(it, None)
            if nxt is not None:
                out += nxt
    for rest in it:
        out += rest
    return bytes(out)


def realistic_dump(
    size: int = 1024 * 1024, every: int = 20, *, directory: Path
) -> tuple[bytes, list[Event]]:
    """About ``size`` bytes of corpus output with one of our lines per ``every`` console lines.

    The events are heartbeats and ticks of a healthy-then-degrading agent. Returns the dump and
    the events a correct decoder yields (in order). Raises FileNotFoundError when ``directory``
    holds no corpus.
    """
    console = corpus_lines(directory)
    if not console:
        raise FileNotFoundError(f"no serial corpus (*.log) in {directory}")
    w = Writer()
    out = bytearray()
    inst = "4000000000000000001"
    out += w.line("start", {"v": "0.1.0", "inst": inst, "cfg": "a1b2c3", "pid": 812})
    i = 0
    while len(out) < size:
        ln = console[i % len(console)]
        out += ln if ln.endswith(b"\n") else ln + b"\n"
        i += 1
        if i % every == 0:
            k = w.seq
            if k % 3:
                out += w.line(
                    "tick",
                    {
                        "rung": f"{k % 10}/10",
                        "md": "fail/timeout/5000",
                        "eg": "fail/connect_timeout/5001",
                        "dns": "ok",
                        "ph": "workload",
                    },
                    f"BOTH reachability probes FAILED ({k % 10}/10)",
                )
            else:
                out += w.line(
                    "heartbeat", {"rung": "0/10", "ph": "workload", "ticks": k, "drop": 0}
                )
    kept = bytes(out[:size])
    return kept, [e for e in w.written if e.event == KEY_EVENT or encode(e, w.key).encode() in kept]
