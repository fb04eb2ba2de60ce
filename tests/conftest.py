"""Shared pytest fixtures and the hypothesis profiles. Keep this file small: helpers live in
tests/kit/, feature fixtures in their own modules."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from kit import sigterm
from kit.netns import Topology, iptables_unavailable, netns_unavailable
from kit.nobody import Nobody

# Hypothesis (docs/architecture.md, "Tests"): the properties check values, never how fast the
# machine is, so no profile has a deadline or the too_slow health check (a loaded CI runner
# failed DeadlineExceeded at 467 ms against the 200 ms default). "dev" (the default) draws new
# examples every run; "ci" is derandomized: the same examples on every run, from the test's
# source, so a red CI run is red again on a rerun and on a laptop. `make test` and CI (the
# variable CI set) use "ci"; HYPOTHESIS_PROFILE names one explicitly. The number of examples is
# set here once per profile, never by a test: "dev" (make test-fast, a plain pytest) draws
# hypothesis's default 100, "ci" 200 (twice as many, the same ones every run).
_NOT_TIMING = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("dev", max_examples=100, **_NOT_TIMING)
settings.register_profile("ci", max_examples=200, derandomize=True, print_blob=True, **_NOT_TIMING)
_DEFAULT_PROFILE = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or _DEFAULT_PROFILE)


def pytest_configure(config: pytest.Config) -> None:
    # `timeout`'s SIGTERM stops the run with every fixture torn down (kit/sigterm.py)
    sigterm.install()


# -- tiers (docs/development.md) ------------------------------------------------------------------
# Every test carries exactly one tier marker, which says what it is: `make test-fast` runs the
# pure tier, `make test` all of them. Registered in pyproject.toml (strict markers).
TIERS = ("pure", "process", "netns", "vm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collection fails, naming each test, where a test has no tier marker or more than one."""
    bad = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            why = "no tier marker" if not tiers else "more than one tier: " + ", ".join(tiers)
            bad.append(f"  {item.nodeid}: {why}")
    if bad:
        raise pytest.UsageError(
            f"{len(bad)} test(s) without exactly one tier marker ({', '.join(TIERS)}; "
            "docs/development.md, 'Tiers'):\n"
            + "\n".join(bad[:50])
            + (f"\n  ... and {len(bad) - 50} more" if len(bad) > 50 else "")
        )


# A pure test starts no process and touches no network: checked while it runs, from the
# interpreter's audit events (PEP 578; sys.addaudithook cannot be removed, so the hook is
# installed once and reads the flag below). Python 3.11 has no audit event for time.sleep or a
# thread start: a pure test's real-time waits are found by `--durations` instead.
_NOT_PURE = frozenset(
    {
        "subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
        "os.exec", "pty.spawn", "socket.bind", "socket.connect", "socket.sendto",
        "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname",
    }
)  # fmt: skip
_pure_running: list[str] = []  # the events the running pure test caused
_in_pure = [False]  # set from a pure test's setup to the end of its call


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _in_pure[0] and event in _NOT_PURE:
        _pure_running.append(f"{event}{str(args)[:120]}")


sys.addaudithook(_audit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _pure_running.clear()
    _in_pure[0] = item.get_closest_marker("pure") is not None
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        result = yield  # a test that failed on its own fails with its own error
    finally:
        _in_pure[0] = False
    if _pure_running:
        seen, _pure_running[:] = list(_pure_running), []
        pytest.fail(
            "marked pure but started a process or used the network (mark it process): "
            + "; ".join(seen[:3]),
            pytrace=False,
        )
    return result


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
