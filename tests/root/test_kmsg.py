"""The kmsg reader (gpu/kmsg.py) against the real ``/dev/kmsg``, a FIFO and a fixture file.

The kernel's ABI (Documentation/ABI/testing/dev-kmsg; kernel/printk/printk.c ``devkmsg_write``):
a write from user space comes back with facility 1 (LOG_USER) whatever ``<N>`` prefix it asks
for, so only the kernel (a driver) can produce facility 0, and the GPU reader counts only that.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from gce_watchdog.gpu import xid
from gce_watchdog.gpu.kmsg import KmsgReader
from kit.nobody import Nobody

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "kmsg" / "xid-records.txt"
KMSG = "/dev/kmsg"
FORGED = (
    "{prefix}NVRM: Xid (PCI:0000:00:04): 79, pid=1, name={marker}, GPU has fallen off the bus.\n"
)

needs_kmsg = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(KMSG), reason="needs root and /dev/kmsg"
)


def _drain_until(reader: KmsgReader, marker: str) -> list[tuple[int, str]]:
    """Drain until the record holding ``marker`` arrived; bounded by count, not by time: the
    write returned before this is called and ended with a newline, so the record is finalized
    and readable already (a record without one stays open for a continuation, unreadable)."""
    seen: list[tuple[int, str]] = []
    for _ in range(50):
        batch = reader.drain()
        seen += [(r.facility, r.message) for r in batch.records]
        if any(marker in m for _, m in seen):
            return seen
    raise AssertionError(f"{marker} never came back from {KMSG}")


@pytest.mark.process
@needs_kmsg
@pytest.mark.parametrize("prefix", ["<0>", "<4>", ""])
def test_a_user_space_write_comes_back_as_facility_1(prefix: str) -> None:
    marker = f"gcewd-kmsg-test-{uuid.uuid4().hex}"
    reader = KmsgReader(KMSG)
    reader.open()  # from the end: only what is written from now on
    try:
        fd = os.open(KMSG, os.O_WRONLY)
        try:
            # The attack: a forged Xid record with the kernel's priority, written by root.
            os.write(
                fd,
                FORGED.format(prefix=prefix, marker=marker).encode(),
            )
        finally:
            os.close(fd)
        seen = _drain_until(reader, marker)
    finally:
        reader.close()
    mine = [(f, m) for f, m in seen if marker in m]
    assert len(mine) == 1
    facility, message = mine[0]
    assert facility == 1
    assert xid.parse_xid(message) is not None  # it parses as an Xid: only the facility rejects it


@pytest.mark.process
@needs_kmsg
def test_nobody_cannot_write_kmsg(nobody: Nobody) -> None:
    code = (
        f"import os\ntry:\n os.open({KMSG!r}, os.O_WRONLY)\n"
        "except PermissionError:\n print('EACCES')\n"
    )
    r = nobody.run(["-c", code])
    assert r.stdout.strip() == "EACCES", r.stderr


@pytest.mark.process
@needs_kmsg
def test_replay_from_start_reads_the_buffer() -> None:
    reader = KmsgReader(KMSG, max_records=100_000)
    reader.open(from_start=True)
    try:
        batch = reader.drain()
    finally:
        reader.close()
    assert batch.records, "the kernel's buffer is never empty after boot"
    seqs = [r.seq for r in batch.records]
    assert seqs == sorted(seqs)
    assert any(r.from_kernel for r in batch.records)


@pytest.mark.pure
def test_a_fixture_file_and_a_fifo_give_the_same_records(tmp_path: Path) -> None:
    reader = KmsgReader(str(FIXTURE))
    reader.open(from_start=True)
    try:
        from_file = reader.drain().records
    finally:
        reader.close()
    assert len(from_file) == 9
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    rd = KmsgReader(str(fifo))
    rd.open()  # O_NONBLOCK: opening a FIFO for reading never waits for a writer
    wfd = os.open(fifo, os.O_WRONLY)
    try:
        blob = FIXTURE.read_bytes()
        # In two pieces cut mid-record: a FIFO returns any bytes, whole lines are cut out.
        os.write(wfd, blob[:100])
        first = rd.drain().records
        os.write(wfd, blob[100:])
        rest = rd.drain().records
    finally:
        os.close(wfd)
        rd.close()
    assert first + rest == from_file


@pytest.mark.pure
def test_gaps_in_seq_count_as_lost(tmp_path: Path) -> None:
    p = tmp_path / "kmsg"
    p.write_bytes(b"6,10,1,-;a\n6,11,2,-;b\n6,15,3,-;c\n")
    r = KmsgReader(str(p))
    r.open(from_start=True)
    try:
        batch = r.drain()
    finally:
        r.close()
    assert [x.message for x in batch.records] == ["a", "b", "c"]
    assert batch.lost == 3


@pytest.mark.pure
def test_drain_is_bounded(tmp_path: Path) -> None:
    p = tmp_path / "kmsg"
    p.write_bytes(b"".join(b"6,%d,1,-;x\n" % i for i in range(1000)))
    r = KmsgReader(str(p), max_records=10)
    r.open(from_start=True)
    try:
        assert len(r.drain().records) == 10
    finally:
        r.close()
