"""Planned-stop notices for the job: the JSON file the agent writes, and the rule for its signal.

GCE announces a host maintenance stop (``instance/maintenance-event`` turns
``TERMINATE_ON_HOST_MAINTENANCE``; GPU VMs cannot live-migrate and get one hour's notice) and a
Spot preemption (``instance/preempted`` turns ``TRUE`` about 30 s ahead) on the metadata server
(Compute Engine docs: "Host maintenance", "About Spot VMs" / "Preemption"). The job never asks,
so the agent writes the notice to ``<run_dir>/notice.json`` (root-owned, world-readable; its path
is in the job's environment as ``$GCE_WATCHDOG_NOTICE``) and ``gce-watchdog exec`` sends the job
the configured signal (``[job] notice_signal``, SIGUSR1 by default: "checkpoint now", as Slurm's
``--signal`` and Lightning's requeue use it) once per new notice.

The file (version 1): ``{"version": 1, "kind": "maintenance" | "preempted" | "none",
"event": <the metadata value>, "at": <RFC 3339 UTC, when the agent heard it>, "by": <RFC 3339
UTC, when the stop is expected at the latest>, "text": ...}``.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gce_watchdog.lib.files import read_json, write_json

NOTICE_ENV = "GCE_WATCHDOG_NOTICE"
NOTICE_FILE = "notice.json"
VERSION = 1
# The notice periods GCE documents: a GPU VM's maintenance stop comes an hour after the notice,
# a preemption about 30 s after. "by" uses them; it tells the job its latest safe moment.
MAINTENANCE_NOTICE_S = 3600.0
PREEMPTION_NOTICE_S = 30.0
# instance/maintenance-event's values (Compute Engine metadata docs); anything else is kept
# only as "unknown" (a value from the server is not trusted to be one of them).
MAINTENANCE_VALUES = frozenset(
    {"NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE"}
)


@dataclass(frozen=True, slots=True)
class Notice:
    kind: str  # maintenance, preempted, none
    event: str
    at: float  # epoch seconds
    by: float
    text: str

    @property
    def signals(self) -> bool:
        """Whether the job is signalled for this notice (a stop is coming)."""
        return self.kind != "none"

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "kind": self.kind,
            "event": self.event,
            "at": rfc3339(self.at),
            "by": rfc3339(self.by),
            "text": self.text,
        }


def rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def maintenance_notice(value: str, now: float) -> Notice:
    """The notice for a new ``maintenance-event`` value (pure)."""
    event = value if value in MAINTENANCE_VALUES else "unknown"
    if event == "NONE":
        return Notice("none", event, now, now, "no host maintenance pending")
    if event == "MIGRATE_ON_HOST_MAINTENANCE":
        # A live migration: the VM keeps running; the job may still want to know.
        return Notice("maintenance", event, now, now + 60.0, "GCE live-migrates this VM")
    return Notice(
        "maintenance",
        event,
        now,
        now + MAINTENANCE_NOTICE_S,
        "GCE stops this VM for host maintenance: checkpoint now",
    )


def preemption_notice(now: float) -> Notice:
    return Notice(
        "preempted",
        "TRUE",
        now,
        now + PREEMPTION_NOTICE_S,
        "GCE is preempting this VM: checkpoint now",
    )


def notice_path(run_dir: str) -> str:
    return os.path.join(run_dir, NOTICE_FILE)


def write_notice(run_dir: str, notice: Notice) -> None:
    """Atomically, so a reader sees the old notice or the new one (a new inode each time)."""
    write_json(notice_path(run_dir), notice.to_json())


class NoticeFollower:
    """What ``exec`` runs while the job lives: ``changed()`` is True once per new notice file that
    announces a stop (a new inode or mtime: every write is an atomic rename). A notice written
    before the job started is not news."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def changed(self) -> bool:
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return False
        self._seen = stamp
        raw = read_json(Path(self.path))
        return isinstance(raw, dict) and raw.get("kind") in ("maintenance", "preempted")
