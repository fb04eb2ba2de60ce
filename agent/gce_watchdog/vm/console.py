"""Writing protocol lines to the serial console.

- :class:`SerialPort` is the edge: one ``write()`` per line, ``tcdrain`` on a tty, all done by one
  writer thread behind a bounded queue, so a port that stops accepting data never stalls the
  caller. Lines that cannot be queued are counted in ``dropped``.
- :class:`Emitter` numbers, timestamps and encodes events (through :mod:`wire.protocol`) and
  mirrors each line to the structured log (stdout/journald).

Lines that decide money (``shutdown``, ``exit``, ``setup_failed``, ``phase``) are emitted with
``sync=True``: the call returns only once the line was written and drained (or the bounded wait ran
out, which is reported as False).
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import stat
import termios
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gce_watchdog.vm.state import KeyUnavailable, SeqAllocator, load_line_key
from gce_watchdog.wire import protocol

Waiter = Callable[[], bool]


class LineSink(Protocol):
    """Where encoded lines go. Tests use :class:`MemorySink` or a real file/pty port.

    ``submit`` queues a line at once and returns a waiter that reports (for a sync line: after a
    bounded wait for the drain) whether it was written; the emitter numbers and submits lines
    under one lock, then waits outside it, so lines reach the port in sequence order.
    """

    def submit(self, line: str, sync: bool = False) -> Waiter: ...

    @property
    def dropped(self) -> int: ...


@dataclass
class MemorySink:
    """A sink that keeps lines in memory (tests, dry runs)."""

    lines: list[str] = field(default_factory=list)
    dropped: int = 0

    def submit(self, line: str, sync: bool = False) -> Waiter:
        self.lines.append(line)
        return lambda: True


@dataclass
class DiscardSink:
    """Where lines go when neither the serial device nor the fallback file can be opened: every
    line is counted as dropped (and still mirrored to the journal by the emitter), so the agent
    keeps protecting the VM instead of crash-looping over its console."""

    dropped: int = 0

    def submit(self, line: str, sync: bool = False) -> Waiter:
        self.dropped += 1
        return lambda: False


def _open_port(path: str, create: bool = False) -> tuple[int, bool]:
    """Open a tty (or an existing regular file) for appending; returns (fd, is_tty).

    The serial device is never created, nor its directory: a missing device means the console
    is unusable and the caller uses the fallback file. ``create`` is for that fallback file (its
    directory is ours: /var/log/gce-watchdog).
    """
    flags = os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC | os.O_APPEND
    if create:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o640), False
    # O_NONBLOCK for the open only (a tty waiting for carrier, a FIFO with no reader must not
    # hang us), then blocking writes in the writer thread.
    fd = os.open(path, flags | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISCHR(mode) or stat.S_ISREG(mode)):
            raise OSError(errno.EINVAL, "not a character device or a regular file")
        os.set_blocking(fd, True)
        return fd, stat.S_ISCHR(mode) and os.isatty(fd)
    except BaseException:
        os.close(fd)
        raise


class _Waiter:
    """A sync caller's ticket: set by the writer once the line was written or failed."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False


class SerialPort:
    """Threaded writer to a serial device, falling back to a file when the device is unusable."""

    def __init__(
        self,
        device: str,
        fallback: str | None = None,
        queue_size: int = 256,
        sync_timeout: float = 5.0,
    ) -> None:
        self.device = device
        self.fallback = fallback
        self.sync_timeout = sync_timeout
        self._q: queue.Queue[tuple[bytes | None, _Waiter | None]] = queue.Queue(maxsize=queue_size)
        self._dropped = 0
        self._failed_writes = 0
        self._lock = threading.Lock()
        self._fd = -1
        self._tty = False
        self.target = ""  # what we actually write to (device or fallback path)
        self.open_error = ""
        self._thread: threading.Thread | None = None

    @property
    def dropped(self) -> int:
        """Lines lost: not queued (port stalled) or failed to write."""
        with self._lock:
            return self._dropped + self._failed_writes

    def open(self) -> SerialPort:
        try:
            self._fd, self._tty = _open_port(self.device)
            self.target = self.device
        except OSError as e:
            self.open_error = f"{self.device}: {e.strerror or e}"
            if not self.fallback:
                raise
            self._fd, self._tty = _open_port(self.fallback, create=True)
            self.target = self.fallback
        self._thread = threading.Thread(target=self._run, name="serial-writer", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> SerialPort:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, line: str, sync: bool = False) -> Waiter:
        data = (line + "\n").encode("ascii", "replace")
        waiter = _Waiter() if sync else None
        try:
            self._q.put_nowait((data, waiter))
        except queue.Full:
            with self._lock:
                self._dropped += 1
            return lambda: False
        if waiter is None:
            return lambda: True
        w, timeout = waiter, self.sync_timeout
        return lambda: w.done.wait(timeout) and w.ok

    def write_line(self, line: str, sync: bool = False) -> bool:
        """Queue a line and wait for it (a sync line: its drain); the blocking form of submit."""
        return self.submit(line, sync)()

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued (bounded wait), stop the writer, close the port."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._q.put((None, None), timeout=timeout)
        self._thread.join(timeout)
        if not self._thread.is_alive() and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._thread = None

    def _run(self) -> None:
        while True:
            data, waiter = self._q.get()
            if data is None:  # close() asked us to stop
                return
            ok = self._write(data)
            if not ok:
                with self._lock:
                    self._failed_writes += 1
            if waiter is not None:  # a failed write answers at once: no waiting out the timeout
                waiter.ok = ok
                waiter.done.set()

    def _write(self, data: bytes) -> bool:
        # os.write retries EINTR itself (PEP 475); a short write on a tty is finished in a loop.
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            if self._tty:
                termios.tcdrain(self._fd)
            else:
                os.fsync(self._fd)
            return True
        except OSError:
            return False


Clock = Callable[[], float]


class Emitter:
    """Numbers, timestamps, encodes, signs and writes events; mirrors them to the structured log.

    ``key`` is the instance's private line key (``state.load_line_key``). The key announcement
    (public key, instance id ``inst``, ``eph=1`` for an ephemeral key) takes the boot's seq 0
    and 1 and every seq that is a multiple of ``protocol.ANNOUNCE_EVERY``, whichever writer
    numbers them: written before the event, never mirrored to the journal. ``key_problems``
    (a key file with a wrong mode, a state dir that cannot hold it) are written once per
    process as ``warn what=key`` after the first line. Without a key (not root) nothing can be
    signed: lines are counted in ``unsigned`` and not written, since an unsigned line would only
    be counted as forged by every reader.
    """

    def __init__(
        self,
        sink: LineSink,
        seq: SeqAllocator,
        boot: str,
        wall: Clock = time.time,
        log: Callable[..., object] | None = None,
        *,
        key: protocol.LineKey | None,
        inst: str = "-",
        key_problems: Iterable[str] = (),
    ) -> None:
        self.sink = sink
        self.seq = seq
        self.boot = boot
        self.wall = wall
        self.log = log
        self.key = key
        self.inst = inst  # the instance id the announcement binds the key to ("-": unknown)
        self.key_problems = list(key_problems)
        self.unsigned = 0
        self._order = threading.Lock()
        self.written: list[protocol.Event] = []  # last few events, for `check` and tests
        self._keep = 64

    def emit(
        self,
        event: str,
        fields: Mapping[str, object] | Iterable[tuple[str, object]] = (),
        text: str = "",
        sync: bool = False,
    ) -> protocol.Event:
        return self._emit(event, fields, text, sync)[0]

    def write(
        self,
        event: str,
        fields: Mapping[str, object] | Iterable[tuple[str, object]] = (),
        text: str = "",
    ) -> bool:
        """Emit one line synchronously; True when the port confirmed it written (drained)."""
        return self._emit(event, fields, text, True)[1]

    def _emit(
        self,
        event: str,
        fields: Mapping[str, object] | Iterable[tuple[str, object]],
        text: str,
        sync: bool,
    ) -> tuple[protocol.Event, bool]:
        # Number and queue under one lock (threads of one process reach the port in seq order);
        # wait for a sync line's drain outside it, so no other thread waits on our drain.
        with self._order:
            ts_ms = int(self.wall() * 1000)
            if self.key is None:
                # Nothing can be signed: no seq is taken either (seq 0 must stay for the writer
                # that can announce the key).
                ev = protocol.make_event(event, self.boot, 0, ts_ms, fields, text)
                self.unsigned += 1
                waiter: Waiter = lambda: False  # noqa: E731
            else:
                n = self.seq.next()
                while protocol.needs_announcement(n):
                    # The announcement; never mirrored to the journal.
                    line = protocol.key_line(self.boot, n, ts_ms, self.key, self.inst)
                    self.sink.submit(line, sync=sync)
                    n = self.seq.next()
                ev = protocol.make_event(event, self.boot, n, ts_ms, fields, text)
                waiter = self.sink.submit(protocol.encode(ev, self.key), sync=sync)
        ok = waiter()
        if self.key_problems and event != "warn":
            problems, self.key_problems = self.key_problems, []
            self._emit("warn", {"what": "key"}, "; ".join(problems), sync)
        self.written.append(ev)
        del self.written[: -self._keep]
        if self.log is not None:
            self.log(event, serial_ok=ok, seq=ev.seq, text=ev.text or None, **ev.fields_dict)
        return ev, ok


def open_emitter(
    device: str,
    fallback: str | None,
    state_dir: str,
    run_dir: str,
    boot: str,
    queue_size: int = 256,
    sync_timeout: float = 5.0,
    log: Callable[..., object] | None = None,
) -> tuple[Emitter, SerialPort]:
    """Wire a real port and emitter (for `main()`-style callers); caller closes the port."""
    port = SerialPort(device, fallback, queue_size, sync_timeout).open()
    key, problems = key_or_none(state_dir, run_dir)
    inst = cached_instance_id(state_dir)
    emitter = Emitter(
        port, SeqAllocator(run_dir, boot), boot, log=log, key=key, inst=inst, key_problems=problems
    )
    return emitter, port


def cached_instance_id(state_dir: str) -> str:
    """The instance id from the metadata watcher's identity cache (``instance.json``), or
    ``-``. Read as text, bounded, never raises: the announcement only carries it."""
    import json

    try:
        fd = os.open(Path(state_dir) / "instance.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            obj = json.loads(f.read(4096))
        iid = str(obj.get("id", "")) if isinstance(obj, dict) else ""
    except (OSError, ValueError):
        return "-"
    return iid if iid.isdigit() and len(iid) <= 20 else "-"


def key_or_none(state_dir: str, run_dir: str) -> tuple[protocol.LineKey | None, list[str]]:
    """The line key and its problems, or None with a warning on stderr (not root: lines then
    cannot be written)."""
    import sys

    try:
        ks = load_line_key(state_dir, run_dir)
    except KeyUnavailable as e:
        print(f"gce-watchdog: no line key, serial lines are not written: {e}", file=sys.stderr)
        return None, []
    for p in ks.problems:
        print(f"gce-watchdog: line key: {p}", file=sys.stderr)
    return protocol.LineKey(ks.seed, ks.ephemeral), ks.problems
