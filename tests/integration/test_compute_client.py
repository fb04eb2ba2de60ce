"""The one Compute API client (lib/compute) as the action chain uses it, against the fake API
(a real HTTP server with the real request semantics)."""

from __future__ import annotations

from gce_watchdog.daemon.actions import GoogleComputeApi
from gce_watchdog.daemon.metawatch import InstanceInfo
from gce_watchdog.lib.compute import ComputeClient, RetryPolicy
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault
from google.auth.transport.requests import AuthorizedSession
from google.oauth2.credentials import Credentials

RID1 = "6c3c4f1e-2b8a-4f57-9f57-0f3c1f1c0a01"
RID2 = "6c3c4f1e-2b8a-4f57-9f57-0f3c1f1c0a02"


def _chain_api(api: FakeComputeAPI, token: str = "tok") -> GoogleComputeApi:
    session = AuthorizedSession(Credentials(token))  # type: ignore[no-untyped-call]
    client = ComputeClient(session, api.base_url, 2.0, RetryPolicy(attempts=1), 2.0)
    return GoogleComputeApi(api.base_url, 2.0, client=client)


def test_chain_deletes_and_stops_through_the_shared_client() -> None:
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-1")
        api.add_instance("vm-2")
        chain = _chain_api(api)
        r = chain.act("delete", InstanceInfo("test-project", "us-central1-a", "vm-1", "1"), RID1)
        assert r.ok and r.http == 200 and r.detail != "-"
        r = chain.act("stop", InstanceInfo("test-project", "us-central1-a", "vm-2", "2"), RID2)
        assert r.ok
        assert [c.query.get("requestId") for c in api.calls_to("delete")] == [RID1]


def test_chain_results_say_what_to_retry() -> None:
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-1")
        inst = InstanceInfo("test-project", "us-central1-a", "vm-1", "1")
        api.set_fault("delete", Fault.SERVER_ERROR, count=1)
        r = _chain_api(api).act("delete", inst, RID1)
        assert (r.ok, r.http, r.retryable) == (False, 503, True)
        api.set_fault("delete", Fault.REFUSE, count=1)
        r = _chain_api(api).act("delete", inst, RID1)
        assert (r.ok, r.http, r.retryable) == (False, 403, False)
        r = _chain_api(api, token="wrong").act("delete", inst, RID1)
        # the API's 401 makes google-auth refresh, which cannot: a token failure, worth a retry
        assert (r.ok, r.http, r.retryable) == (False, None, True) and r.detail.startswith("token")
