"""Writing protocol lines to the serial console.

- :class:`SerialPort` is the edge: one writer thread takes lines in order from a bounded queue and
  writes each with non-blocking ``write()`` calls (``poll()`` between them), then ``tcdrain`` on a
  tty. A port that stops taking data (XOFF, nobody reading) never stalls the caller: lines wait in
  the queue, in order, and go out when the port moves again. Lines that cannot be queued, or whose
  write failed for good, are counted in ``dropped``.
- The writer survives a hangup: on EIO, EBADF, ENXIO or ENODEV it reopens the device and writes
  the line again, after each pause of :data:`REOPEN_PAUSES` (about 2.75 s in all per line), each
  try counted in ``reopens``.
- :class:`Emitter` numbers, timestamps and encodes events (through :mod:`wire.protocol`) and
  mirrors each line to the structured log (stdout/journald).

Lines that decide money (``shutdown``, ``exit``, ``setup_failed``, ``phase``) are emitted with
``sync=True``: the call returns once the line was written and drained (True), or when the wait
ran out (False; the line stays queued and is still written, in order, when the port moves). The
wait is bounded twice: at most ``sync_timeout`` in all, and it ends as soon as the port has made no
progress (no byte taken by the tty, none sent from its output queue) for :data:`STALL_GRACE`
seconds; while the port stays stalled, later sync lines do not
wait at all. So a console held under XOFF costs the tick loop and the shutdown chain about
:data:`STALL_GRACE` once, not ``sync_timeout`` per line (docs/serial-protocol.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import select
import stat
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gce_watchdog.vm.bootcount import WARN_TEXT, BootCount, BootCounter
from gce_watchdog.vm.state import (
    KEY_FILE,
    KeyUnavailable,
    SeqAllocator,
    key_identity,
    load_line_key,
    read_key_file,
)
from gce_watchdog.wire import protocol

Waiter = Callable[[], bool]

# A hung-up tty: every other open file description gets the kernel's hung_up_tty_fops, whose
# write and ioctl (so tcdrain) fail with EIO while a fresh open works (linux drivers/tty/tty_io.c
# hung_up_tty_write, hung_up_tty_ioctl; vhangup(2)). EBADF: our descriptor is gone. ENXIO, ENODEV:
# the device went away (a reopen may find it back).
REOPEN_ERRNOS = frozenset({errno.EIO, errno.EBADF, errno.ENXIO, errno.ENODEV})
# How long a line keeps being written again after hangups before it is given up (and counted as
# dropped): the pauses before each reopen, doubling from 50 ms up to 0.5 s, 2.75 s in all. The
# console is hung up at every getty start (serial-getty@.service: TTYVHangup=yes; agetty itself
# only with --hangup), at every serial-console login (util-linux login(1) vhangup()s its tty) and
# logout (the session leader's exit hangs up a controlling tty that is not a pty: linux
# drivers/tty/tty_jobctrl.c disassociate_ctty), and systemd hangs it up again when the getty
# exits and when it restarts (Restart=always; systemd commit 6ea832a2 "hangup/reset/deallocate
# VTs in gettys": before and after the getty runs). So a logout is a burst of hangups, and one
# line can meet several of them. A count of tries is no bound on a loaded machine, where the
# burst spreads out (a loaded TCG guest: getty stopped and started 0.21 s apart, after the
# logout's own hangup), so the budget is time: longer than a loaded getty restart, short enough
# that a device gone for good costs each line a few seconds of the writer thread, never the
# tick loop (sync waits end after STALL_GRACE without progress).
REOPEN_PAUSE = 0.05  # seconds before the first reopen of a line
REOPEN_PAUSE_MAX = 0.5  # the pause doubles after each try up to this
REOPEN_WINDOW = 3.0  # the pauses of one line add up to at most this


def reopen_pauses(
    first: float = REOPEN_PAUSE, cap: float = REOPEN_PAUSE_MAX, window: float = REOPEN_WINDOW
) -> tuple[float, ...]:
    """The pause before each reopen of one line: doubling from ``first`` up to ``cap``, as many
    as fit in ``window`` (pure; at least one; at most ``window / min(first, cap)`` + 1)."""
    pauses: list[float] = []
    pause, total = first, 0.0
    while total + pause <= window:
        pauses.append(pause)
        total += pause
        pause = min(pause * 2, cap)
    return tuple(pauses) or (window,)


REOPEN_PAUSES = reopen_pauses()
# A sync wait ends once the port made no progress (no byte taken) for this long.
STALL_GRACE = 1.0
# Sync lines are accepted this far beyond queue_size: a full queue of old heartbeats must not
# cost the shutdown line.
SYNC_RESERVE = 64
_POLL_SLICE_MS = 250  # the writer's poll() slice: it notices close() within this
_DRAIN_POLL = 0.02  # seconds between two looks at a tty's output queue while it drains


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
    reopens: int = 0

    def submit(self, line: str, sync: bool = False) -> Waiter:
        self.lines.append(line)
        return lambda: True


@dataclass
class DiscardSink:
    """Where lines go when neither the serial device nor the fallback file can be opened: every
    line is counted as dropped (and still mirrored to the journal by the emitter), so the agent
    keeps protecting the VM instead of crash-looping over its console."""

    dropped: int = 0
    reopens: int = 0

    def submit(self, line: str, sync: bool = False) -> Waiter:
        self.dropped += 1
        return lambda: False


def _open_port(path: str, create: bool = False) -> tuple[int, bool]:
    """Open a tty (or an existing regular file) for appending, non-blocking; returns (fd, is_tty).

    The serial device is never created, nor its directory: a missing device means the console
    is unusable and the caller uses the fallback file. ``create`` is for that fallback file (its
    directory is ours: /var/log/gce-watchdog). O_NONBLOCK: a tty waiting for carrier must not hang
    the open, and a tty under XOFF must not hang a write (the writer polls instead). O_NOCTTY: the
    agent never takes the console as its controlling terminal (a hangup would signal it).
    """
    flags = os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC | os.O_APPEND | os.O_NONBLOCK
    if create:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o640), False
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISCHR(mode) or stat.S_ISREG(mode)):
            raise OSError(errno.EINVAL, "not a character device or a regular file")
        return fd, stat.S_ISCHR(mode) and os.isatty(fd)
    except BaseException:
        os.close(fd)
        raise


def _errno_of(e: Exception) -> int | None:
    """termios.error is not an OSError: its errno is args[0]."""
    if isinstance(e, OSError):
        return e.errno
    return e.args[0] if e.args and isinstance(e.args[0], int) else None


class _Abandoned(Exception):
    """close() gave up on the lines still queued: the writer stops."""


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
        stall_grace: float = STALL_GRACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = device
        self.fallback = fallback
        self.queue_size = queue_size
        self.sync_timeout = sync_timeout
        self.stall_grace = stall_grace
        self.clock = clock
        self._items: deque[tuple[bytes, _Waiter | None]] = deque()  # [0]: being written
        self._cond = threading.Condition()
        self._abandon = threading.Event()
        self._closing = False
        # When the port last moved: a byte taken or sent, a line done, or a line queued while
        # the writer was idle. Sync waits end STALL_GRACE after it.
        self._progress_at = 0.0
        self._dropped = 0  # not queued: the queue was full
        self._failed_writes = 0  # given up: a write error, or no reopen helped
        self._lost_at_close = 0  # still queued when close() gave up on them
        self._reopens = 0
        self._late = 0  # sync waits that ended before their line was written
        self._fd = -1
        self._tty = False
        self._create = False
        self.target = ""  # what we actually write to (device or fallback path)
        self.open_error = ""
        self._thread: threading.Thread | None = None

    @property
    def dropped(self) -> int:
        """Lines lost: not queued (queue full), failed to write, or still queued at close."""
        with self._cond:
            return self._dropped + self._failed_writes + self._lost_at_close

    @property
    def reopens(self) -> int:
        """Reopens of the port after a hangup or a lost descriptor (each attempt counts)."""
        with self._cond:
            return self._reopens

    @property
    def late(self) -> int:
        """Sync waits that ended (stall or timeout) before their line was written."""
        with self._cond:
            return self._late

    def open(self) -> SerialPort:
        try:
            self._fd, self._tty = _open_port(self.device)
            self.target = self.device
        except OSError as e:
            self.open_error = f"{self.device}: {e.strerror or e}"
            if not self.fallback:
                raise
            self._fd, self._tty = _open_port(self.fallback, create=True)
            self.target, self._create = self.fallback, True
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
        with self._cond:
            limit = self.queue_size + (SYNC_RESERVE if sync else 0)
            if self._closing or len(self._items) >= limit:
                self._dropped += 1
                return lambda: False
            if not self._items:  # the writer was idle: its progress clock starts now
                self._progress_at = self.clock()
            self._items.append((data, waiter))
            self._cond.notify_all()
        if waiter is None:
            return lambda: True
        w = waiter
        return lambda: self._wait(w)

    def _wait(self, w: _Waiter) -> bool:
        deadline = self.clock() + self.sync_timeout
        while not w.done.is_set():
            now = self.clock()
            with self._cond:
                limit = min(deadline, self._progress_at + self.stall_grace)
                if now >= limit:
                    self._late += 1
                    return False
            w.done.wait(limit - now)
        return w.ok

    def write_line(self, line: str, sync: bool = False) -> bool:
        """Queue a line and wait for it (a sync line: its drain); the blocking form of submit."""
        return self.submit(line, sync)()

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued (bounded wait), stop the writer, close the port. Lines the port
        did not take within ``timeout`` are counted in ``dropped``."""
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():  # stalled (XOFF, nobody reading): give the rest up
            with self._cond:
                self._abandon.set()
                self._lost_at_close += len(self._items)
                for _, waiter in self._items:
                    if waiter is not None:
                        waiter.done.set()
                self._items.clear()
                self._cond.notify_all()
            self._thread.join(_POLL_SLICE_MS / 1000 * 2)
        if not self._thread.is_alive() and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closing:
                    self._cond.wait()
                if not self._items or self._abandon.is_set():
                    return  # closing, and everything was written
                data, waiter = self._items[0]
            try:
                ok = self._write_line(data)
            except _Abandoned:
                return  # close() counted this line and the rest
            with self._cond:
                if self._abandon.is_set():
                    return
                self._items.popleft()
                if ok:  # a line that failed is no progress: waiters behind it must not wait on
                    self._progress_at = self.clock()
                else:
                    self._failed_writes += 1
            if waiter is not None:  # a failed write answers at once: no waiting out the timeout
                waiter.ok = ok
                waiter.done.set()

    def _write_line(self, data: bytes) -> bool:
        """Write one line and drain it; reopen and write it again after a hangup (bounded)."""
        attempt = 0
        out = data
        while True:
            try:
                self._write_all(out)
                self._drain()
                return True
            except _PartialWrite as e:
                code: int | None = e.errno
                # Part of the line is out: the copy starts on a line of its own, so the fragment
                # is one rejected line and the copy an intact one (not one broken line).
                out = b"\n" + data
            except (OSError, termios.error) as e:
                # (A tcdrain that failed after the whole line was taken: the line may be out
                # already; it is written again and the reader drops the duplicate.)
                code = _errno_of(e)
            if code not in REOPEN_ERRNOS:
                return False
            while True:
                if attempt >= len(REOPEN_PAUSES):
                    return False
                pause = REOPEN_PAUSES[attempt]
                attempt += 1
                with self._cond:
                    self._reopens += 1
                if self._abandon.wait(pause):
                    raise _Abandoned
                if self._reopen():
                    break

    def _reopen(self) -> bool:
        old, self._fd = self._fd, -1
        if old >= 0:
            with contextlib.suppress(OSError):
                os.close(old)
        try:
            self._fd, self._tty = _open_port(self.target, create=self._create)
            return True
        except OSError:
            return False

    def _write_all(self, data: bytes) -> None:
        """Write all of ``data``: non-blocking writes, poll() while the port takes nothing.
        An error after some bytes were taken is raised as :class:`_PartialWrite`."""
        view = memoryview(data)
        sent = 0
        busy = 0
        while view:
            if self._abandon.is_set():
                raise _Abandoned
            try:
                n = os.write(self._fd, view)  # EINTR is retried by os.write itself (PEP 475)
            except BlockingIOError:
                busy += 1
                self._await_room(busy)
                continue
            except OSError as e:
                if sent:
                    raise _PartialWrite(e, sent) from e
                raise
            busy = 0
            if n > 0:
                sent += n
                view = view[n:]
                with self._cond:
                    self._progress_at = self.clock()

    def _await_room(self, busy: int) -> None:
        p = select.poll()
        p.register(self._fd, select.POLLOUT)
        ready = p.poll(_POLL_SLICE_MS)
        if ready and busy > 1:
            # poll() said writable but write() keeps refusing: do not spin.
            self._abandon.wait(_POLL_SLICE_MS / 1000 / 5)

    def _drain(self) -> None:
        """Wait until the tty sent what it holds: poll its output queue (TIOCOUTQ), which
        shrinks while bytes leave (progress) and stays put under XOFF (a stall the sync waiters
        see), then tcdrain for the rest (the UART's FIFO: a few bytes). A file: fsync."""
        if not self._tty:
            os.fsync(self._fd)
            return
        last = -1
        while True:
            try:
                queued = struct.unpack("i", fcntl.ioctl(self._fd, termios.TIOCOUTQ, b"\0" * 4))[0]
            except OSError as e:
                if e.errno in REOPEN_ERRNOS:
                    raise
                break  # no output queue to read: tcdrain alone
            if queued <= 0:
                break
            if last < 0 or queued < last:
                with self._cond:
                    self._progress_at = self.clock()
            last = queued
            if self._abandon.wait(_DRAIN_POLL):
                raise _Abandoned
        termios.tcdrain(self._fd)


class _PartialWrite(OSError):
    """A write error after part of the line was taken."""

    def __init__(self, e: OSError, sent: int) -> None:
        super().__init__(e.errno, e.strerror)
        self.sent = sent


Clock = Callable[[], float]


class KeyFollower:
    """Follows a rotation of the durable key file (``gce-watchdog key --rotate``): the running
    agent (and any writer) picks the new key up on its next line, with no signal and no
    restart. ``changed()`` costs one ``stat``: the file's (device, inode) changes only when a
    rotation renames the new key over it. A key file that went away or became unusable is not
    followed (the key in hand stays: it never changes silently)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._ident: tuple[int, int] | None = None  # the first look reads the file once

    def changed(self) -> protocol.LineKey | None:
        """The new key when the file is another one than last time, else None."""
        ident = key_identity(self.path)
        if ident is None or ident == self._ident:
            return None
        try:
            seed, ident = read_key_file(self.path)
        except PermissionError:
            return None
        if seed is None:
            return None
        self._ident = ident
        return protocol.LineKey(seed)


# The journal mirror (vm.logs.mirror): the event's name, then its full fields as a mapping
# (serial_ok, seq, text and the line's own fields; any names, `event` included).
LogMirror = Callable[[str, Mapping[str, object]], object]


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

    ``count``: the boot counter (:mod:`vm.bootcount`), carried by every line as ``bc`` (last
    field, never shortened) and, with the full boot id ``bid``, by the announcement; when it
    is ``-`` its reason is written once per process as ``warn what=bootcount``. None: no
    ``bc`` field (test sinks, writers from before the counter).
    """

    def __init__(
        self,
        sink: LineSink,
        seq: SeqAllocator,
        boot: str,
        wall: Clock = time.time,
        log: LogMirror | None = None,
        *,
        key: protocol.LineKey | None,
        inst: str = "-",
        key_problems: Iterable[str] = (),
        follow: KeyFollower | None = None,
        count: BootCount | None = None,
        boot_id: str | None = None,
    ) -> None:
        self.sink = sink
        self.follow = follow  # the durable key file, followed across a rotation
        self.seq = seq
        self.boot = boot
        self.wall = wall
        self.log = log
        self.key = key
        self.inst = inst  # the instance id the announcement binds the key to ("-": unknown)
        self.key_problems = list(key_problems)
        self.bc = count.value if count is not None else None
        # the full boot id, for the announcement (anything but 32 hex is not written)
        self.bid = boot_id if boot_id is not None and protocol.valid_bid(boot_id) else None
        self._bc_problem = count.problem if count is not None and count.value == "-" else ""
        self._fixed: tuple[tuple[str, str], ...] = (
            ((protocol.BC_FIELD, self.bc),) if self.bc is not None else ()
        )
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
        fields = list(fields.items() if isinstance(fields, Mapping) else fields)  # read twice
        with self._order:
            ts_ms = int(self.wall() * 1000)
            if self.key is None:
                # Nothing can be signed: no seq is taken either (seq 0 must stay for the writer
                # that can announce the key).
                ev = protocol.make_event(event, self.boot, 0, ts_ms, fields, text, self._fixed)
                self.unsigned += 1
                waiter: Waiter = lambda: False  # noqa: E731
            else:
                n = self.seq.next()
                # After taking the seq: a rotation renames the new key in while it holds the
                # counter's lock, so every seq after the rekey line's sees the new file here.
                fresh = self.follow.changed() if self.follow is not None else None
                if fresh is not None and fresh.public != self.key.public:
                    self.key = fresh
                    line = self._announcement(n, ts_ms)
                    self.sink.submit(line, sync=sync)  # the new key, announced at once
                    n = self.seq.next()
                while protocol.needs_announcement(n):
                    # The announcement; never mirrored to the journal.
                    line = self._announcement(n, ts_ms)
                    self.sink.submit(line, sync=sync)
                    n = self.seq.next()
                ev = protocol.make_event(event, self.boot, n, ts_ms, fields, text, self._fixed)
                waiter = self.sink.submit(protocol.encode(ev, self.key), sync=sync)
        ok = waiter()
        if self.key_problems and event != "warn":
            problems, self.key_problems = self.key_problems, []
            self._emit("warn", {"what": "key"}, "; ".join(problems), sync)
        if self._bc_problem and event != "warn":
            why, self._bc_problem = self._bc_problem, ""
            self._emit("warn", {"what": "bootcount"}, WARN_TEXT.format(why=why), sync)
        self.written.append(ev)
        del self.written[: -self._keep]
        if self.log is not None:
            self.log(event, _mirrored(ev, ok, fields, text))
        return ev, ok

    def _announcement(self, n: int, ts_ms: int) -> str:
        assert self.key is not None
        return protocol.key_line(self.boot, n, ts_ms, self.key, self.inst, self.bc, self.bid)


# What the journal gets of a text or a value: all of it (the serial line's text is cut at
# protocol.MAX_TEXT, its values at MAX_VALUE), up to a bound that keeps an entry one datagram.
MIRROR_MAX = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _mirrored(
    ev: protocol.Event, ok: bool, fields: Iterable[tuple[str, object]], text: str
) -> dict[str, object]:
    """The journal's copy of a line: the full text and values the caller gave (control
    characters replaced), not the serial line's shortened ones."""
    full = {k: protocol.sanitize_value(v, MIRROR_MAX) for k, v in fields}
    clean = _CONTROL.sub(" ", text)[:MIRROR_MAX].strip()
    return {"serial_ok": ok, "seq": ev.seq, "text": clean or None, **full}


def open_emitter(
    device: str,
    fallback: str | None,
    state_dir: str,
    run_dir: str,
    boot: str,
    queue_size: int = 256,
    sync_timeout: float = 5.0,
    log: LogMirror | None = None,
    boot_id: str | None = None,
    count_state: bool = True,
) -> tuple[Emitter, SerialPort]:
    """Wire a real port and emitter (for `main()`-style callers); caller closes the port.
    ``boot_id``: the full kernel boot id (32 hex) the boot counter and the announcement's
    ``bid`` use (None: ``boot`` padded, for callers that know only the short form).
    ``count_state`` False: ``state_dir`` is not the instance's (the agent's private one for an
    untrusted state dir): the boot is not counted there (:func:`boot_count`)."""
    port = SerialPort(device, fallback, queue_size, sync_timeout).open()
    full = ((boot_id or boot) + "0" * 32)[:32]
    count, key, problems = count_then_key(state_dir, run_dir, full, count_state)
    inst = cached_instance_id(state_dir)
    emitter = Emitter(
        port,
        SeqAllocator(run_dir, boot),
        boot,
        log=log,
        key=key,
        inst=inst,
        key_problems=problems,
        follow=follower(state_dir, key),
        count=count,
        boot_id=full,
    )
    return emitter, port


def boot_count(state_dir: str | None, run_dir: str, boot_id: str) -> BootCount:
    """This boot's counter (:class:`vm.bootcount.BootCounter`). Resolve it **before** the line
    key is loaded: on the instance's first boot the key is created by the first line, and a
    key that exists without ``boot.count`` means the counter was lost. ``state_dir`` None: no
    trusted state dir (the boot's cached value, else ``-``)."""
    return BootCounter(state_dir, run_dir, boot_id).get()


def count_then_key(
    state_dir: str, run_dir: str, boot_id: str, count_state: bool = True
) -> tuple[BootCount, protocol.LineKey | None, list[str]]:
    """This boot's counter (:func:`boot_count`; ``count_state`` False: not kept in
    ``state_dir``, which is not the instance's), then the line key and its problems
    (:func:`key_or_none`): in that order, the one place every emitter's are resolved."""
    count = boot_count(state_dir if count_state else None, run_dir, boot_id)
    key, problems = key_or_none(state_dir, run_dir)
    return count, key, problems


def follower(state_dir: str, key: protocol.LineKey | None) -> KeyFollower | None:
    """A :class:`KeyFollower` of the durable key file, for a durable key (an ephemeral one is
    never rotated)."""
    if key is None or key.ephemeral:
        return None
    return KeyFollower(Path(state_dir) / KEY_FILE)


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
