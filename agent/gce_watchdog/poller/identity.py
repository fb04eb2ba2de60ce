"""Who an instance id is: its project, zone and name, from the Compute API, never a LogEntry.

A Pub/Sub worker receives LogEntries; their ``resource.labels`` (``project_id``, ``zone``) and the
name label are whatever the publisher wrote. A v3 line is bound to its instance **id** (the
signature covers ``inst=``, and the pin is keyed by id), not to those names: a real, signed line
of VM A republished with VM B's project, zone and name would otherwise make the worker announce
A's failover under B. So before a worker claims or announces, it asks the API who the id is.

:class:`ComputeIdentities` calls ``instances.aggregatedList`` with the filter ``id = ID`` (AIP-160:
a field, an operator, a number; the method's ``filter`` parameter in the discovery document) in
each configured project, in order: the zone comes from the API's answer (its ``zones/ZONE`` key),
never from the LogEntry. The permission is ``compute.instances.list`` (the one fleet mode already
needs); ``instances.get`` would need the zone to ask in, which only the LogEntry has.

- Found: the API's (project, zone, name), cached by id (LRU, ``CACHE_SIZE`` entries, each for
  ``CACHE_TTL_S``: a name can change, ``instances.setName``, so an entry is not kept forever).
- Not found in any configured project, every list complete: ``None`` (deleted, or in a project
  the worker is not configured for). Not cached: the next decision asks again.
- The API could not say (an error after the client's retries, a refused call, a zone the list
  reports unreachable, a project whose list failed): :class:`IdentityUnavailable`; the caller
  looks again later and announces nothing meanwhile. Absence from an incomplete list proves
  nothing (the fleet sweep's rule). For ``HOLD_S`` after such an answer every lookup not in the
  cache is answered so at once, without a request.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gce_watchdog.lib.compute import AuthError, ComputeAPIError

# Entries kept: one per instance that reached a decision within the lifetime; a fleet's worth.
CACHE_SIZE = 16_384
# An entry's lifetime: long enough that an instance's repeated looks (a redelivery, the
# announcement of another worker's claim) cost no request, short next to how rarely names change.
CACHE_TTL_S = 600.0
# After the API could not say, lookups fail at once for this long instead of asking again: an
# outage costs each waiting decision one quick retry later, not the client's whole retry policy
# per decision (which would hold the worker's pull loop for minutes).
HOLD_S = 10.0


@dataclass(frozen=True)
class Identity:
    """An instance as the Compute API names it."""

    instance_id: str
    project: str
    zone: str
    name: str

    @property
    def target(self) -> str:
        """``project/zone/name``: the ledger's name for the instance."""
        return f"{self.project}/{self.zone}/{self.name}"


class IdentityUnavailable(Exception):
    """The API could not say who the instance is (an error, or an incomplete list)."""


class Identities(Protocol):
    """Resolves an instance id to its identity: None when no configured project has it; raises
    :class:`IdentityUnavailable` when the API could not say."""

    def resolve(self, instance_id: str) -> Identity | None: ...


class InstanceLister(Protocol):
    """The part of :class:`gce_watchdog.lib.compute.ComputeClient` used here."""

    def aggregated_instances(
        self, project: str, filter: str = "", page_token: str = "", max_results: int = 500
    ) -> dict[str, Any]: ...


def id_filter(instance_id: str) -> str:
    """The aggregatedList filter for one instance id (AIP-160, a number: no quotes)."""
    if not instance_id.isdigit() or instance_id.startswith("0"):
        raise ValueError(f"instance id {instance_id!r} is not a number")
    return f"id = {instance_id}"


def subscription_project(subscription: str) -> str:
    """``P`` of ``projects/P/subscriptions/S``."""
    return subscription.split("/")[1]


class ComputeIdentities:
    """Identities from ``instances.aggregatedList`` over ``projects``, cached (LRU with a
    lifetime). ``clock``: monotonic seconds, injectable."""

    def __init__(
        self,
        client: InstanceLister,
        projects: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = CACHE_TTL_S,
        size: int = CACHE_SIZE,
        hold_s: float = HOLD_S,
    ) -> None:
        if not projects:
            raise ValueError("the projects to look instances up in are not configured")
        self.client = client
        self.projects = tuple(projects)
        self.clock = clock
        self.ttl_s = ttl_s
        self.size = size
        self.hold_s = hold_s
        self._failed: tuple[float, str] | None = None  # (when, why) the API last could not say
        self.lookups = 0  # instances looked up through the API (cache misses)
        self.requests = 0  # aggregatedList pages asked for
        self._cache: collections.OrderedDict[str, tuple[float, Identity]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def resolve(self, instance_id: str) -> Identity | None:
        now = self.clock()
        with self._lock:
            hit = self._cache.get(instance_id)
            if hit is not None and now - hit[0] < self.ttl_s:
                self._cache.move_to_end(instance_id)
                return hit[1]
            self._cache.pop(instance_id, None)
            failed = self._failed
        if failed is not None and now - failed[0] < self.hold_s:
            raise IdentityUnavailable(
                f"{failed[1]} ({now - failed[0]:.0f}s ago; not asked again yet)"
            )
        try:
            flt = id_filter(instance_id)
        except ValueError:
            return None  # no instance has such an id
        try:
            who = self._look_up(instance_id, flt)
        except IdentityUnavailable as e:
            with self._lock:
                self._failed = (now, str(e))
            raise
        if who is not None:
            with self._lock:
                self._cache[instance_id] = (now, who)
                while len(self._cache) > self.size:
                    self._cache.popitem(last=False)
        return who

    def _look_up(self, instance_id: str, flt: str) -> Identity | None:
        self.lookups += 1
        incomplete: list[str] = []
        for project in self.projects:
            token = ""
            for _ in range(1000):  # bounded: one id matches one instance, on one page
                try:
                    body = self.client.aggregated_instances(project, flt, token)
                except AuthError as e:
                    raise IdentityUnavailable(f"the instance list of {project}: {e}") from None
                except ComputeAPIError as e:  # gave up after its retries, or a 404 project
                    incomplete.append(f"the instance list of {project} failed: {e}")
                    break
                self.requests += 1
                who, lost = _match(project, instance_id, body)
                if who is not None:
                    return who
                incomplete += [f"zone {z} of {project} is unreachable" for z in lost]
                token = str(body.get("nextPageToken") or "")
                if not token:
                    break
        if incomplete:
            raise IdentityUnavailable("; ".join(incomplete))
        return None


def _match(
    project: str, instance_id: str, body: dict[str, Any]
) -> tuple[Identity | None, list[str]]:
    """The instance with this id on one aggregatedList page (the filter is not trusted to have
    matched exactly: the id is compared), and the zones the page says it could not reach."""
    lost: list[str] = []
    items = body.get("items") or {}
    for scope, entry in items.items() if isinstance(items, dict) else ():
        if not str(scope).startswith("zones/") or not isinstance(entry, dict):
            continue
        zone = str(scope)[len("zones/") :]
        warning = entry.get("warning") or {}
        if isinstance(warning, dict) and warning.get("code") == "UNREACHABLE":
            lost.append(zone)
        for inst in entry.get("instances") or []:
            if isinstance(inst, dict) and str(inst.get("id", "")) == instance_id:
                return Identity(instance_id, project, zone, str(inst.get("name", ""))), []
    for scope in body.get("unreachables") or []:
        if str(scope).startswith("zones/"):
            lost.append(str(scope)[len("zones/") :])
    return None, lost
