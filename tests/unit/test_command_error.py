"""Exit statuses come from one place: a command raises ``CommandError`` (lib/cli.py) and the root
CLI (``gce_watchdog.cli.main``) prints its message on stderr and exits with its status. Checked
in this process on commands that fail before they touch the machine (no config, no console)."""

from __future__ import annotations

import pytest
from gce_watchdog.lib.cli import EX_USAGE, CommandError
from kit.cli import main_rc

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    ("argv", "status", "stderr"),
    [
        (
            ["setup-failed", "--step", " ", "--reason", "x"],
            EX_USAGE,
            "gce-watchdog setup-failed: --step and --reason must not be empty\n",
        ),
        (
            ["result", "ok", "--detail", "novalue"],
            EX_USAGE,
            "gce-watchdog result: --detail must be K=V, got 'novalue'\n",
        ),
        (
            ["config", "check", "--config", "/nonexistent/a.toml", "/nonexistent/b.toml"],
            EX_USAGE,
            "gce-watchdog config check: two paths: --config /nonexistent/a.toml and "
            "/nonexistent/b.toml\n",
        ),
        (
            ["memwatch", "--pid", "1", "--", "true"],
            EX_USAGE,
            "gce-watchdog memwatch: give --pid or -- CMD, not both\n",
        ),
    ],
)
def test_a_failed_command_exits_with_its_status_and_says_why_once(
    argv: list[str], status: int, stderr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main_rc(argv) == status
    out, err = capsys.readouterr()
    assert err == stderr
    assert out == ""


def test_the_error_carries_its_status_and_message() -> None:
    e = CommandError(77, "not root")
    assert (e.status, e.message, str(e)) == (77, "not root", "not root")
    quiet = CommandError(74)  # the command said why already: nothing more is printed
    assert (quiet.status, quiet.message) == (74, None)
