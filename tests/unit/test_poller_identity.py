"""The Pub/Sub worker's identity lookup (poller/identity.py) with a fake lister: who an instance
id is comes from instances.aggregatedList with ``id = ID`` in the configured projects, cached
(LRU, with a lifetime); an incomplete answer is never taken for "not found"."""

from __future__ import annotations

from typing import Any

import pytest
from gce_watchdog.lib.compute import AuthError, GaveUpError, NotFoundError
from gce_watchdog.poller.identity import (
    ComputeIdentities,
    Identity,
    IdentityUnavailable,
    id_filter,
    subscription_project,
)

pytestmark = pytest.mark.pure


def _inst(iid: str, name: str) -> dict[str, Any]:
    return {"id": iid, "name": name, "status": "RUNNING"}


class Lister:
    """aggregatedList over a table {project: {zone: [instances]}}: honours ``id = N`` (the
    filter can be ignored, ``ignore_filter``: the id is still compared), errors per project,
    unreachable zones as GCE reports them (``unreachables``, or a zone's UNREACHABLE warning)."""

    def __init__(self, table: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
        self.table = table
        self.calls: list[tuple[str, str]] = []
        self.errors: dict[str, Exception] = {}
        self.unreachable: dict[str, str] = {}  # zone -> "unreachables" | "warning"
        self.ignore_filter = False

    def aggregated_instances(
        self, project: str, filter: str = "", page_token: str = "", max_results: int = 500
    ) -> dict[str, Any]:
        self.calls.append((project, filter))
        if project in self.errors:
            raise self.errors[project]
        want = filter.removeprefix("id = ")
        items: dict[str, Any] = {}
        body: dict[str, Any] = {"items": items}
        for zone, insts in self.table.get(project, {}).items():
            how = self.unreachable.get(zone)
            if how == "unreachables":
                body.setdefault("unreachables", []).append(f"zones/{zone}")
                continue
            if how == "warning":
                items[f"zones/{zone}"] = {"warning": {"code": "UNREACHABLE"}}
                continue
            here = [i for i in insts if self.ignore_filter or i["id"] == want]
            items[f"zones/{zone}"] = (
                {"instances": here} if here else {"warning": {"code": "NO_RESULTS_ON_PAGE"}}
            )
        return body


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


TABLE = {
    "proj-a": {"us-central1-a": [_inst("111", "vm-a")], "europe-west4-b": []},
    "proj-b": {"us-east1-c": [_inst("222", "vm-b")]},
}


def test_the_id_is_looked_up_in_each_configured_project_the_zone_from_the_api() -> None:
    api = Lister(TABLE)
    ids = ComputeIdentities(api, ["proj-a", "proj-b"], Clock())
    assert ids.resolve("222") == Identity("222", "proj-b", "us-east1-c", "vm-b")
    assert api.calls == [("proj-a", "id = 222"), ("proj-b", "id = 222")]
    assert ids.resolve("111") == Identity("111", "proj-a", "us-central1-a", "vm-a")
    assert ids.resolve("111").target == "proj-a/us-central1-a/vm-a"  # type: ignore[union-attr]


def test_an_answer_is_cached_for_its_lifetime_then_asked_again() -> None:
    api, clock = Lister(TABLE), Clock()
    ids = ComputeIdentities(api, ["proj-a"], clock, ttl_s=600.0)
    for _ in range(5):
        assert ids.resolve("111") is not None
    assert len(api.calls) == 1 and ids.lookups == 1
    clock.t += 599.0
    ids.resolve("111")
    assert len(api.calls) == 1
    clock.t += 2.0  # past its lifetime: a renamed instance (instances.setName) is seen
    api.table["proj-a"]["us-central1-a"] = [_inst("111", "vm-renamed")]
    assert ids.resolve("111") == Identity("111", "proj-a", "us-central1-a", "vm-renamed")
    assert len(api.calls) == 2


def test_the_cache_is_bounded_least_recently_used_goes_first() -> None:
    insts = [_inst(str(100 + i), f"vm-{i}") for i in range(10)]
    api = Lister({"proj-a": {"us-central1-a": insts}})
    ids = ComputeIdentities(api, ["proj-a"], Clock(), size=3)
    for iid in ("100", "101", "102"):
        ids.resolve(iid)
    ids.resolve("100")  # used: now the most recent
    ids.resolve("103")  # evicts 101
    n = len(api.calls)
    ids.resolve("100")
    ids.resolve("102")
    assert len(api.calls) == n  # still cached
    ids.resolve("101")
    assert len(api.calls) == n + 1  # evicted, asked again
    assert len(ids._cache) == 3


def test_not_found_in_any_configured_project_is_none_and_not_cached() -> None:
    api = Lister(TABLE)
    ids = ComputeIdentities(api, ["proj-a"], Clock())
    assert ids.resolve("222") is None  # VM B is in proj-b, which is not configured
    assert ids.resolve("222") is None
    assert len(api.calls) == 2
    assert ids.resolve("not-a-number") is None and len(api.calls) == 2


def test_the_filter_is_not_trusted_the_id_is_compared() -> None:
    api = Lister(TABLE)
    api.ignore_filter = True  # every instance of the project comes back
    ids = ComputeIdentities(api, ["proj-a", "proj-b"], Clock())
    assert ids.resolve("222") == Identity("222", "proj-b", "us-east1-c", "vm-b")
    assert ids.resolve("333") is None


@pytest.mark.parametrize("how", ["unreachables", "warning"])
def test_an_unreachable_zone_makes_absence_prove_nothing(how: str) -> None:
    api = Lister(TABLE)
    api.unreachable["europe-west4-b"] = how
    ids = ComputeIdentities(api, ["proj-a"], Clock(), hold_s=0.0)
    with pytest.raises(IdentityUnavailable, match="europe-west4-b"):
        ids.resolve("999")
    assert ids.resolve("111") is not None  # found elsewhere: found


@pytest.mark.parametrize(
    "error",
    [
        GaveUpError("gave up after 5 attempts", 503),
        NotFoundError("project not found", 404),
        AuthError("Required 'compute.instances.list' permission", 403, "forbidden"),
    ],
)
def test_a_failed_list_is_unavailable_never_not_found(error: Exception) -> None:
    api = Lister(TABLE)
    api.errors["proj-a"] = error
    ids = ComputeIdentities(api, ["proj-a", "proj-b"], Clock(), hold_s=0.0)
    with pytest.raises(IdentityUnavailable, match="proj-a"):
        ids.resolve("999")
    if not isinstance(error, AuthError):  # another project's answer still counts
        assert ids.resolve("222") is not None


def test_filters_and_projects() -> None:
    assert id_filter("8541000000000000001") == "id = 8541000000000000001"
    for bad in ("", "0", "012", "1 OR name = x", "-1"):
        with pytest.raises(ValueError):
            id_filter(bad)
    assert subscription_project("projects/my-proj/subscriptions/serial") == "my-proj"
    with pytest.raises(ValueError):
        ComputeIdentities(Lister({}), [])


def test_after_a_failure_lookups_fail_at_once_for_the_hold_then_ask_again() -> None:
    """An outage costs a waiting decision one quick answer, not the client's whole retry policy
    per decision (which would hold the worker's pull loop)."""
    api, clock = Lister(TABLE), Clock()
    api.errors["proj-a"] = GaveUpError("gave up after 5 attempts", 503)
    ids = ComputeIdentities(api, ["proj-a"], clock, hold_s=10.0)
    with pytest.raises(IdentityUnavailable, match="gave up"):
        ids.resolve("111")
    assert len(api.calls) == 1
    clock.t += 9.0
    with pytest.raises(IdentityUnavailable, match="not asked again yet"):
        ids.resolve("111")
    assert len(api.calls) == 1
    del api.errors["proj-a"]
    clock.t += 1.0
    assert ids.resolve("111") is not None and len(api.calls) == 2
