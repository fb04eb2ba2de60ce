"""Disarm switch: keep the ladder reporting, but never act, for a bounded time.

Two sources, either one disarms:

- the instance metadata attribute ``watch.disarm_attribute`` (read by :mod:`daemon.metawatch` while
  the metadata server answers; it ages out ``watch.disarm_hold`` after its last confirmation);
- the local state file ``<state_dir>/disarm.json`` written by ``gce-watchdog disarm --for 2h``
  and removed by ``gce-watchdog arm``.

Disarming always expires: the local switch takes a duration of at most :data:`MAX_DISARM_S`
(24 h) and re-arms by itself at its expiry; a file that claims more is capped at read time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gce_watchdog.lib.files import read_json
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter
from gce_watchdog.wire import vocab

DISARM_FILE = "disarm.json"
# The longest a local disarm may last. A VM left disarmed by mistake costs money; a day covers a
# debugging session or an overnight experiment, and `disarm` can be run again to extend.
MAX_DISARM_S = 24 * 3600.0
# A disarm set "in the future" by more than this (the clock jumped back) is not trusted.
CLOCK_SLACK_S = 300.0


@dataclass(frozen=True)
class LocalDisarm:
    set_at: float  # wall clock, seconds
    until: float  # wall clock, seconds
    reason: str = ""
    by: str = ""

    @property
    def effective_until(self) -> float:
        return min(self.until, self.set_at + MAX_DISARM_S)


def disarm_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / DISARM_FILE


def read_local(state_dir: str | Path) -> LocalDisarm | str | None:
    """The local disarm, None when there is none, or an error text for an unusable file."""
    p = disarm_path(state_dir)
    if not p.exists():
        return None
    raw = read_json(p)
    if not isinstance(raw, dict):
        return f"{p} is not valid JSON"
    try:
        set_at, until = float(raw["set_at"]), float(raw["until"])
    except (KeyError, TypeError, ValueError, OverflowError):  # Overflow: an int float() can't hold
        return f"{p} lacks set_at/until"
    return LocalDisarm(set_at, until, str(raw.get("reason", "")), str(raw.get("by", "")))


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def disarm_status(
    state_dir: str | Path, now_wall: float, metadata_disarm: bool
) -> tuple[bool, str]:
    """``(armed, why)``. ``why`` is short and token-like (it goes into serial line fields).

    Disarmed: ``metadata`` or ``local-until-<ISO time>``. Armed: ``armed``, ``expired`` (a local
    disarm ran out) or ``bad-disarm-file`` (an unreadable file never disarms).
    """
    if metadata_disarm:
        return False, "metadata"
    local = read_local(state_dir)
    if local is None:
        return True, "armed"
    if isinstance(local, str):
        return True, "bad-disarm-file"
    if local.set_at - CLOCK_SLACK_S <= now_wall < local.effective_until:
        return False, f"local-until-{iso(local.effective_until)}"
    return True, "expired"


class DisarmGate:
    """The daemon's ``armed()`` input: combines both sources and reports changes on the console.

    Reports ``disarm``/``arm`` lines for what only the agent can see: the metadata attribute
    appearing or going, a local disarm expiring, and the state found at start-up. (The CLI reports
    its own ``disarm``/``arm`` when an operator runs it.)
    """

    def __init__(
        self,
        state_dir: str,
        emitter: Emitter,
        metadata_disarm: Callable[[], bool],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = state_dir  # where the local switch (disarm.json) lives
        self.emitter = emitter
        self.metadata_disarm = metadata_disarm
        self.wall = wall
        self._last: tuple[bool, str] | None = None

    @classmethod
    def from_config(cls, cfg: cfgmod.Config, *args: Any, **kw: Any) -> DisarmGate:
        return cls(cfg.agent.state_dir, *args, **kw)

    def __call__(self) -> tuple[bool, str]:
        md = False
        with contextlib.suppress(Exception):  # an unknown metadata answer never disarms
            md = bool(self.metadata_disarm())
        armed, why = disarm_status(self.state_dir, self.wall(), md)
        prev = self._last
        self._last = (armed, why)
        if prev is None:
            if not armed:
                src = "metadata" if why == "metadata" else "local"
                self._emit(vocab.DISARM, src, why, "at start")
        elif prev[0] != armed:
            if not armed:
                if why == "metadata":  # a local disarm was reported by the CLI that set it
                    self._emit(vocab.DISARM, "metadata", why, "metadata attribute set")
            elif prev[1] == "metadata":
                self._emit(vocab.ARM, "metadata", why, "metadata disarm ended")
            elif why != "armed":  # expired or unreadable (a removed file: the CLI reported it)
                self._emit(vocab.ARM, "local", why, "local disarm ended")
        return armed, why

    def _emit(self, event: str, src: str, why: str, text: str) -> None:
        with contextlib.suppress(Exception):  # best effort at the edge: the ladder goes on
            self.emitter.emit(event, {"src": src, "why": why}, text, sync=True)
