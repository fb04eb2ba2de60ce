"""Reading serial port 1 through the Compute API, incrementally and resumably.

The reads go through the one Compute API client, :class:`gce_watchdog.lib.compute.ComputeClient`
(timeouts, retries on rate limits and transient errors). :class:`SerialReader` keeps one
:class:`Cursor` per instance (the API's ``next`` offset, the unterminated last line, the
timeline) in a JSON file, through :class:`CursorStore`, so a restarted poller resumes where it
stopped.

Reader semantics (``docs/poller.md`` has the long form):

- Each read asks for ``start = cursor.offset``; the new offset is the response's ``next``. In
  steady state every byte is fetched exactly once.
- A console line split across two reads: the bytes after the last newline are held in the
  cursor (``pending``, persisted) and prefixed to the next read, so the line is decoded once,
  whole. We hold the bytes rather than re-reading from the line's start because re-reading
  would fetch the same bytes again on every poll of a VM that writes no newline.
- ``start`` beyond the requested offset: the API dropped those bytes (1 MiB window). They are
  counted as a byte gap; the held partial line is decoded alone (its rest is gone, so a line of
  ours in it is rejected, not misread).
- ``next`` below the requested offset: the port's buffer restarted (a recreated instance). The
  reader starts again from 0 and counts a reset. A different instance id under the same name
  also starts a fresh cursor.
"""

from __future__ import annotations

import base64
import json
import os
import random
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gce_watchdog.lib.compute import ComputeClient, SerialChunk
from gce_watchdog.lib.files import atomic_write
from gce_watchdog.poller.boots import Record
from gce_watchdog.poller.freshness_store import FreshnessStore
from gce_watchdog.poller.pin_store import PinStore
from gce_watchdog.poller.timeline import Timeline
from gce_watchdog.wire.protocol import pk_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    pass

# StreamDecoder.MAX_PENDING: a console line longer than this is not ours; keep only its tail.
MAX_PENDING = 64 * 1024
# -- cursors and the incremental reader --------------------------------------------------------


@dataclass
class Cursor:
    """Everything needed to resume reading one instance."""

    name: str
    instance_id: str = ""
    offset: int = 0  # the next byte to ask for: the API's `next` from the last read
    pending: bytes = b""  # bytes after the last newline, joined to the next read
    fetched_bytes: int = 0  # contents bytes received, over the cursor's life
    new_bytes: int = 0  # bytes the offset advanced by (new output), over the cursor's life;
    # fetched_bytes == new_bytes - lost bytes when nothing is ever read twice
    reads: int = 0
    timeline: Timeline = field(default_factory=Timeline)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "name": self.name,
            "instance_id": self.instance_id,
            "offset": self.offset,
            "pending": base64.b64encode(self.pending).decode(),
            "fetched_bytes": self.fetched_bytes,
            "new_bytes": self.new_bytes,
            "reads": self.reads,
            "timeline": self.timeline.to_json(),
        }

    @classmethod
    def from_json(cls, obj: Any) -> Cursor:
        """Raises ValueError (or KeyError/TypeError) when the document is not a cursor."""
        if not isinstance(obj, dict) or obj.get("version") != 1:
            raise ValueError("not a version 1 cursor")
        return cls(
            name=str(obj["name"]),
            instance_id=str(obj["instance_id"]),
            offset=int(obj["offset"]),
            pending=base64.b64decode(obj["pending"]),
            fetched_bytes=int(obj["fetched_bytes"]),
            new_bytes=int(obj["new_bytes"]),
            reads=int(obj["reads"]),
            timeline=Timeline.from_json(obj["timeline"]),
        )


def untrusted(st: os.stat_result, euid: int) -> str | None:
    """Why a cursor directory or file must not be trusted, or None: owned by another user (not
    this one, not root), or writable by group or others. Someone else could have written a cursor
    there: an offset past a ``shutdown`` line hides it, a planted timeline decides for it. The
    same rule as the agent's state directory (``vm.state.untrusted_dir``), for any user."""
    if st.st_uid not in (euid, 0):
        return f"is owned by uid {st.st_uid}, not by this user ({euid}) or root"
    if st.st_mode & 0o022:
        who = " and ".join(
            w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit
        )
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class CursorStore:
    """One JSON file per instance in a directory (``None``: keep cursors in memory only).

    The directory is created private (0700) if missing; an untrusted one (:func:`untrusted`)
    raises OSError. An untrusted cursor file is not read: it is listed in :attr:`untrusted` and
    the instance is read again from the oldest bytes the API has (its file is then replaced by
    one of ours, 0600)."""

    def __init__(self, directory: str | Path | None, euid: int | None = None) -> None:
        self.directory = Path(directory) if directory else None
        self._euid = os.geteuid() if euid is None else euid
        self._mem: dict[str, Cursor] = {}
        # key -> the cursor file's content as last read or written, ``reads`` left out
        # (:meth:`save` does not rewrite a file whose other fields are the same)
        self._stored: dict[str, str] = {}
        self.corrupt: list[str] = []  # names whose file could not be used (started fresh)
        self.untrusted: list[tuple[str, str]] = []  # (name, why) of files not trusted (fresh)
        if self.directory is not None:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            why = untrusted(os.stat(self.directory), self._euid)
            if why:
                raise PermissionError(f"{self.directory} {why}")

    def _path(self, project: str, zone: str, name: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{project}.{zone}.{name}.json"

    def load(self, project: str, zone: str, name: str) -> Cursor:
        key = f"{project}/{zone}/{name}"
        if key in self._mem:
            return self._mem[key]
        cur = Cursor(name)
        if self.directory is not None:
            p = self._path(project, zone, name)
            try:
                # O_NOFOLLOW: a link in place of a cursor is not followed (it is "unreadable")
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with open(fd, "rb") as f:
                    why = untrusted(os.fstat(f.fileno()), self._euid)
                    if why:
                        self.untrusted.append((key, why))  # reported; read again from the start
                    else:
                        obj = json.loads(f.read())
                        cur = Cursor.from_json(obj)
                        self._stored[key] = _without_reads(obj)
            except FileNotFoundError:
                pass
            except (OSError, ValueError, KeyError, TypeError):
                self.corrupt.append(key)  # reported; reading restarts from the oldest bytes
        self._mem[key] = cur
        return cur

    def saved(self) -> list[tuple[str, str, str]]:
        """(project, zone, name) of every cursor file (zone and name never contain a dot)."""
        if self.directory is None or not self.directory.is_dir():
            return []
        out = []
        for p in self.directory.glob("*.json"):
            parts = p.name[: -len(".json")].rsplit(".", 2)
            if len(parts) == 3:
                out.append((parts[0], parts[1], parts[2]))
        return sorted(out)

    def drop(self, project: str, zone: str, name: str) -> None:
        """Forget an instance's cursor (it was deleted and its decision is in the ledger)."""
        self._mem.pop(f"{project}/{zone}/{name}", None)
        self._stored.pop(f"{project}/{zone}/{name}", None)
        if self.directory is not None:
            self._path(project, zone, name).unlink(missing_ok=True)

    def save(self, project: str, zone: str, cur: Cursor) -> None:
        """Keep ``cur``; write its file unless only its ``reads`` count changed since the file
        was last read or written (a read that brought nothing: the common case in a steady
        fleet, where each write is an fsync'd rename). ``reads`` is a statistic that nothing
        decides on; the next write carries its exact count."""
        key = f"{project}/{zone}/{cur.name}"
        self._mem[key] = cur
        if self.directory is not None:
            doc = cur.to_json()
            same = _without_reads(doc)
            if self._stored.get(key) == same:
                return
            blob = json.dumps(doc, sort_keys=True).encode()
            atomic_write(self._path(project, zone, cur.name), blob, mode=0o600)
            self._stored[key] = same


def _without_reads(doc: dict[str, Any]) -> str:
    """A cursor document, its ``reads`` count left out, as a string to compare."""
    return json.dumps({k: v for k, v in doc.items() if k != "reads"}, sort_keys=True)


@dataclass(frozen=True)
class ReadResult:
    """What one incremental read brought."""

    fetched: int  # contents bytes received
    new: int  # bytes written to the port since the previous read (`next` - requested offset)
    lost: int  # of those, bytes the API no longer held (byte gap)
    reset: bool  # the port's buffer restarted; read again from 0
    new_events: int


class SerialReader:
    """Incremental reads of serial port 1 for many instances, resuming from stored cursors.

    ``pins``: the ledger. Before each read the instance's pin is taken from it (so a fresh
    cursor dir, a restart or another host uses the same key); a key this read placed (the
    instance's first line, read from byte 0) is stored there, first one wins.

    ``freshness``: the ledger's record of each boot's newest line (docs/poller.md,
    "Freshness"): after each read the current boot's newest seq is noted there, and the record
    that stands (the first receipt of that seq by any reader) is the timeline's ``last_rx``.

    ``on_read``: called with the instance's name and each chunk the API answered, as it came
    (``validate`` keeps the console its poller judged from these, never from reads of its own)."""

    def __init__(
        self,
        client: ComputeClient,
        store: CursorStore,
        clock: Callable[[], float] = time.time,
        pins: PinStore | None = None,
        freshness: FreshnessStore | None = None,
        on_read: Callable[[str, SerialChunk], None] | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.clock = clock  # the reader's own clock: when bytes were received
        self.pins = pins
        self.freshness = freshness
        self.on_read = on_read

    def read(self, project: str, zone: str, name: str, instance_id: str = "") -> ReadResult:
        cur = self.store.load(project, zone, name)
        if instance_id and cur.instance_id and cur.instance_id != instance_id:
            cur = Cursor(name)  # a new instance under the same name: its own port, its own log
        if instance_id:
            cur.instance_id = instance_id
            cur.timeline.set_instance(instance_id)  # a reloaded timeline does not keep it
        shared = self.pins.get_pin(instance_id) if self.pins is not None and instance_id else None
        if shared is not None:
            cur.timeline.set_pin(shared.public, shared.fingerprint, shared.retired)
        fetched = lost = new_events = new = 0
        reset = False
        # A cursor that never read this port has no record: what this read finds may be old.
        first_read = cur.reads == 0
        before = {b: info.max_seq for b, info in cur.timeline.boots.items()}
        # At most two reads: the second only after a buffer reset (the port restarted at 0).
        for _ in range(2):
            requested = cur.offset
            chunk = self.client.serial_port_output(project, zone, name, requested)
            rx = self.clock()
            if self.on_read is not None:
                self.on_read(name, chunk)
            fetched += len(chunk.contents)
            cur.reads += 1
            if chunk.next < requested:
                reset = True
                cur.timeline.resets += 1
                new_events += len(cur.timeline.feed(cur.pending + b"\n", rx)) if cur.pending else 0
                cur.pending = b""
                cur.offset = 0
                continue
            if chunk.start > requested:
                lost += chunk.start - requested
                cur.timeline.note_byte_gap(requested, chunk.start)
                if cur.pending:  # its continuation is gone: decode what we have, alone
                    new_events += len(cur.timeline.feed(cur.pending + b"\n", rx))
                    cur.pending = b""
            data = cur.pending + chunk.contents
            # LF, CRLF and a bare CR all end a line (the decoder splits at each)
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            if cut:
                new_events += len(cur.timeline.feed(data[:cut], rx))
            cur.pending = data[cut:][-MAX_PENDING:]
            new = chunk.next - requested
            cur.new_bytes += new
            cur.fetched_bytes += len(chunk.contents)
            cur.offset = chunk.next
            break
        tl = cur.timeline
        for b, info in tl.boots.items():
            if info.max_seq > before.get(b, -1):  # a newer line of this boot arrived now
                info.rx_known = not first_read
        if self.freshness is not None and instance_id:
            self._share_boot_order(instance_id, tl, rx)
            self._share_freshness(instance_id, tl)
        if self.pins is not None and instance_id and tl.pinned_here and tl.pin is not None:
            placed = tl.rekeys[0][0] if tl.rekeys else tl.pin  # the key before any rotation
            stored = self.pins.place_pin(instance_id, placed, pk_fingerprint(placed), rx)
            tl.set_pin(stored.public, stored.fingerprint)  # the ledger's pin is the pin
            tl.pin_stored()
        if self.pins is not None and instance_id and tl.rekeys:
            # a rotation line verified under the pin: the ledger's pin moves (compare-and-set,
            # so every reader that decoded it moves it once), and every reader follows
            moved = None
            for old_pk, new_pk, boot, seq in tl.rekeys:
                moved = self.pins.rekey_pin(
                    instance_id, old_pk, new_pk, pk_fingerprint(new_pk), boot, seq, rx
                )
            tl.rekeys_stored()
            if moved is not None and moved.public is not None:
                tl.set_pin(moved.public, moved.fingerprint, moved.retired)
        self.store.save(project, zone, cur)
        return ReadResult(fetched, new, lost, reset, new_events)

    def cursor(self, project: str, zone: str, name: str) -> Cursor:
        return self.store.load(project, zone, name)

    def _share_boot_order(self, instance_id: str, tl: Timeline, rx: float) -> None:
        """Take the ledger's record of the instance's highest boot counter, and raise it when
        this read found a higher one: a boot once superseded never becomes current again, in
        any reader, on any host (poller/boots.py; docs/poller.md, "Boot order")."""
        assert self.freshness is not None
        tl.note_boot_record(self.freshness.boot_record(instance_id))
        top = tl.boot_order.raise_to
        if top is not None and top.counter is not None:
            info = tl.boots.get(top.boot)
            began = info.first_rx if info is not None and info.first_rx is not None else rx
            tl.note_boot_record(
                self.freshness.raise_boot(instance_id, Record(top.counter, top.boot, began))
            )

    def _share_freshness(self, instance_id: str, tl: Timeline) -> None:
        """Note the current boot's newest line in the ledger and take the record that stands:
        a reader that finds the same (or a newer) seq there measures silence from its first
        receipt by any reader, never from its own first read (docs/poller.md, "Freshness")."""
        assert self.freshness is not None
        boot = tl.latest_boot
        info = tl.boots.get(boot) if boot is not None else None
        if boot is None or info is None or info.last_rx is None:
            return
        rec = self.freshness.note(instance_id, boot, info.max_seq, info.last_rx, info.rx_known)
        if rec.seq >= info.max_seq:
            info.last_rx, info.rx_known = rec.rx, rec.known


def jitter(seconds: float, fraction: float = 0.1) -> float:
    """``seconds`` +- ``fraction``: many pollers started together spread their calls."""
    return seconds * (1 + random.uniform(-fraction, fraction))  # noqa: S311 (not crypto)
