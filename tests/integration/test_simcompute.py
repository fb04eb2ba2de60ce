"""The fake Compute API is a real HTTP server with the real serial-port semantics."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import requests
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
AUTH = {"Authorization": "Bearer tok"}


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", window=100, hang_s=2.0) as a:
        a.add_instance("vm-1", project=P, zone=Z)
        yield a


def url(api: FakeComputeAPI, name: str = "vm-1", suffix: str = "") -> str:
    return f"{api.base_url}/projects/{P}/zones/{Z}/instances/{name}{suffix}"


def serial(api: FakeComputeAPI, start: int | None = None, **kw: str) -> requests.Response:
    params = {"port": "1", **kw}
    if start is not None:
        params["start"] = str(start)
    return requests.get(url(api, suffix="/serialPort"), params=params, headers=AUTH, timeout=5)


def test_listens_on_loopback_only(api: FakeComputeAPI) -> None:
    assert api.base_url.startswith("http://127.0.0.1:")


def test_bearer_token_required(api: FakeComputeAPI) -> None:
    assert requests.get(url(api), timeout=5).status_code == 401
    r = requests.get(url(api), headers={"Authorization": "Bearer wrong"}, timeout=5)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == 401
    assert requests.get(url(api), headers=AUTH, timeout=5).status_code == 200
    assert [c.authorized for c in api.calls] == [False, False, True]


def test_a_second_socket_serves_the_same_fake_and_calls_name_peer_and_token(
    api: FakeComputeAPI,
) -> None:
    """serve_socket (the e2e guest's way in: a socket made in its network namespace); each call
    records who asked and with which bearer token, the token kept out of repr."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.2", 0))
    sock.listen(4)
    port = sock.getsockname()[1]
    api.serve_socket(sock)
    base = f"http://127.0.0.2:{port}/compute/v1/projects/{P}/zones/{Z}/instances/vm-1"
    assert requests.get(base, headers=AUTH, timeout=5).status_code == 200
    assert (
        requests.get(url(api), headers={"Authorization": "Bearer nope"}, timeout=5).status_code
        == 401
    )
    via_second, via_first = api.calls[-2:]
    # the peer's address (the kernel's source for 127.0.0.2 is 127.0.0.1; the e2e guest's is its
    # own, 169.254.10.2)
    assert (via_second.client, via_second.bearer, via_second.authorized) == (
        "127.0.0.1",
        "tok",
        True,
    )
    assert (via_first.client, via_first.bearer, via_first.authorized) == (
        "127.0.0.1",
        "nope",
        False,
    )
    assert "tok" not in repr(via_second) and "nope" not in repr(via_first)


def test_serial_start_next_and_kind(api: FakeComputeAPI) -> None:
    api.append_serial("vm-1", b"hello\n")
    body = serial(api, 0).json()
    assert body["kind"] == "compute#serialPortOutput"
    assert (body["contents"], body["start"], body["next"]) == ("hello\n", "0", "6")
    api.append_serial("vm-1", b"world\n")
    body = serial(api, 6).json()
    assert (body["contents"], body["start"], body["next"]) == ("world\n", "6", "12")
    body = serial(api, 12).json()
    assert (body["contents"], body["start"], body["next"]) == ("", "12", "12")
    # start omitted = 0
    assert serial(api).json()["contents"] == "hello\nworld\n"


def test_window_drops_oldest_and_adjusts_start(api: FakeComputeAPI) -> None:
    data = bytes(range(65, 91)) * 6  # 156 bytes into a 100-byte window
    api.append_serial("vm-1", data)
    body = serial(api, 10).json()
    assert body["start"] == "56"  # the oldest byte still held
    assert body["next"] == "156"
    assert body["contents"] == data[56:].decode()


def test_negative_start_is_most_recent_bytes(api: FakeComputeAPI) -> None:
    api.append_serial("vm-1", b"0123456789")
    body = serial(api, -3).json()
    assert (body["contents"], body["start"], body["next"]) == ("789", "7", "10")
    # bounded by the retained window
    api.append_serial("vm-1", b"x" * 200)
    body = serial(api, -1000).json()
    assert body["start"] == "110" and len(body["contents"]) == 100


def test_start_beyond_end_returns_nothing_at_end(api: FakeComputeAPI) -> None:
    api.append_serial("vm-1", b"abc")
    body = serial(api, 50).json()
    assert (body["contents"], body["start"], body["next"]) == ("", "3", "3")


def test_bad_port_and_start(api: FakeComputeAPI) -> None:
    assert serial(api, 0, port="9").status_code == 400
    r = requests.get(
        url(api, suffix="/serialPort"), params={"start": "abc"}, headers=AUTH, timeout=5
    )
    assert r.status_code == 400


def test_instance_status_and_spot(api: FakeComputeAPI) -> None:
    api.add_instance("spot-1", project=P, zone=Z, spot=True, termination_action="DELETE")
    body = requests.get(url(api, "spot-1"), headers=AUTH, timeout=5).json()
    assert body["status"] == "RUNNING"
    assert body["scheduling"]["provisioningModel"] == "SPOT"
    assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
    api.set_status("spot-1", "TERMINATED")
    assert requests.get(url(api, "spot-1"), headers=AUTH, timeout=5).json()["status"] == (
        "TERMINATED"
    )
    assert requests.get(url(api, "nope"), headers=AUTH, timeout=5).status_code == 404
    wrong_zone = url(api).replace(Z, "europe-west4-b")
    assert requests.get(wrong_zone, headers=AUTH, timeout=5).status_code == 404


def test_delete_is_idempotent_by_request_id(api: FakeComputeAPI) -> None:
    rid = str(uuid.uuid4())
    r1 = requests.delete(url(api), params={"requestId": rid}, headers=AUTH, timeout=5)
    r2 = requests.delete(url(api), params={"requestId": rid}, headers=AUTH, timeout=5)
    assert r1.status_code == r2.status_code == 200
    assert r1.json()["id"] == r2.json()["id"]
    assert r1.json()["operationType"] == "delete"
    assert requests.get(url(api), headers=AUTH, timeout=5).status_code == 404
    # a different requestId is a new request: the instance is gone
    other = requests.delete(
        url(api), params={"requestId": str(uuid.uuid4())}, headers=AUTH, timeout=5
    )
    assert other.status_code == 404
    assert len(api.calls_to("delete")) == 3
    bad = requests.delete(url(api), params={"requestId": "not-a-uuid"}, headers=AUTH, timeout=5)
    assert bad.status_code == 400


def test_stop_sets_terminated_once(api: FakeComputeAPI) -> None:
    rid = str(uuid.uuid4())
    r1 = requests.post(url(api, suffix="/stop"), params={"requestId": rid}, headers=AUTH, timeout=5)
    api.set_status("vm-1", "RUNNING")  # someone started it again
    r2 = requests.post(url(api, suffix="/stop"), params={"requestId": rid}, headers=AUTH, timeout=5)
    assert r1.json() == r2.json()
    # the retried request did not stop it a second time
    assert requests.get(url(api), headers=AUTH, timeout=5).json()["status"] == "RUNNING"


def test_rate_limit_refuse_and_counted_faults(api: FakeComputeAPI) -> None:
    api.set_fault("serial", Fault.RATE_LIMIT, count=2)
    r = serial(api, 0)
    assert r.status_code == 403  # GCE answers a rate limit with 403 rateLimitExceeded
    err = r.json()["error"]
    assert err["code"] == 403 and err["errors"][0]["reason"] == "rateLimitExceeded"
    assert serial(api, 0).status_code == 403
    assert serial(api, 0).status_code == 200  # count exhausted
    api.set_fault("serial", Fault.TOO_MANY_REQUESTS, count=1)
    r = serial(api, 0)
    assert r.status_code == 429 and r.json()["error"]["errors"][0]["reason"] == "rateLimitExceeded"
    assert serial(api, 0).status_code == 200
    api.set_fault("delete", Fault.REFUSE)
    r = requests.delete(url(api), headers=AUTH, timeout=5)
    assert r.status_code == 403 and r.json()["error"]["errors"][0]["reason"] == "forbidden"
    assert requests.get(url(api), headers=AUTH, timeout=5).status_code == 200  # not deleted
    api.set_fault("delete", None)
    with pytest.raises(ValueError):
        api.set_fault("bogus", Fault.HANG)


def test_hang_outlasts_client_timeout_and_close_is_prompt() -> None:
    with FakeComputeAPI(token="tok", hang_s=30.0) as api:
        api.add_instance("vm-1", project=P, zone=Z)
        api.set_fault("get", Fault.HANG)
        t0 = time.monotonic()
        with pytest.raises(requests.Timeout):
            requests.get(url(api), headers=AUTH, timeout=(2, 0.3))
        assert time.monotonic() - t0 < 5
        t1 = time.monotonic()
    assert time.monotonic() - t1 < 5  # closing wakes the hanging handler
