"""The agent's sd_notify client: :mod:`gce_watchdog.lib.sdnotify` (shared with the poller)."""

from __future__ import annotations

from gce_watchdog.lib.sdnotify import Notifier

__all__ = ["Notifier"]
