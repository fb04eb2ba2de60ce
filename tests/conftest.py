"""Shared pytest fixtures and the hypothesis profiles. Keep this file small: helpers live in
tests/kit/, feature fixtures in their own modules."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from kit.netns import Topology, iptables_unavailable, netns_unavailable
from kit.nobody import Nobody

# Hypothesis (docs/architecture.md, "Tests"): the properties check values, never how fast the
# machine is, so no profile has a deadline or the too_slow health check (a loaded CI runner
# failed DeadlineExceeded at 467 ms against the 200 ms default). "dev" (the default) draws new
# examples every run; "ci" is derandomized: the same examples on every run, from the test's
# source, so a red CI run is red again on a rerun and on a laptop. `make test` and CI (the
# variable CI set) use "ci"; HYPOTHESIS_PROFILE names one explicitly.
_NOT_TIMING = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("dev", **_NOT_TIMING)
settings.register_profile("ci", derandomize=True, print_blob=True, **_NOT_TIMING)
_DEFAULT_PROFILE = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or _DEFAULT_PROFILE)


@pytest.fixture
def topo() -> Iterator[Topology]:
    """A fresh vm/gce namespace pair (kit/netns.py); skips with the reason where unavailable."""
    why = netns_unavailable() or iptables_unavailable()
    if why:
        pytest.skip(f"netns: {why}")
    with Topology() as t:
        yield t


@pytest.fixture(scope="session")
def nobody() -> Iterator[Nobody]:
    """Code run as uid nobody from world-readable copies of the agent and its dependencies, with
    an interpreter nobody can run (kit/nobody.py): a checkout under a 0700 dir (a `mktemp -d`
    clone, as CI makes) is not readable by that uid. Skips with the reason where impossible."""
    from kit.nobody import NobodyUnavailable, nobody_python

    with contextlib.ExitStack() as stack:
        try:
            nb = stack.enter_context(nobody_python())
        except NobodyUnavailable as e:
            pytest.skip(f"nobody: {e}")
        yield nb


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A fresh 0755 directory under /tmp that uid nobody can reach (tmp_path is under a 0700
    one), removed after the test."""
    from kit.nobody import open_dir

    with open_dir() as d:
        yield d


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """One real PostgreSQL server for the session (tests/kit/pgserver.py), stopped at the end."""
    from kit.pgserver import postgres_server, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"postgresql: {why}")
    with postgres_server() as url:
        yield url


@pytest.fixture
def pg_database(postgres_url: str) -> Iterator[str]:
    """A fresh, empty database on the session's server for one test; dropped afterwards."""
    import uuid

    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield postgres_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pubsub_host() -> Iterator[str]:
    """One real Pub/Sub emulator for the session (kit/pubsub_emulator.py), killed at the end."""
    from kit.pubsub_emulator import pubsub_emulator, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"pubsub: {why}")
    with pubsub_emulator() as host:
        yield host


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ledger location for each backend: a SQLite file, then a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.sqlite")
    return str(request.getfixturevalue("pg_database"))
