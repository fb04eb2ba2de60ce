"""The fake Compute API against Google's own discovery document (issue 23, item 1).

``tests/data/discovery/compute.v1.subset.json`` is the vendored part of ``compute.v1.json`` from
google-api-python-client (revision in the file). These tests fail when the fake's method table,
its status enums, or the fields and types of any response it serves disagree with the document;
the mutation tests show that they can fail.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from gce_watchdog.testing import simcompute
from gce_watchdog.testing.simcompute import FakeComputeAPI
from kit.paths import REPO

pytestmark = pytest.mark.process

DOC_PATH = REPO / "tests" / "data" / "discovery" / "compute.v1.subset.json"
P, Z = "test-project", "us-central1-a"
AUTH = {"Authorization": "Bearer tok"}
_INT64 = re.compile(r"-?\d+\Z")
_UINT64 = re.compile(r"\d+\Z")


def load_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DOC_PATH.read_text())
    return doc


def doc_methods(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for res in doc["resources"].values():
        for m in res["methods"].values():
            out[m["id"]] = m
    return out


def method_errors(doc: dict[str, Any]) -> list[str]:
    """Where the fake's method table, standard parameters or enums differ from the document."""
    errs = []
    methods = doc_methods(doc)
    for mid, m in simcompute.METHODS.items():
        d = methods.get(mid)
        if d is None:
            errs.append(f"{mid}: not in the document")
            continue
        if d["httpMethod"] != m.http:
            errs.append(f"{mid}: http {m.http} != {d['httpMethod']}")
        if d["path"] != m.path:
            errs.append(f"{mid}: path {m.path} != {d['path']}")
        if set(d["parameters"]) != m.parameters:
            errs.append(f"{mid}: parameters {sorted(m.parameters ^ set(d['parameters']))} differ")
    if set(doc["parameters"]) != simcompute.STANDARD_PARAMETERS:
        errs.append("standard parameters differ")
    s = doc["schemas"]
    if tuple(s["Instance"]["properties"]["status"]["enum"]) != simcompute.INSTANCE_STATUSES:
        errs.append("Instance.status enum differs")
    if tuple(s["Operation"]["properties"]["status"]["enum"]) != simcompute.OPERATION_STATUSES:
        errs.append("Operation.status enum differs")
    sched = s["Scheduling"]["properties"]
    if tuple(sched["onHostMaintenance"]["enum"]) != simcompute.ON_HOST_MAINTENANCE:
        errs.append("Scheduling.onHostMaintenance enum differs")
    if sched["automaticRestart"]["type"] != "boolean":
        errs.append("Scheduling.automaticRestart is not a boolean")
    return errs


def schema_errors(doc: dict[str, Any], schema: dict[str, Any], value: Any, at: str) -> list[str]:
    """Every field of ``value`` the schema does not declare, or of the wrong type or enum."""
    if "$ref" in schema:
        ref = schema["$ref"]
        if ref in doc["schemas"]:
            return schema_errors(doc, doc["schemas"][ref], value, at)
        assert ref in doc["x-vendored"]["opaqueRefs"], ref
        return [] if isinstance(value, dict) else [f"{at}: not an object ({ref})"]
    kind = schema.get("type")
    errs: list[str] = []
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{at}: not an object"]
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            if k in props:
                errs += schema_errors(doc, props[k], v, f"{at}.{k}")
            elif extra is not None:
                errs += schema_errors(doc, extra, v, f"{at}[{k}]")
            else:
                errs.append(f"{at}.{k}: not declared")
        return errs
    if kind == "array":
        if not isinstance(value, list):
            return [f"{at}: not an array"]
        for i, v in enumerate(value):
            errs += schema_errors(doc, schema["items"], v, f"{at}[{i}]")
        return errs
    if kind == "string":
        if not isinstance(value, str):
            return [f"{at}: not a string ({value!r})"]
        fmt = schema.get("format")
        if fmt == "int64" and not _INT64.match(value):
            errs.append(f"{at}: not an int64 string")
        if fmt == "uint64" and not _UINT64.match(value):
            errs.append(f"{at}: not a uint64 string")
        if "enum" in schema and value not in schema["enum"]:
            errs.append(f"{at}: {value!r} not in the enum")
        return errs
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{at}: not an integer"]
    if kind == "boolean":
        return [] if isinstance(value, bool) else [f"{at}: not a boolean"]
    return [f"{at}: schema type {kind!r} not handled"]


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", serial_needs_running=True) as a:
        yield a


def _url(api: FakeComputeAPI, path: str) -> str:
    return f"{api.base_url}/{path}"


def served_responses(api: FakeComputeAPI) -> list[tuple[str, dict[str, Any]]]:
    """One answer of every served method, each 200, with the fields the fake can produce."""
    api.add_instance("vm-1", project=P, zone=Z, spot=True, labels={"gce-watchdog": "on"})
    api.add_instance("vm-2", project=P, zone=Z)
    api.add_zone(P, "europe-west4-b")  # a zone with no instance: a warning in the list
    api.append_serial("vm-1", b"hello\n")
    base = f"projects/{P}/zones/{Z}"
    out: list[tuple[str, dict[str, Any]]] = []

    def call(mid: str, method: str, path: str, **kw: Any) -> dict[str, Any]:
        r = requests.request(method, _url(api, path), headers=AUTH, timeout=5, **kw)
        assert r.status_code == 200, (mid, r.status_code, r.text)
        body: dict[str, Any] = r.json()
        out.append((mid, body))
        return body

    call("compute.instances.get", "GET", f"{base}/instances/vm-1")
    call("compute.instances.getSerialPortOutput", "GET", f"{base}/instances/vm-1/serialPort",
         params={"port": "1", "start": "0"})  # fmt: skip
    call("compute.instances.list", "GET", f"{base}/instances", params={"maxResults": "1"})
    call("compute.instances.aggregatedList", "GET", f"projects/{P}/aggregated/instances",
         params={"filter": 'labels.gce-watchdog = "on"'})  # fmt: skip
    vm1 = api.instance("vm-1").id  # the Pub/Sub worker's lookup by id (AIP-160, a number)
    one = call("compute.instances.aggregatedList", "GET", f"projects/{P}/aggregated/instances",
               params={"filter": f"id = {vm1}"})  # fmt: skip
    found = [i for e in one["items"].values() for i in e.get("instances", [])]
    assert [(i["id"], i["name"]) for i in found] == [(vm1, "vm-1")]
    for zone, via in (("asia-east1-a", "warning"), ("asia-east1-b", "unreachables")):
        api.add_instance(f"vm-{via}", project=P, zone=zone)
        api.set_unreachable(P, zone, via)
    lost = call("compute.instances.aggregatedList", "GET", f"projects/{P}/aggregated/instances")
    assert lost["items"]["zones/asia-east1-a"]["warning"]["code"] == "UNREACHABLE"
    assert lost["unreachables"] == ["zones/asia-east1-b"]
    assert "instances" not in lost["items"].get("zones/asia-east1-b", {})
    fp = call("compute.instances.get", "GET", f"{base}/instances/vm-2")["metadata"]["fingerprint"]
    call("compute.instances.setMetadata", "POST", f"{base}/instances/vm-2/setMetadata",
         params={"requestId": str(uuid.uuid4())},
         json={"fingerprint": fp, "items": [{"key": "k", "value": "v"}]})  # fmt: skip
    # the metadata trust check (daemon/mdtrust.py): what the caller holds of what it asks;
    # the request body is TestPermissionsRequest, the answer TestPermissionsResponse
    held = call("compute.instances.testIamPermissions", "POST",
                f"{base}/instances/vm-2/testIamPermissions",
                json={"permissions": ["compute.instances.setMetadata"]})  # fmt: skip
    assert held == {"permissions": ["compute.instances.setMetadata"]}
    request = doc_methods(load_doc())["compute.instances.testIamPermissions"]["request"]
    assert schema_errors(load_doc(), request, {"permissions": ["a.b.c"]}, "request") == []
    api.fail_next_operation(403, "PERMISSION_DENIED", "no")
    call("compute.instances.stop", "POST", f"{base}/instances/vm-2/stop",
         params={"requestId": str(uuid.uuid4())})  # fmt: skip
    op = call("compute.instances.delete", "DELETE", f"{base}/instances/vm-2",
              params={"requestId": str(uuid.uuid4())})  # fmt: skip
    api.preempt("vm-1")
    call("compute.zoneOperations.get", "GET", f"{base}/operations/{op['name']}")
    call("compute.zoneOperations.list", "GET", f"{base}/operations",
         params={"filter": 'operationType = "compute.instances.preempted"'})  # fmt: skip
    call("compute.instances.get", "GET", f"{base}/instances/vm-1")  # TERMINATED now
    api.add_instance("vm-gpu", project=P, zone=Z, on_host_maintenance="TERMINATE")
    api.host_maintenance("vm-gpu")
    flt = f'operationType = "{simcompute.OP_TERMINATE_ON_MAINTENANCE}"'
    call("compute.zoneOperations.list", "GET", f"{base}/operations", params={"filter": flt})
    call("compute.instances.get", "GET", f"{base}/instances/vm-gpu")  # TERMINATED, TERMINATE
    body = {"name": "vm-3", "machineType": f"zones/{Z}/machineTypes/e2-small",
            "labels": {"run": "r1"}, "scheduling": {"provisioningModel": "SPOT"},
            "metadata": {"items": [{"key": "startup-script", "value": "#!/bin/sh"}]}}  # fmt: skip
    call("compute.instances.insert", "POST", f"{base}/instances",
         params={"requestId": str(uuid.uuid4())}, json=body)  # fmt: skip
    call("compute.instances.get", "GET", f"{base}/instances/vm-3")  # RUNNING, with its metadata
    api.add_instance("vm-sim", project=P, zone=Z, on_host_maintenance="TERMINATE")
    call("compute.instances.simulateMaintenanceEvent", "POST",
         f"{base}/instances/vm-sim/simulateMaintenanceEvent",
         params={"requestId": str(uuid.uuid4()), "withExtendedNotifications": "false"})  # fmt: skip
    return out


def response_errors(doc: dict[str, Any], responses: list[tuple[str, dict[str, Any]]]) -> list[str]:
    methods = doc_methods(doc)
    errs = []
    for mid, body in responses:
        schema = methods[mid]["response"]
        errs += schema_errors(doc, schema, body, mid)
    return errs


def test_the_vendored_document_is_the_pinned_revision() -> None:
    doc = load_doc()
    assert doc["revision"] == doc["x-vendored"]["revision"] == "20261106"
    assert (DOC_PATH.parent / "NOTICE").read_text().count("Apache License, Version 2.0") == 1


def test_the_fake_method_table_and_enums_match_the_document() -> None:
    assert method_errors(load_doc()) == []


def test_every_response_the_fake_serves_is_declared_by_the_document(api: FakeComputeAPI) -> None:
    responses = served_responses(api)
    assert {mid for mid, _ in responses} == set(simcompute.METHODS) - {
        "compute.projects.get",
        "compute.zones.get",  # no Project/Zone schema vendored: the poller reads only 404/200
    }
    lists = [b["items"] for mid, b in responses if mid == "compute.zoneOperations.list"]
    assert [[o["operationType"] for o in ops] for ops in lists] == [
        ["compute.instances.preempted"],
        ["compute.instances.terminateOnHostMaintenance"],
    ]
    gpu = [b for mid, b in responses if mid == "compute.instances.get" and b["name"] == "vm-gpu"]
    assert gpu[-1]["status"] == "TERMINATED"
    assert gpu[-1]["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert gpu[-1]["scheduling"]["automaticRestart"] is True
    stopped = next(b for mid, b in responses if mid == "compute.instances.stop")
    assert stopped["status"] == "DONE" and stopped["httpErrorStatusCode"] == 403
    assert response_errors(load_doc(), responses) == []


def test_a_mutated_document_or_a_wrong_fake_field_fails(api: FakeComputeAPI) -> None:
    doc = load_doc()
    responses = served_responses(api)
    assert response_errors(doc, responses) == []
    # the document no longer declares a field the fake sends
    gone = copy.deepcopy(doc)
    del gone["schemas"]["Operation"]["properties"]["progress"]
    assert any("progress: not declared" in e for e in response_errors(gone, responses))
    # the enum loses a value the fake uses
    enum = copy.deepcopy(doc)
    enum["schemas"]["Instance"]["properties"]["status"]["enum"].remove("TERMINATED")
    assert any("not in the enum" in e for e in response_errors(enum, responses))
    assert "Instance.status enum differs" in method_errors(enum)
    # a parameter the fake accepts is no longer declared (or one is added)
    params = copy.deepcopy(doc)
    params["resources"]["instances"]["methods"]["aggregatedList"]["parameters"][
        "returnPartialSuccess"
    ] = {"type": "boolean", "location": "query"}
    assert any("aggregatedList" in e for e in method_errors(params))
    # the maintenance policy loses the value GPU VMs have (or gains one the fake lacks)
    maint = copy.deepcopy(doc)
    maint["schemas"]["Scheduling"]["properties"]["onHostMaintenance"]["enum"].remove("TERMINATE")
    assert any("onHostMaintenance: 'TERMINATE' not in the enum" in e
               for e in response_errors(maint, responses))  # fmt: skip
    assert "Scheduling.onHostMaintenance enum differs" in method_errors(maint)
    # a deliberately wrong fake field: an int64 sent as a JSON number
    wrong = [(mid, copy.deepcopy(b)) for mid, b in responses]
    serial = next(b for mid, b in wrong if mid == "compute.instances.getSerialPortOutput")
    serial["next"] = int(serial["next"])
    assert any("next: not a string" in e for e in response_errors(doc, wrong))


@pytest.mark.parametrize("mid", sorted(simcompute.METHODS))
def test_undeclared_parameters_are_refused_and_standard_ones_accepted(
    api: FakeComputeAPI, mid: str
) -> None:
    api.add_instance("vm-1", project=P, zone=Z)
    m = simcompute.METHODS[mid]
    path = m.path.format(
        project=P, zone=Z, instance="vm-1", resource="vm-1", operation="operation-1"
    )
    bad = requests.request(
        m.http, _url(api, path), params={"returnPartialSuccess": "true"}, headers=AUTH, timeout=5
    )
    assert bad.status_code == 400
    assert "returnPartialSuccess" in bad.json()["error"]["message"]
    ok = requests.request(
        m.http, _url(api, path), params={"prettyPrint": "false"}, headers=AUTH, timeout=5
    )
    assert ok.status_code != 400 or "Unknown name" not in ok.text


def test_zero_request_id_is_refused_and_ids_are_per_instance(api: FakeComputeAPI) -> None:
    api.add_instance("vm-1", project=P, zone=Z)
    api.add_instance("vm-2", project=P, zone=Z)
    base = f"projects/{P}/zones/{Z}/instances"
    zero = requests.delete(
        _url(api, f"{base}/vm-1"), params={"requestId": simcompute.ZERO_UUID}, headers=AUTH,
        timeout=5,
    )  # fmt: skip
    assert zero.status_code == 400 and not api.instance("vm-1").deleted
    rid = str(uuid.uuid4())
    for name in ("vm-1", "vm-2"):
        r = requests.delete(_url(api, f"{base}/{name}"), params={"requestId": rid},
                            headers=AUTH, timeout=5)  # fmt: skip
        assert r.status_code == 200 and r.json()["targetId"] == api.instance(name).id
    assert api.instance("vm-1").deleted and api.instance("vm-2").deleted


def test_operations_and_status_transitions_follow_the_clock() -> None:
    now = [1_800_000_000.0]
    with FakeComputeAPI(
        token="tok", clock=lambda: now[0], stop_delay_s=10.0, op_pending_s=1.0,
        serial_needs_running=True,
    ) as api:  # fmt: skip
        api.add_instance("vm-1", project=P, zone=Z)
        api.append_serial("vm-1", b"x\n")
        base = f"projects/{P}/zones/{Z}"
        r = requests.post(_url(api, f"{base}/instances/vm-1/stop"), headers=AUTH, timeout=5)
        op = r.json()
        assert op["status"] == "PENDING" and api.instance("vm-1").status == "RUNNING"
        now[0] += 2
        got = requests.get(_url(api, f"{base}/operations/{op['name']}"), headers=AUTH, timeout=5)
        assert got.json()["status"] == "RUNNING" and api.instance("vm-1").status == "STOPPING"
        ser = requests.get(_url(api, f"{base}/instances/vm-1/serialPort"), headers=AUTH, timeout=5)
        assert ser.status_code == 503 and ser.json()["error"]["errors"][0]["reason"] == (
            "backendError"
        )
        now[0] += 10
        got = requests.get(_url(api, f"{base}/operations/{op['name']}"), headers=AUTH, timeout=5)
        assert got.json()["status"] == "DONE" and "error" not in got.json()
        assert api.instance("vm-1").status == "TERMINATED"


def test_system_events_are_zone_operations_of_that_instance(api: FakeComputeAPI) -> None:
    spot = api.add_instance("spot-1", project=P, zone=Z, spot=True, termination_action="DELETE")
    api.add_instance("vm-1", project=P, zone=Z)
    api.preempt("spot-1")
    api.guest_shutdown("vm-1")
    assert spot.deleted  # termination action DELETE
    assert api.instance("vm-1").status == "TERMINATED"
    r = requests.get(
        _url(api, f"projects/{P}/zones/{Z}/operations"),
        params={"filter": f'targetId = "{spot.id}"'}, headers=AUTH, timeout=5,
    )  # fmt: skip
    assert [o["operationType"] for o in r.json()["items"]] == ["compute.instances.preempted"]
    assert r.json()["items"][0]["name"].startswith("systemevent-")


def test_host_maintenance_follows_the_maintenance_policy_and_restart_rule(
    api: FakeComputeAPI,
) -> None:
    """``Scheduling.onHostMaintenance``: TERMINATE stops the VM (GPU VMs), MIGRATE keeps it
    running; ``Scheduling.automaticRestart``: restarted only after a stop by Compute Engine,
    never a preemptible VM."""
    gpu = api.add_instance("gpu-1", project=P, zone=Z, on_host_maintenance="TERMINATE")
    api.add_instance("std-1", project=P, zone=Z)
    api.add_instance("spot-1", project=P, zone=Z, spot=True, on_host_maintenance="TERMINATE")
    api.host_maintenance("gpu-1")
    api.host_maintenance("std-1")
    api.host_maintenance("spot-1")
    assert api.instance("gpu-1").status == "TERMINATED"
    assert api.instance("std-1").status == "RUNNING"  # live migration
    r = requests.get(
        _url(api, f"projects/{P}/zones/{Z}/operations"),
        params={"filter": f'targetId = "{gpu.id}"'}, headers=AUTH, timeout=5,
    )  # fmt: skip
    assert [o["operationType"] for o in r.json()["items"]] == [
        "compute.instances.terminateOnHostMaintenance"
    ]
    assert [o.type for o in api.zone_operations("std-1")] == [
        "compute.instances.migrateOnHostMaintenance"
    ]
    with pytest.raises(ValueError, match="not a VM GCE restarts"):
        api.restart("spot-1")  # "Preemptible instances cannot be automatically restarted"
    with pytest.raises(ValueError):
        api.restart("std-1")  # never stopped
    api.restart("gpu-1")
    assert api.instance("gpu-1").status == "RUNNING"
    api.guest_shutdown("gpu-1")
    with pytest.raises(ValueError, match="not stopped by Compute Engine"):
        api.restart("gpu-1")  # the guest's own power-off: not restarted
    api.add_instance("err-1", project=P, zone=Z)
    api.host_error("err-1")
    api.restart("err-1")
    assert api.instance("err-1").status == "RUNNING"
    with pytest.raises(ValueError, match="cannot be automatically restarted"):
        api.add_instance("spot-2", project=P, zone=Z, spot=True, automatic_restart=True)


def test_simulate_maintenance_event_stops_a_terminate_vm_after_its_notice() -> None:
    """``instances.simulateMaintenanceEvent`` (discovery document; Compute Engine docs "Simulate
    a host maintenance event": a VM that does not live-migrate is terminated or restarted by its
    maintenance policy): the caller's operation, then ``terminateOnHostMaintenance``; the guest
    sees TERMINATE_ON_HOST_MAINTENANCE during the notice; a MIGRATE VM stays RUNNING; a repeated
    requestId is one event; a VM that is not RUNNING is refused."""
    now = [1000.0]
    with FakeComputeAPI(token="tok", clock=lambda: now[0], maintenance_notice_s=60.0) as api:
        gpu = api.add_instance("gpu-1", project=P, zone=Z, on_host_maintenance="TERMINATE")
        api.add_instance("std-1", project=P, zone=Z)
        base = f"projects/{P}/zones/{Z}/instances"
        rid = str(uuid.uuid4())

        def simulate(name: str, request_id: str) -> requests.Response:
            url = _url(api, f"{base}/{name}/simulateMaintenanceEvent")
            return requests.post(url, params={"requestId": request_id}, headers=AUTH, timeout=5)

        r = simulate("gpu-1", rid)
        assert r.status_code == 200 and r.json()["operationType"] == "simulateMaintenanceEvent"
        assert simulate("gpu-1", rid).json()["name"] == r.json()["name"]  # the same request
        assert gpu.maintenance_event == "TERMINATE_ON_HOST_MAINTENANCE"
        now[0] += 59.0
        assert api.instance("gpu-1").status == "RUNNING"  # the notice
        types = [o.type for o in api.zone_operations("gpu-1")]
        assert types == ["simulateMaintenanceEvent", simcompute.OP_TERMINATE_ON_MAINTENANCE]
        now[0] += 2.0
        assert [o.status(now[0]) for o in api.zone_operations("gpu-1")] == ["DONE", "DONE"]
        assert api.instance("gpu-1").status == "TERMINATED"
        assert simulate("gpu-1", str(uuid.uuid4())).status_code == 400  # not RUNNING
        assert simulate("std-1", str(uuid.uuid4())).status_code == 200
        now[0] += 61.0
        assert api.instance("std-1").status == "RUNNING"  # live migration
        assert api.instance("std-1").maintenance_event == "NONE"
        api.restart("gpu-1")
        assert gpu.maintenance_event == "NONE"


def test_test_iam_permissions_answers_the_subset_the_callers_role_grants() -> None:
    """instances.testIamPermissions per the discovery document: POST with a
    TestPermissionsRequest, the subset held back (``{}`` when none), 404 for no instance."""
    roles = {"ro": ["compute.instances.get"], "rw": ["compute.instances.setMetadata"]}
    with FakeComputeAPI(token=["ro", "rw", "tok"], roles=roles) as a:
        a.add_instance("vm", project=P, zone=Z)
        url = _url(a, f"projects/{P}/zones/{Z}/instances/vm/testIamPermissions")
        ask = {"permissions": ["compute.instances.setMetadata", "compute.instances.get"]}

        def held(token: str, body: object = ask, u: str = url) -> tuple[int, Any]:
            hdr = {"Authorization": f"Bearer {token}"}
            r = requests.post(u, json=body, headers=hdr, timeout=5)
            return r.status_code, r.json()

        assert held("ro") == (200, {"permissions": ["compute.instances.get"]})
        assert held("rw") == (200, {"permissions": ["compute.instances.setMetadata"]})
        assert held("tok") == (200, ask)  # no role: every permission
        assert held("ro", {"permissions": ["compute.instances.delete"]}) == (200, {})
        assert held("ro", {"permissions": ["compute.*"]})[0] == 400
        assert held("ro", u=url.replace("/vm/", "/nope/"))[0] == 404
        by_id = url.replace("/vm/", f"/{a.instance('vm').id}/")  # resource: "Name or id"
        assert held("rw", u=by_id)[1] == {"permissions": ["compute.instances.setMetadata"]}
        for code, body in (held("ro"), held("tok", {})):
            assert (
                response_errors(load_doc(), [("compute.instances.testIamPermissions", body)]) == []
            )
