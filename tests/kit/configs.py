"""In-process Config values for tests that build parts directly (no file, no process)."""

from __future__ import annotations

from pathlib import Path

from gce_watchdog.vm import config as cfgmod

SYSTEMCTL_POWEROFF = ["systemctl", "poweroff"]
SYSTEMCTL_FORCE = ["systemctl", "poweroff", "--force"]


def chain_config(tmp: Path, action: str, **actions: object) -> cfgmod.Config:
    """A Config for the shutdown chain: ``action``, the agent's state under ``tmp``, and an
    [actions] section of the systemctl commands, a repeat every 5 s and a 30 s force wait, with
    ``actions`` laid over them (linger, poweroff_wait... as the test needs)."""
    base: dict[str, object] = {
        "repeat_every": 5.0,
        "force_wait": 30.0,
        "poweroff_cmd": SYSTEMCTL_POWEROFF,
        "force_cmd": SYSTEMCTL_FORCE,
    }
    return cfgmod.from_dict(
        {"agent": {"action": action, "state_dir": str(tmp)}, "actions": {**base, **actions}},
        "test",
    )
