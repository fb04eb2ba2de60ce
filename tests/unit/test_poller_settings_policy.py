"""The verdict's policy options reach the Policy in every mode of ``poll`` (instance names,
``--label``, ``--pubsub``: one PollSettings) and in ``parse`` (poll's defaults): the real
parser, ``poll_settings`` and ``parse``'s ``_policy``, one table (settings.POLICY_OPTIONS)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from gce_watchdog.poller import cli as poller_cli
from gce_watchdog.poller.settings import POLICY_OPTIONS, poll_settings
from gce_watchdog.poller.verdict import Policy

pytestmark = pytest.mark.pure

MODES = {
    "instances": ["--project", "my-project-1", "--zone", "us-central1-a", "vm-1"],
    "label": ["--project", "my-project-1", "--label", "gce-watchdog=on"],
    "pubsub": ["--pubsub", "projects/my-project-1/subscriptions/gcewd-lines"],
    "pubsub+label": [
        "--pubsub", "projects/my-project-1/subscriptions/gcewd-lines",
        "--project", "my-project-1", "--label", "gce-watchdog=on",
    ],
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    poller_cli.register(p.add_subparsers())
    return p


def _choices(command: str) -> dict[str, tuple[str, ...]]:
    subs = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    sub = subs.choices[command]
    return {a.dest: tuple(a.choices or ()) for a in sub._actions}


def _policy(argv: list[str]) -> Policy:
    s = poll_settings(vars(_parser().parse_args(["poll", *argv])))
    return s.policy


def test_every_policy_field_has_its_option() -> None:
    fields = {f.name for f in dataclasses.fields(Policy)} - {"drain_timeout_s"}
    assert {field for _, _, field in POLICY_OPTIONS} == fields
    poll = _choices("poll")
    for dest, value, _ in POLICY_OPTIONS:
        assert value in poll[dest], dest


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_policy_option_reaches_the_policy_in_every_poll_mode(mode: str) -> None:
    assert _policy(MODES[mode]) == Policy()  # the defaults: fail over, alarms only alarm
    for dest, value, field in POLICY_OPTIONS:
        flag = "--" + dest.replace("_", "-")
        got = _policy([*MODES[mode], flag, value, "--drain-timeout", "7m"])
        assert got == Policy(drain_timeout_s=420.0, **{field: True}), flag


def test_job_stuck_report_is_an_alarm_only_in_every_poll_mode() -> None:
    for argv in MODES.values():
        assert _policy([*argv, "--on-job-stuck", "report"]).job_stuck_report
        assert not _policy([*argv, "--on-job-stuck", "failover"]).job_stuck_report


def test_parse_takes_polls_defaults_and_its_drain_timeout() -> None:
    args = _parser().parse_args(["parse", "dump.log", "--drain-timeout", "20m"])
    assert poller_cli._policy(args) == Policy(drain_timeout_s=1200.0)
