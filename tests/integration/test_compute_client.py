"""The one Compute API client (lib/compute) as the action chain uses it, against the fake API
(a real HTTP server with the real request semantics)."""

from __future__ import annotations

import math

import pytest
from gce_watchdog.daemon.actions import GoogleComputeApi
from gce_watchdog.daemon.metawatch import InstanceInfo
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry, classify
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault
from google.auth.transport.requests import AuthorizedSession
from google.oauth2.credentials import Credentials
from hypothesis import given
from hypothesis import strategies as st

RID1 = "6c3c4f1e-2b8a-4f57-9f57-0f3c1f1c0a01"
RID2 = "6c3c4f1e-2b8a-4f57-9f57-0f3c1f1c0a02"


# A wall time 15 s into a minute: a rate limit without Retry-After waits 45 s, to the next one.
WALL = 1_800_000_015.0


def _chain_api(api: FakeComputeAPI, token: str = "tok") -> GoogleComputeApi:
    session = AuthorizedSession(Credentials(token))  # type: ignore[no-untyped-call]
    client = ComputeClient(session, api.base_url, 2.0, ComputeRetry(attempts=1), 2.0)
    return GoogleComputeApi(api.base_url, 2.0, client=client, wall=lambda: WALL)


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
def test_chain_results_take_a_rate_limit_as_gce_answers_it() -> None:
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-1")
        inst = InstanceInfo("test-project", "us-central1-a", "vm-1", "1")
        api.retry_after = None
        api.set_fault("delete", Fault.RATE_LIMIT, count=1)  # GCE: 403 rateLimitExceeded
        r = _chain_api(api).act("delete", inst, RID1)
        assert (r.ok, r.http, r.retryable, r.wait_at_least) == (False, 403, True, 45.0)
        api.retry_after = "3"
        api.set_fault("delete", Fault.TOO_MANY_REQUESTS, count=1)
        r = _chain_api(api).act("delete", inst, RID1)
        assert (r.ok, r.http, r.retryable, r.wait_at_least) == (False, 429, True, 3.0)
        r = _chain_api(api).act("delete", inst, RID1)
        assert r.ok and api.instance("vm-1").deleted


@pytest.mark.pure
@pytest.mark.parametrize(
    ("status", "reason", "transient"),
    [
        (0, "", True),  # no answer: a timeout, a refused connection
        (429, "", True),
        (429, "rateLimitExceeded", True),
        (403, "rateLimitExceeded", True),
        (403, "userRateLimitExceeded", True),
        (403, "forbidden", False),
        (403, "", False),
        (500, "", True),
        (502, "", True),
        (503, "backendError", True),
        (504, "", True),
        (501, "", False),  # not implemented: it never will be
        (505, "", False),
        (400, "invalid", False),
        (401, "", False),
        (404, "notFound", False),
        (409, "", False),
        (412, "", False),
    ],
)
def test_one_classifier_for_the_poller_and_the_chain(
    status: int, reason: str, transient: bool
) -> None:
    assert classify(status, reason, None, WALL).transient is transient


@pytest.mark.pure
@given(now=st.floats(0, 4e9), after=st.none() | st.floats(0, 3600))
def test_a_rate_limit_waits_its_retry_after_else_the_next_minute(
    now: float, after: float | None
) -> None:
    for status, reason in ((403, "rateLimitExceeded"), (429, "")):
        c = classify(status, reason, after, now)
        assert c.transient and c.rate_limited and c.wait_at_least is not None
        if after is not None:
            assert c.wait_at_least == after
        else:
            assert 0 < c.wait_at_least <= 60
            end = now + c.wait_at_least
            assert math.isclose(end / 60, round(end / 60), abs_tol=1e-6)


@pytest.mark.pure
def test_a_server_error_honours_a_retry_after_and_has_no_wait_without_one() -> None:
    assert classify(503, "", 5.0, WALL).wait_at_least == 5.0
    assert classify(503, "", None, WALL).wait_at_least is None
    assert classify(403, "forbidden", 5.0, WALL).wait_at_least is None
