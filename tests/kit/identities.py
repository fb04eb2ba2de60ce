"""Fakes for the Pub/Sub worker's identity lookup (``gce_watchdog.poller.identity``).

``TableIdentities`` answers from a table (instance id -> project, zone, name), as the Compute API
would for instances it has: for tests about the stream, not about the lookup (those run
``ComputeIdentities`` against the fake Compute API). ``Batches`` is a subscriber whose pulls hand
out given batches of LogEntries and records the acks (the worker without the emulator).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gce_watchdog.poller.identity import Identity, IdentityUnavailable


class TableIdentities:
    """``resolve`` from a table; ids in ``unavailable`` raise (the API could not say)."""

    def __init__(self, table: Mapping[str, tuple[str, str, str]]) -> None:
        self.table = dict(table)
        self.unavailable: set[str] = set()
        self.asked: list[str] = []

    def resolve(self, instance_id: str) -> Identity | None:
        self.asked.append(instance_id)
        if instance_id in self.unavailable:
            raise IdentityUnavailable("the fake says: try later")
        got = self.table.get(instance_id)
        return None if got is None else Identity(instance_id, *got)

    @classmethod
    def of(
        cls, names: Mapping[str, str] | Iterable[str], project: str, zone: str = "us-central1-a"
    ) -> TableIdentities:
        """Every id with its name (``names``: id -> name, or ids, named ``vm-ID``) in one zone."""
        pairs = names.items() if isinstance(names, Mapping) else ((i, f"vm-{i}") for i in names)
        return cls({i: (project, zone, n) for i, n in pairs})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.table))

    @classmethod
    def load(cls, path: Path) -> TableIdentities:
        return cls({k: (v[0], v[1], v[2]) for k, v in json.loads(path.read_text()).items()})


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data, self.publish_time = data, None


class _Rm:
    def __init__(self, data: bytes, n: int) -> None:
        self.message, self.ack_id = _Msg(data), f"ack-{n}"


class Batches:
    """A subscriber whose pulls hand out the given batches in turn (then nothing)."""

    def __init__(self, batches: list[list[bytes]]) -> None:
        self.batches = [[_Rm(d, i * 1000 + j) for j, d in enumerate(b)]
                        for i, b in enumerate(batches)]  # fmt: skip
        self.acked: list[str] = []

    def pull(self, request: dict[str, Any], timeout: float | None = None) -> Any:
        class R:
            received_messages = self.batches.pop(0) if self.batches else []

        return R()

    def acknowledge(self, request: dict[str, Any]) -> None:
        self.acked += request["ack_ids"]
