"""Fixtures for the VM end-to-end scenarios (docs/e2e.md).

They boot a real VM under qemu, about 2 minutes each under TCG, so they run only when asked:
``make e2e`` (sets GCEWD_E2E=1), ``GCEWD_E2E=1 pytest tests/e2e`` or ``pytest -m vm tests/e2e``.
A plain ``pytest`` (what ``make test`` runs beside its own ``make e2e`` step) skips them.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.paths import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gce_watchdog.lib.files import atomic_write

from e2e import shards, vm


def _requested(config: pytest.Config) -> bool:
    return os.environ.get("GCEWD_E2E") == "1" or "vm" in (config.option.markexpr or "")


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs: the shards split the rest
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _requested(config):
        _keep_shard(config, items)
        return
    skip = pytest.mark.skip(reason="VM scenarios run by `make e2e` (or GCEWD_E2E=1, or -m vm)")
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(skip)


def _keep_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GCEWD_E2E_SHARD=I/N (``python -m e2e.shards``, make e2e): keep shard I of the VM tests."""
    text = os.environ.get(shards.SHARD_ENV, "")
    if not text:
        return
    try:
        i, n = shards.parse_shard(text)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    here = Path(__file__).parent
    ours = [it.nodeid for it in items if it.path.is_relative_to(here)]
    others = set(ours) - set(shards.assign(ours, n)[i - 1])
    if others:
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid in others])
        items[:] = [it for it in items if it.nodeid not in others]


@pytest.fixture(scope="session")
def e2e() -> Iterator[vm.Harness]:
    why = vm.unavailable()
    if why:
        pytest.skip(f"e2e: {why}")
    image, www, wheelhouse_s = vm.prepare()
    env = vm.Harness(image, www, wheelhouse_s)
    yield env
    # Merged into the file of earlier runs, so `-k one` updates one scenario's numbers; locked,
    # as the shards of one run (e2e/shards.py) end at about the same time.
    path = vm.BUILD / "timings.json"
    vm.BUILD.mkdir(parents=True, exist_ok=True)
    with open(vm.BUILD / "timings.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            merged = json.loads(path.read_text())
        except (OSError, ValueError):
            merged = {}
        merged.update(env.timings)
        atomic_write(path, (json.dumps(merged, indent=2) + "\n").encode())
