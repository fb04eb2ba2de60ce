"""Kernel log records from ``/dev/kmsg``: the parser (pure) and the reader (the edge).

The record format is the kernel's ABI (``Documentation/ABI/testing/dev-kmsg``):

    PRI,SEQ,USEC,FLAGS[,more fields];MESSAGE\\n
    [ KEY=VALUE\\n ...]            (continuation lines: each starts with one space)

``PRI`` holds facility and level (``facility = PRI >> 3``, ``level = PRI & 7``). ``SEQ`` rises by
one per record within a boot; a gap means records were overwritten, and a read after such an
overrun fails with ``EPIPE`` once. Non-printable bytes in MESSAGE arrive escaped as ``\\xNN``.
Writes from user space come back with facility 1 (``LOG_USER``) whatever priority they ask for
(kernel/printk/printk.c, ``devkmsg_write``: ``facility = 1``, only the level is taken from a
``<N>`` prefix), so a reader that accepts facility 0 only cannot be fooled by ``logger`` or the
workload (tests/root/test_kmsg.py proves it on the real device).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

KERNEL_FACILITY = 0
# One read returns one record; the kernel's own buffer for a read is 8 KiB (``devkmsg_user.buf``,
# kernel/printk/printk.c), so a larger buffer never returns more.
READ_SIZE = 8192


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    """One record: ``facility``/``level`` from PRI, ``seq``, ``usec`` (monotonic), the message."""

    facility: int
    level: int
    seq: int
    usec: int
    message: str

    @property
    def from_kernel(self) -> bool:
        return self.facility == KERNEL_FACILITY


def parse_record(raw: bytes) -> KmsgRecord | None:
    """The record in ``raw`` (one read's bytes), or None when it does not follow the ABI.

    Continuation lines (``KEY=VALUE`` after a leading space) are dropped: the message is the text
    between the first ``;`` and the first newline.
    """
    head, sep, rest = raw.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 4:
        return None
    pri_b, seq_b, usec_b = fields[0], fields[1], fields[2]
    if not (pri_b.isdigit() and seq_b.isdigit() and usec_b.isdigit()):
        return None
    if len(pri_b) > 4 or len(seq_b) > 20 or len(usec_b) > 20:
        return None
    pri = int(pri_b)
    message = rest.split(b"\n", 1)[0].decode("utf-8", errors="replace")
    return KmsgRecord(pri >> 3, pri & 7, int(seq_b), int(usec_b), message)


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """What one drain of the device returned: the records, and how many were lost (EPIPE/gaps)."""

    records: tuple[KmsgRecord, ...]
    lost: int
    overruns: int


class KmsgReader:
    """Reads new records from ``/dev/kmsg`` (or a file or FIFO of such records), never blocking.

    ``open(from_start=False)`` seeks to the end (``SEEK_END``: only records written from now on);
    ``from_start=True`` replays the buffer (``SEEK_DATA``). ``drain()`` reads until the source has
    nothing more (``EAGAIN`` or end of file) or ``max_records`` were read, so one call is bounded.
    The device returns one record per read; a file or FIFO returns any bytes, so for those whole
    lines are cut out of a bounded buffer (a line longer than :data:`READ_SIZE` is dropped).
    """

    def __init__(self, path: str, *, max_records: int = 10_000) -> None:
        self.path = path
        self.max_records = max_records
        self._fd: int | None = None
        self._device = False
        self._pending = b""
        self._last_seq: int | None = None

    def open(self, *, from_start: bool = False) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            self._device = stat.S_ISCHR(mode)
            if self._device:
                os.lseek(fd, 0, os.SEEK_DATA if from_start else os.SEEK_END)
            elif stat.S_ISREG(mode) and not from_start:
                os.lseek(fd, 0, os.SEEK_END)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def drain(self) -> ReadBatch:
        if self._fd is None:
            raise RuntimeError("KmsgReader.drain() before open()")
        out: list[KmsgRecord] = []
        lost = overruns = 0
        for raw in self._reads():
            if raw is None:  # EPIPE: the kernel overwrote records we had not read yet
                overruns += 1
                continue
            rec = parse_record(raw)
            if rec is None:
                continue
            if self._last_seq is not None and rec.seq > self._last_seq + 1:
                lost += rec.seq - self._last_seq - 1
            self._last_seq = rec.seq
            out.append(rec)
            if len(out) >= self.max_records:
                break
        return ReadBatch(tuple(out), lost, overruns)

    def _reads(self) -> Iterator[bytes | None]:
        assert self._fd is not None
        for _ in range(self.max_records):
            try:
                raw = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                return
            except BrokenPipeError:
                yield None
                continue
            if not raw:
                return
            if self._device:
                yield raw
                continue
            buf = self._pending + raw
            lines = buf.split(b"\n")
            self._pending = lines.pop()
            if len(self._pending) > READ_SIZE:
                self._pending = b""
            for line in lines:
                if line and not line.startswith(b" "):  # continuation lines carry no message
                    yield line
