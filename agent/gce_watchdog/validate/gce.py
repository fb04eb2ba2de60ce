"""The Compute API calls ``validate`` makes beyond the poller's: insert, setMetadata, delete,
waiting for zone operations, listing a run's VMs by label. Through the same authorized session
and the same retry policy as :class:`lib.compute.ComputeClient` (an insert and a delete carry a
``requestId``, so a retry is one request to GCE).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from gce_watchdog.lib.compute import (
    RATE_LIMIT_REASONS,
    AuthError,
    ComputeAPIError,
    ComputeClient,
    NotFoundError,
)
from gce_watchdog.validate.plan import LABEL

OP_POLL_S = 2.0  # between two reads of an operation not DONE yet (tests: less)


def request_id() -> str:
    """A new requestId for one call: its retries (inside ComputeRetry.call) reuse it, so a retry
    is one request to GCE. Never derived from the run: GCE keeps a requestId's operation for a
    while, and a second run with the same --run-id would get the first run's insert back (no VM)
    or its delete (the new VM left running)."""
    return str(uuid.uuid4())


class OperationFailed(ComputeAPIError):
    """A zone operation ended DONE with an error."""


class ValidateApi:
    def __init__(
        self,
        client: ComputeClient,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        op_poll_s: float = OP_POLL_S,
    ) -> None:
        self.client = client
        self.sleep = sleep
        self.clock = clock
        self.op_poll_s = op_poll_s

    @property
    def base(self) -> str:
        return self.client.api_base

    def _once(
        self, method: str, url: str, params: dict[str, str], body: object | None
    ) -> dict[str, Any]:
        import requests

        kw: dict[str, Any] = {"params": params, "timeout": self.client.timeout}
        if body is not None:
            kw["json"] = body
        try:
            r = self.client.session.request(method, url, **kw)
        except requests.RequestException as e:
            raise ComputeAPIError(f"{method} {url}: {type(e).__name__}: {e}") from None
        try:
            out = r.json()
        except ValueError:
            out = None
        if r.status_code == 200 and isinstance(out, dict):
            return out
        err = out.get("error", {}) if isinstance(out, dict) else {}
        errs = err.get("errors") if isinstance(err, dict) else None
        reason = ""
        if isinstance(errs, list) and errs and isinstance(errs[0], dict):
            reason = str(errs[0].get("reason", ""))
        message = str(err.get("message", "")) if isinstance(err, dict) else ""
        text = f"{method} {url}: HTTP {r.status_code} {reason}: {message}".rstrip(": ")
        if r.status_code == 404:
            raise NotFoundError(text, 404, reason)
        if r.status_code == 401 or (r.status_code == 403 and reason not in RATE_LIMIT_REASONS):
            raise AuthError(text, r.status_code, reason)
        raise ComputeAPIError(text, r.status_code, reason)

    def call(
        self, method: str, url: str, params: dict[str, str] | None = None, body: object = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = self.client.retry.call(
            f"{method} {url}", lambda: self._once(method, url, params or {}, body)
        )
        return result

    # -- instances -------------------------------------------------------------------------------
    def insert(self, project: str, zone: str, body: dict[str, object]) -> dict[str, Any]:
        """instances.insert; its retries are one insert (one requestId)."""
        url = f"{self.base}/projects/{project}/zones/{zone}/instances"
        return self.call("POST", url, {"requestId": request_id()}, body)

    def get(self, project: str, zone: str, name: str) -> dict[str, Any] | None:
        try:
            return self.call("GET", self.client.instance_url(project, zone, name))
        except NotFoundError:
            return None

    def set_metadata(self, project: str, zone: str, name: str, key: str, value: str) -> None:
        """Set one metadata item (the others kept), with the fingerprint; waits for DONE."""
        inst = self.get(project, zone, name)
        if inst is None:
            raise NotFoundError(f"{name} is gone", 404)
        md = inst.get("metadata") or {}
        items = [i for i in md.get("items") or [] if i.get("key") != key]
        items.append({"key": key, "value": value})
        body = {"fingerprint": md.get("fingerprint", ""), "items": items}
        url = self.client.instance_url(project, zone, name, "/setMetadata")
        op = self.call("POST", url, {"requestId": request_id()}, body)
        self.wait(project, zone, op)

    def simulate_maintenance(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """instances.simulateMaintenanceEvent: its operation, not waited for (the VM's stop is
        what validate watches); its retries are one request (one requestId)."""
        url = self.client.instance_url(project, zone, name, "/simulateMaintenanceEvent")
        return self.call("POST", url, {"requestId": request_id()})

    def delete(self, project: str, zone: str, name: str) -> dict[str, Any] | None:
        """Delete (None: already gone); its retries are one delete (one requestId)."""
        try:
            return self.client.delete_instance(project, zone, name, request_id())
        except NotFoundError:
            return None

    def run_instances(self, project: str, run: str | None) -> list[tuple[str, str, dict[str, Any]]]:
        """(zone, name, instance) of every VM labelled with ``run`` (None: any run)."""
        flt = f'labels.{LABEL} = "{run}"' if run else f"labels.{LABEL}:*"
        out: list[tuple[str, str, dict[str, Any]]] = []
        token = ""
        while True:
            page = self.client.aggregated_instances(project, flt, token)
            for scope, v in (page.get("items") or {}).items():
                for inst in (v or {}).get("instances") or []:
                    out.append((scope.rsplit("/", 1)[-1], str(inst.get("name", "")), inst))
            token = str(page.get("nextPageToken") or "")
            if not token:
                return out

    # -- operations ------------------------------------------------------------------------------
    def wait(self, project: str, zone: str, op: dict[str, Any], within: float = 300.0) -> None:
        """Until the operation is DONE; OperationFailed with its error, TimeoutError after
        ``within`` seconds."""
        deadline = self.clock() + within
        while str(op.get("status")) != "DONE":
            if self.clock() > deadline:
                raise TimeoutError(f"operation {op.get('name')} not DONE after {within:g}s")
            self.sleep(self.op_poll_s)
            op = self.client.get_operation(project, zone, str(op.get("name", "")))
        err = op.get("error")
        if err:
            errs = err.get("errors") or [{}]
            raise OperationFailed(
                f"operation {op.get('operationType')} {op.get('name')} failed: "
                f"{errs[0].get('code', '?')}: {errs[0].get('message', '')}",
                int(op.get("httpErrorStatusCode") or 0),
            )
