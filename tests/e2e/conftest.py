"""Fixtures for the VM end-to-end scenarios (docs/e2e.md).

They boot a real VM under qemu, about 2 minutes each under TCG, so they run only when asked:
``make e2e`` (sets GCEWD_E2E=1), ``GCEWD_E2E=1 pytest tests/e2e`` or ``pytest -m vm tests/e2e``.
A plain ``pytest`` (what ``make test`` runs beside its own ``make e2e`` step) skips them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.paths import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from e2e import vm


def _requested(config: pytest.Config) -> bool:
    return os.environ.get("GCEWD_E2E") == "1" or "vm" in (config.option.markexpr or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _requested(config):
        return
    skip = pytest.mark.skip(reason="VM scenarios run by `make e2e` (or GCEWD_E2E=1, or -m vm)")
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def e2e() -> Iterator[vm.Harness]:
    why = vm.unavailable()
    if why:
        pytest.skip(f"e2e: {why}")
    image, www, wheelhouse_s = vm.prepare()
    env = vm.Harness(image, www, wheelhouse_s)
    yield env
    # Merged into the file of earlier runs, so `-k one` updates one scenario's numbers.
    path = vm.BUILD / "timings.json"
    try:
        merged = json.loads(path.read_text())
    except (OSError, ValueError):
        merged = {}
    merged.update(env.timings)
    vm.BUILD.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2) + "\n")
