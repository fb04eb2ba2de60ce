"""Shared pytest fixtures. Keep this file small: feature fixtures live in their own modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kit.netns import Topology, iptables_unavailable, netns_unavailable


@pytest.fixture
def topo() -> Iterator[Topology]:
    """A fresh vm/gce namespace pair (kit/netns.py); skips with the reason where unavailable."""
    why = netns_unavailable() or iptables_unavailable()
    if why:
        pytest.skip(f"netns: {why}")
    with Topology() as t:
        yield t


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
