"""What to install when an optional library is missing (issue 39).

The words depend on how this gce-watchdog was installed: the Debian packages' venv
(``/opt/gce-watchdog``) has no pip, so ``pip install`` would be advice that cannot be followed
there; the PostgreSQL and Pub/Sub libraries come with the ``gce-watchdog-poller`` package
(docs/packaging.md, "Two packages"), and matplotlib with no package at all.

:func:`install_hint` is pure; :func:`this_install` reads the running interpreter (the edge).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

DEB_PREFIX = "/opt/gce-watchdog"


@dataclass(frozen=True)
class Extra:
    module: str  # the import that proves it is there
    library: str  # its distribution's name, for the message
    deb: str | None  # the Debian package that has it


EXTRAS = {
    "postgres": Extra("psycopg", "psycopg", "gce-watchdog-poller"),
    "pubsub": Extra("google.cloud.pubsub_v1", "google-cloud-pubsub", "gce-watchdog-poller"),
    "report": Extra("matplotlib", "matplotlib", None),
}


@dataclass(frozen=True)
class Install:
    """How the running gce-watchdog is installed."""

    debian: bool  # the Debian package's venv (sys.prefix is /opt/gce-watchdog and no pip)
    has_pip: bool  # pip is importable here


def this_install() -> Install:
    has_pip = importlib.util.find_spec("pip") is not None
    return Install(debian=sys.prefix == DEB_PREFIX and not has_pip, has_pip=has_pip)


def importable(module: str) -> bool:
    """Whether ``module`` can be imported here (its top package found, then itself)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing (google.cloud without google)
        return False


def install_hint(extra: str, how: Install) -> str:
    """One sentence: what to install for ``extra``, for this kind of installation."""
    deb = EXTRAS[extra].deb
    venv = (
        f"python3 -m venv DIR && DIR/bin/pip install 'gce-watchdog[{extra}]', "
        "then run DIR/bin/gce-watchdog"
    )
    if how.debian:
        if deb is not None:
            return (
                f"install the {deb} package (apt-get install {deb}), which adds it to {DEB_PREFIX}"
            )
        return (
            f"the Debian packages do not include it and {DEB_PREFIX} has no pip: "
            f"use a venv of your own ({venv})"
        )
    if how.has_pip:
        return f"pip install 'gce-watchdog[{extra}]'"
    return f"this Python environment has no pip: use a venv of your own ({venv})"
