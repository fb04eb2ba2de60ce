"""Shared pytest fixtures. Keep this file small: feature fixtures live in their own modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from netns import Topology, iptables_unavailable, netns_unavailable


@pytest.fixture
def topo() -> Iterator[Topology]:
    """A fresh vm/gce namespace pair (tests/netns.py); skips with the reason where unavailable."""
    why = netns_unavailable() or iptables_unavailable()
    if why:
        pytest.skip(f"netns: {why}")
    with Topology() as t:
        yield t
