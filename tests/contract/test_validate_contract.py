"""What ``gce-watchdog validate`` sends and what the fake's instances.insert does, against the
vendored discovery document: every field of an insert body is declared by the ``Instance``
schema (with the right types and enums), the fake refuses undeclared ones, and it keeps what
validate relies on (metadata, labels, scheduling; requestId; 409 on a second insert)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import requests
from contract.test_simcompute_discovery import AUTH, load_doc, schema_errors
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
from gce_watchdog.testing import simcompute
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.validate import plan as P
from gce_watchdog.validate.gce import ValidateApi
from gce_watchdog.validate.scenarios import SCENARIOS
from google.oauth2.credentials import Credentials

pytestmark = pytest.mark.process

Z = "us-central1-a"


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", serial_needs_running=True) as a:
        a.add_zone("p", Z)
        yield a


def bodies() -> list[dict[str, object]]:
    src = P.AgentSource(deb_url="https://example.com/a.deb", deb_sha256="a" * 64)
    plan = P.make_plan("vtest1", "p", Z, list(SCENARIOS.values()), src, "#!/bin/bash\n",
                       spot=True)  # fmt: skip
    return [v.body for v in plan.vms]


def test_the_fakes_insert_fields_are_the_instance_schema() -> None:
    doc = load_doc()
    assert set(doc["schemas"]["Instance"]["properties"]) == simcompute.INSTANCE_FIELDS
    pattern = doc["schemas"]["Instance"]["properties"]["name"]["pattern"]
    assert simcompute.INSTANCE_NAME_RE.pattern == pattern + r"\Z"


def test_every_insert_body_validate_sends_is_declared_by_the_document() -> None:
    doc = load_doc()
    errs = [e for b in bodies() for e in schema_errors(doc, {"$ref": "Instance"}, b, "Instance")]
    assert errs == []
    # The check can fail: a field the schema does not have, a wrong enum value.
    bad = dict(bodies()[0], sheduling={"provisioningModel": "SPOT"})
    assert schema_errors(doc, {"$ref": "Instance"}, bad, "I") == ["I.sheduling: not declared"]
    worse = dict(bodies()[0], scheduling={"provisioningModel": "CHEAP"})
    assert schema_errors(doc, {"$ref": "Instance"}, worse, "I") != []


def post(api: FakeComputeAPI, body: object, rid: str | None = None) -> requests.Response:
    return requests.post(
        f"{api.base_url}/projects/p/zones/{Z}/instances",
        params={"requestId": rid or str(uuid.uuid4())}, json=body, headers=AUTH, timeout=5,
    )  # fmt: skip


def test_insert_keeps_metadata_labels_and_scheduling_and_refuses_what_gce_refuses(
    api: FakeComputeAPI,
) -> None:
    seen: list[str] = []
    api.on_insert.append(lambda inst: seen.append(inst.name))
    body = bodies()[0]
    rid = str(uuid.uuid4())
    r = post(api, body, rid)
    assert r.status_code == 200 and r.json()["operationType"] == "insert"
    assert r.json()["status"] == "DONE"
    again = post(api, body, rid)  # the same requestId: the same operation, nothing new
    assert again.json()["id"] == r.json()["id"] and seen == [body["name"]]
    dup = post(api, body)
    assert dup.status_code == 409 and dup.json()["error"]["errors"][0]["reason"] == "alreadyExists"
    inst = api.instance(str(body["name"]))
    assert inst.status == "RUNNING" and inst.spot and inst.termination_action == "DELETE"
    assert inst.labels == body["labels"]
    assert inst.metadata["startup-script"] == "#!/bin/bash\n"
    got = requests.get(f"{api.base_url}/projects/p/zones/{Z}/instances/{body['name']}",
                       headers=AUTH, timeout=5).json()  # fmt: skip
    assert got["labels"] == body["labels"] and got["machineType"].endswith("/e2-small")
    assert post(api, dict(body, name="Bad_Name")).status_code == 400
    assert post(api, dict(body, name="vm-x", frobnicate=1)).status_code == 400
    assert post(api, [1, 2]).status_code == 400


def test_set_metadata_lands_when_its_operation_is_done(api: FakeComputeAPI) -> None:
    """With no operation delay the effect applies at once (a regression: it was dropped)."""
    post(api, bodies()[0])
    name = str(bodies()[0]["name"])
    url = f"{api.base_url}/projects/p/zones/{Z}/instances/{name}"
    fp = requests.get(url, headers=AUTH, timeout=5).json()["metadata"]["fingerprint"]
    r = requests.post(url + "/setMetadata", params={"requestId": str(uuid.uuid4())},
                      json={"fingerprint": fp, "items": [{"key": "k", "value": "v"}]},
                      headers=AUTH, timeout=5)  # fmt: skip
    assert r.status_code == 200 and r.json()["status"] == "DONE"
    assert api.instance(name).metadata == {"k": "v"}


def test_the_maintenance_call_is_the_documented_method_and_stops_a_vm(api: FakeComputeAPI) -> None:
    """validate's instances.simulateMaintenanceEvent: the document's verb and path, only its
    declared parameters (the fake refuses others with 400), one requestId per call; on a
    TERMINATE VM the stop's operation follows."""
    doc = load_doc()
    m = doc["resources"]["instances"]["methods"]["simulateMaintenanceEvent"]
    fake = simcompute.METHODS[m["id"]]
    assert (m["httpMethod"], m["path"]) == (fake.http, fake.path) == (
        "POST", "projects/{project}/zones/{zone}/instances/{instance}/simulateMaintenanceEvent"
    )  # fmt: skip
    assert set(m["parameters"]) == set(simcompute.METHODS[m["id"]].parameters)
    api.add_instance("vm-m", project="p", zone=Z, on_host_maintenance="TERMINATE")
    client = ComputeClient.create(Credentials("tok"), api_base=api.base_url,
                                  retry=ComputeRetry(attempts=1))  # fmt: skip
    op = ValidateApi(client).simulate_maintenance("p", Z, "vm-m")
    assert op["operationType"] == "simulateMaintenanceEvent" and op["status"] == "DONE"
    (call,) = api.calls_to("simulate_maintenance")
    assert call.method == "POST" and set(call.query) == {"requestId"}
    assert uuid.UUID(call.query["requestId"]).version == 4
    types = [o.type for o in api.zone_operations("vm-m")]
    assert types == ["simulateMaintenanceEvent", simcompute.OP_TERMINATE_ON_MAINTENANCE]
    assert api.instance("vm-m").status == "TERMINATED"
