"""The ledger's stores keep one concern each (issue 34): no ledger class has more than 20 public
methods, and each SQL store has every member of its protocol (mypy checks the signatures where
the stores are used; this checks that nothing of a protocol is left unimplemented)."""

from __future__ import annotations

import inspect

import pytest
from gce_watchdog.poller import (
    assembly_store,
    freshness_store,
    ledger,
    ledger_db,
    ledger_pg,
    ledgers,
    pin_store,
)

pytestmark = pytest.mark.pure

MODULES = (ledger, pin_store, assembly_store, freshness_store, ledger_db, ledger_pg, ledgers)
MAX_PUBLIC = 20  # issue 34: "no ledger class with more than 20 public methods"
CLASSES = [
    c
    for m in MODULES
    for c in vars(m).values()
    if inspect.isclass(c) and c.__module__ == m.__name__
]


def _public_methods(cls: type) -> list[str]:
    return [n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v)]


@pytest.mark.parametrize(
    "cls",
    CLASSES,
    ids=lambda c: c.__qualname__,
)
def test_no_ledger_class_has_more_than_20_public_methods(cls: type) -> None:
    assert len(CLASSES) >= 10, CLASSES  # the stores, their protocols, the databases, values
    ours = [k for k in cls.__mro__ if k.__module__.startswith("gce_watchdog")]
    methods = [n for k in ours for n in _public_methods(k)]
    assert len(set(methods)) <= MAX_PUBLIC, sorted(set(methods))


@pytest.mark.parametrize(
    ("impl", "protocol"),
    [
        (ledger.SqlDecisions, ledger.DecisionStore),
        (pin_store.SqlPins, pin_store.PinStore),
        (assembly_store.SqlAssembly, assembly_store.AssemblyStore),
        (freshness_store.SqlFreshness, freshness_store.FreshnessStore),
    ],
)
def test_each_sql_store_has_every_member_of_its_protocol(impl: type, protocol: type) -> None:
    wanted = {n for n in vars(protocol) if not n.startswith("_")}
    wanted |= set(getattr(protocol, "__annotations__", {}))
    assert wanted, "the protocol lists nothing: the test would pass vacuously"
    missing = {n for n in wanted if not hasattr(impl, n)}
    assert not missing


def test_a_ledger_gives_three_stores_over_one_connection(tmp_path: object) -> None:
    from pathlib import Path

    with ledgers.open_ledger(Path(str(tmp_path)) / "l.sqlite", owner="me") as led:
        assert led.decisions.db is led.pins.db is led.assembly.db is led.db
        assert led.freshness.db is led.db
        assert led.decisions.owner == led.db.owner == "me"
