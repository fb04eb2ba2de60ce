"""cli.COMMAND_MODULES: a command line registers only its command's module, and parses the same
as with every module (docs/performance.md, "The RSS target")."""

from __future__ import annotations

import argparse
import importlib

import pytest
from gce_watchdog import cli

pytestmark = pytest.mark.pure


def test_each_command_maps_to_the_module_that_registers_it() -> None:
    registered: dict[str, str] = {}
    for name in cli.MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        registered.update(dict.fromkeys(sub.choices, name))
    assert registered == cli.COMMAND_MODULES


@pytest.mark.parametrize(
    ("argv", "modules"),
    [
        (["run", "--config", "/etc/x.toml"], ("gce_watchdog.daemon.cli",)),
        (["fetch", "--help"], ("gce_watchdog.bootstrap.cli",)),
        (["config", "show"], ("gce_watchdog.vm.cli",)),
        ([], cli.MODULES),  # the root's help
        (["--help", "run"], cli.MODULES),
        (["--version"], cli.MODULES),
        (["runn"], cli.MODULES),  # argparse's "invalid choice" lists every command
    ],
)
def test_modules_for(argv: list[str], modules: tuple[str, ...]) -> None:
    assert cli.modules_for(argv) == modules


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--config", "/tmp/a.toml", "--max-ticks", "3"],
        ["check", "--json"],
        ["disarm", "--for", "2h", "--reason", "maintenance"],
        ["end", "--reason", "done", "--linger", "0"],
        ["config", "show"],
        ["fault", "inject", "--metadata", "--ttl", "5m"],
        ["memwatch", "--", "true"],
    ],
)
def test_the_partial_parser_parses_as_the_full_one(argv: list[str]) -> None:
    full = vars(cli.build_parser().parse_args(argv))
    part = vars(cli.build_parser(cli.modules_for(argv)).parse_args(argv))
    assert part == full
