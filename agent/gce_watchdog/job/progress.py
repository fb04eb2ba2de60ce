"""The job's progress, agent side: the job record ``exec`` writes, the process tree, and the
socket the job reports on.

``gce-watchdog exec`` writes ``<run_dir>/job.json`` (root-owned, 0644; version 1:
``{"version": 1, "pid", "start_ticks", "windows": {"after", "max", "first"}}``, ``start_ticks``
the job's start time in clock ticks since boot from ``/proc/<pid>/stat``, so a reused pid is
never taken for the job) and removes it when the job ends.

The agent listens on ``<run_dir>/progress.sock`` (a Unix stream socket, mode 0666: anyone may
connect, the kernel tells who did). A request is one line, ``progress <step>`` or ``progress -``
(no step: each call is a step); the answer one line: ``ok <step>``, ``same <step> <last>`` (not
progress: steps strictly increase) or ``refused <why>``. The caller is taken from ``SO_PEERCRED``
(what the kernel recorded at ``connect``, never what the caller says) and accepted only when its
pid is the job's or a descendant of it, or its uid is ``[job] progress_uid``; anyone else is
refused before a byte of its request is read. One thread serves the socket: an allowed caller's
request is one short line, read within ``CLIENT_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gce_watchdog import jobprogress
from gce_watchdog.job.stuck import Windows, advance
from gce_watchdog.lib.files import read_json, write_json
from gce_watchdog.lib.loop import Loop
from gce_watchdog.vm.state import untrusted_dir

JOB_FILE = "job.json"
SOCKET_FILE = "progress.sock"
PROGRESS_ENV = jobprogress.ENV  # the socket's path, in the job's environment under exec
VERSION = 1
# A request is one short line; a caller that says nothing is cut off after this long, so one
# silent client never holds the (single) server thread.
REQUEST_MAX = 256
CLIENT_TIMEOUT_S = 2.0
# A process tree deeper than this is a loop in a corrupt /proc reading, not a job.
TREE_DEPTH_MAX = 4096
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (socket(7))


@dataclass(frozen=True, slots=True)
class JobRecord:
    pid: int
    start_ticks: int
    windows: Windows


def job_path(run_dir: str) -> str:
    return os.path.join(run_dir, JOB_FILE)


def socket_path(run_dir: str) -> str:
    return os.path.join(run_dir, SOCKET_FILE)


def write_job(run_dir: str, rec: JobRecord) -> None:
    w = rec.windows
    write_json(
        job_path(run_dir),
        {
            "version": VERSION,
            "pid": rec.pid,
            "start_ticks": rec.start_ticks,
            "windows": {"after": w.after, "max": w.max, "first": w.first},
        },
    )


def clear_job(run_dir: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(job_path(run_dir))


def _num(v: object) -> float | None:
    if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
        return float(v)
    return None


def read_job(run_dir: str, owner: int = 0) -> JobRecord | None:
    """The record, or None when absent, malformed, or not written by ``owner`` (root on a VM)
    with no write bit for group or others: a record anyone could write would let anyone
    choose whose progress counts."""
    path = job_path(run_dir)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_mode & 0o022:
        return None
    raw = read_json(Path(path))
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        return None
    pid, ticks, win = raw.get("pid"), raw.get("start_ticks"), raw.get("windows")
    if not isinstance(pid, int) or pid <= 0 or not isinstance(ticks, int):
        return None
    win = win if isinstance(win, dict) else {}
    return JobRecord(
        pid, ticks, Windows(_num(win.get("after")), _num(win.get("max")), _num(win.get("first")))
    )


# -- /proc ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcStat:
    ppid: int
    start_ticks: int
    cpu_ticks: int  # utime + stime


class Proc:
    """``/proc/<pid>/stat`` (proc(5)); ``root`` is injectable for a test's own tree of files."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root
        self.hz = os.sysconf("SC_CLK_TCK")

    def stat(self, pid: int) -> ProcStat | None:
        try:
            with open(f"{self.root}/{pid}/stat", "rb") as f:
                raw = f.read(4096)
        except OSError:
            return None
        # the command name is in parentheses and may hold anything: split after the last ")"
        tail = raw[raw.rfind(b")") + 2 :].split()
        try:
            # fields 4 (ppid), 14 (utime), 15 (stime), 22 (starttime); tail starts at field 3
            return ProcStat(int(tail[1]), int(tail[19]), int(tail[11]) + int(tail[12]))
        except (IndexError, ValueError):
            return None

    def pids(self) -> Iterable[int]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [int(n) for n in names if n.isdigit()]


def job_alive(proc: Proc, rec: JobRecord) -> bool:
    st = proc.stat(rec.pid)
    return st is not None and st.start_ticks == rec.start_ticks


def in_tree(proc: Proc, pid: int, rec: JobRecord) -> bool:
    """Whether ``pid`` is the job or a descendant of it (the job still the one recorded)."""
    if not job_alive(proc, rec):
        return False
    for _ in range(TREE_DEPTH_MAX):
        if pid == rec.pid:
            return True
        st = proc.stat(pid)
        if st is None or st.ppid <= 0 or st.ppid == pid:
            return False
        pid = st.ppid
    return False


def tree_cpu_seconds(proc: Proc, rec: JobRecord) -> float | None:
    """The CPU seconds of the job's tree (live processes; None when the job is gone). One scan of
    /proc: a few thousand small reads on a busy machine, once per heartbeat."""
    if not job_alive(proc, rec):
        return None
    stats = {p: s for p in proc.pids() if (s := proc.stat(p)) is not None}
    children: dict[int, list[int]] = {}
    for p, s in stats.items():
        children.setdefault(s.ppid, []).append(p)
    total, todo, seen = 0, [rec.pid], set()
    while todo:
        p = todo.pop()
        if p in seen or p not in stats:
            continue
        seen.add(p)
        total += stats[p].cpu_ticks
        todo.extend(children.get(p, ()))
    return total / proc.hz


# -- the tracker and the socket ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    step: int
    at: float  # monotonic


class Tracker:
    """The latest step of the current job (thread-safe: the server writes, the watch reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._job: tuple[int, int] | None = None
        self._latest: Progress | None = None
        self.repeated = 0  # reports that were not progress (a repeated or lower step), all jobs

    def _for(self, rec: JobRecord) -> None:
        if self._job != (rec.pid, rec.start_ticks):  # a new job: its own count
            self._job, self._latest = (rec.pid, rec.start_ticks), None

    def report(self, rec: JobRecord, step: int | None, now: float) -> tuple[bool, int | None]:
        """(whether it is progress, the step now latest)."""
        with self._lock:
            self._for(rec)
            last = self._latest.step if self._latest is not None else None
            new = advance(last, step)
            if new is None:
                self.repeated += 1
                return False, last
            self._latest = Progress(new, now)
            return True, new

    def latest(self, rec: JobRecord) -> Progress | None:
        with self._lock:
            self._for(rec)
            return self._latest


def parse_request(data: bytes) -> tuple[bool, int | None]:
    """(well formed, the step or None)."""
    parts = data.decode("ascii", "replace").strip().split()
    if len(parts) != 2 or parts[0] != "progress":
        return False, None
    if parts[1] == "-":
        return True, None
    try:
        return True, int(parts[1])
    except ValueError:
        return False, None


class ProgressServer:
    """The socket and its thread. ``authorize(pid, uid)`` says why a caller is refused ("" when
    it is not); ``on_progress`` is told of each accepted step."""

    def __init__(
        self,
        run_dir: str,
        tracker: Tracker,
        job: Callable[[], JobRecord | None],
        proc: Proc,
        progress_uid: int,
        monotonic: Callable[[], float],
    ) -> None:
        self.path = socket_path(run_dir)
        self.tracker = tracker
        self.job = job
        self.proc = proc
        self.progress_uid = progress_uid
        self.monotonic = monotonic
        self.reason = "not started"
        self.refused = 0
        self._sock: socket.socket | None = None
        self._loop = Loop("progress")

    def start(self) -> None:
        why = untrusted_dir(os.path.dirname(self.path))
        if why:  # another user could swap the socket for a link before the chmod below
            self.reason = f"not listening: the run dir {why}"
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a socket left by an earlier agent (the run dir is ours)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(self.path)
            os.chmod(self.path, 0o666)  # noqa: S103 - who may report is decided by SO_PEERCRED
            s.listen(16)
            s.settimeout(0.5)  # how soon stop() is noticed
        except OSError as e:
            s.close()
            self.reason = f"cannot listen on {self.path}: {e.strerror or e}"
            return
        self._sock = s
        self.reason = f"listening on {self.path}"
        self._loop.start(self._run)

    def stop(self, timeout: float = 5.0) -> bool:
        ended = self._loop.stop(timeout)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        return ended

    def _run(self) -> None:
        assert self._sock is not None
        while not self._loop.stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._loop.stopping.is_set():
                    return
                continue
            with conn, contextlib.suppress(OSError):
                conn.sendall(self._answer(conn).encode() + b"\n")

    def _answer(self, conn: socket.socket) -> str:
        pid, uid, _ = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        # Who before what: a caller that may not report is answered without a byte read, so
        # no one outside the job can hold this (single) thread by saying nothing.
        rec = self.job()
        if rec is None:
            self.refused += 1
            return "refused no job: gce-watchdog exec is not running a job here"
        why = self.authorize(rec, pid, uid)
        if why:
            self.refused += 1
            return f"refused {why}"
        conn.settimeout(CLIENT_TIMEOUT_S)
        data = b""
        with contextlib.suppress(OSError):
            while b"\n" not in data and len(data) < REQUEST_MAX:
                chunk = conn.recv(REQUEST_MAX)
                if not chunk:
                    break
                data += chunk
        ok, step = parse_request(data[:REQUEST_MAX])
        if not ok:
            return "refused bad request: expected 'progress <step>' or 'progress -'"
        counted, latest = self.tracker.report(rec, step, self.monotonic())
        return f"ok {latest}" if counted else f"same {step} {latest}"

    def authorize(self, rec: JobRecord, pid: int, uid: int) -> str:
        if self.progress_uid >= 0 and uid == self.progress_uid:
            return ""
        if in_tree(self.proc, pid, rec):
            return ""
        return (
            f"pid {pid} (uid {uid}) is not in the process tree of the job (pid {rec.pid}) "
            "that gce-watchdog exec started"
            + (f", nor uid {self.progress_uid}" if self.progress_uid >= 0 else "")
        )
